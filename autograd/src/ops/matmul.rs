//! Batched matrix multiply with broadcasting batch dimensions.

use tensor::Result;

use crate::Var;

impl Var {
    /// `self[..., m, k] · rhs[..., k, n]` (PyTorch `torch.matmul`, rank ≥ 2).
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.matmul(&b)?;
        // dA = dY · Bᵀ, dB = Aᵀ · dY; batch dims that broadcast are summed back.
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            let last = |t: &tensor::Tensor| t.transpose(t.rank() - 2, t.rank() - 1);
            let da = dy.matmul(&last(&b)?)?.sum_to_shape(a.shape())?;
            let db = last(&a)?.matmul(dy)?.sum_to_shape(b.shape())?;
            Ok(vec![da, db])
        }))
    }
}
