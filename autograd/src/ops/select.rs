//! `where` / `masked_fill`: pick elementwise between two values by a condition.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `cond ? a : b` elementwise, all three broadcast (PyTorch `torch.where`). `cond` is a
    /// plain tensor (nonzero = true): conditions carry no gradient.
    pub fn select(cond: &Tensor, a: &Var, b: &Var) -> Result<Var> {
        let (a_shape, b_shape) = (a.shape(), b.shape());
        let y = Tensor::select(cond, &a.value_ref(), &b.value_ref())?;
        let cond = cond.clone();
        // d/da = [cond], d/db = [!cond]
        Ok(Var::from_op(y, vec![a.clone(), b.clone()], move |dy| {
            let zero = Tensor::zeros_on(&[], dy.device())?;
            let da = Tensor::select(&cond, dy, &zero)?.sum_to_shape(&a_shape)?;
            let db = Tensor::select(&cond, &zero, dy)?.sum_to_shape(&b_shape)?;
            Ok(vec![da, db])
        }))
    }

    /// Replaces elements where `mask` is nonzero with `value` (PyTorch `masked_fill`).
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Var> {
        let value = Tensor::full_on(&[], value, self.value_ref().device())?;
        Var::select(mask, &Var::constant(value), self)
    }
}
