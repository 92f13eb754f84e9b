//! Batched matrix multiply with broadcasting batch dimensions.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `self[..., m, k] · rhs[..., k, n]` (PyTorch `torch.matmul`, rank ≥ 2).
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.matmul(&b)?;
        // dA = dY · Bᵀ, dB = Aᵀ · dY; batch dims that broadcast are summed back.
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            let da = dy.matmul(&last_two_swapped(&b)?)?.sum_to_shape(a.shape())?;
            let db = if a.rank() == 2 && is_transposed_matrix(&b) {
                // B = Wᵀ (a linear layer's weight, W contiguous): compute dW = dYᵀ·A in W's
                // own layout and hand back its transpose, so the gradient reaching W through
                // the transpose's backward is already contiguous (no transposing copy).
                last_two_swapped(&last_two_swapped(dy)?.matmul(&a)?)?
            } else {
                last_two_swapped(&a)?.matmul(dy)?.sum_to_shape(b.shape())?
            };
            Ok(vec![da, db])
        }))
    }
}

/// The view with the last two dimensions swapped.
fn last_two_swapped(t: &Tensor) -> Result<Tensor> {
    t.transpose(t.rank() - 2, t.rank() - 1)
}

/// True for a rank-2 view that is the transpose of a contiguous matrix.
fn is_transposed_matrix(t: &Tensor) -> bool {
    t.rank() == 2 && !t.is_contiguous() && t.transpose(0, 1).is_ok_and(|w| w.is_contiguous())
}
