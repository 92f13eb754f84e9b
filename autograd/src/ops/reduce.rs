//! Reductions: sum, mean and max over an axis, and whole-tensor sum and mean.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Sum over `axis`.
    pub fn sum_axis(&self, axis: usize, keepdim: bool) -> Result<Var> {
        let shape = self.shape();
        let y = self.value_ref().sum_axis(axis, keepdim)?;
        // d(Σx)/dx = 1: the gradient is broadcast back over the summed axis.
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            let dy = if keepdim { dy.clone() } else { dy.unsqueeze(axis)? };
            Ok(vec![dy.expand(&shape)?.contiguous()?])
        }))
    }

    /// Mean over `axis`.
    pub fn mean_axis(&self, axis: usize, keepdim: bool) -> Result<Var> {
        let n = self.value_ref().dim("mean_axis", axis)?;
        self.sum_axis(axis, keepdim)?.mul_scalar(1.0 / n as f32)
    }

    /// Sum of all elements (a rank-0 result).
    pub fn sum_all(&self) -> Result<Var> {
        self.reshape(&[self.value_ref().numel()])?.sum_axis(0, false)
    }

    /// Mean of all elements (a rank-0 result).
    pub fn mean_all(&self) -> Result<Var> {
        let n = self.value_ref().numel();
        self.sum_all()?.mul_scalar(1.0 / n as f32)
    }

    /// Maximum over `axis`; the gradient flows to the first maximal element only.
    pub fn max_axis(&self, axis: usize, keepdim: bool) -> Result<Var> {
        let shape = self.shape();
        let (y, argmax) = self.value_ref().max_axis(axis, keepdim)?;
        // d max/dx_j = [j = argmax]
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            Ok(vec![Tensor::max_axis_backward(dy, &argmax, &shape, axis)?])
        }))
    }
}
