//! Batched matrix multiply with broadcasting batch dimensions.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `self[..., m, k] · rhs[..., k, n]` (PyTorch `torch.matmul`, rank ≥ 2).
    ///
    /// The backward takes over the gradient `self` has so far ([`Var::from_op_absorbing`]):
    /// when `self` feeds several products (a block's normalised input read by the q, k and v
    /// projections), `dA = dY·Bᵀ` is added onto the sum of the others by the GEMM itself
    /// ([`Tensor::add_matmul`], BLAS's β = 1) instead of by a separate pass.
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.matmul(&b)?;
        // The backward reads `a` only as a product operand: under bf16 products its bf16 copy
        // alone is kept. (`b`, usually a weight, is held by its parameter anyway.)
        let a = a.saved_for_products();
        // dA = dY · Bᵀ, dB = Aᵀ · dY; batch dims that broadcast are summed back.
        Ok(Var::from_op_absorbing(y, vec![self.clone(), rhs.clone()], move |dy, da_so_far| {
            let b_t = last_two_swapped(&b)?;
            // dY·Bᵀ has A's shape unless A's batch dims were broadcast (then it is summed back).
            let a_broadcast = dy.shape()[..dy.rank() - 1] != a.shape()[..a.rank() - 1];
            let da = match da_so_far {
                Some(so_far) if !a_broadcast => so_far.add_matmul(dy, &b_t)?,
                Some(so_far) => so_far.accumulate(dy.matmul(&b_t)?.sum_to_shape(a.shape())?)?,
                None => dy.matmul(&b_t)?.sum_to_shape(a.shape())?,
            };
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
