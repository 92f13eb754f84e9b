//! Reductions over one axis (sum, mean, max with argmax) and `sum_to_shape`, the
//! reduction that undoes broadcasting in backward passes.

use kernels::cpu::reduce::{max_axis, sum_axis};

use crate::{Error, Result, Tensor};

impl Tensor {
    /// `(outer, n, inner)` sizes around `axis` for the contiguous layout.
    fn split_at_axis(&self, op: &'static str, axis: usize) -> Result<(usize, usize, usize)> {
        let n = self.dim(op, axis)?;
        let outer = self.shape[..axis].iter().product();
        let inner = self.shape[axis + 1..].iter().product();
        Ok((outer, n, inner))
    }

    fn reduced_shape(&self, axis: usize, keepdim: bool) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if keepdim {
            shape[axis] = 1;
        } else {
            shape.remove(axis);
        }
        shape
    }

    /// Sum over `axis` (PyTorch `x.sum(axis, keepdim)`).
    pub fn sum_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        let (outer, n, inner) = self.split_at_axis("sum_axis", axis)?;
        let x = self.contiguous()?;
        let mut out = crate::pool::zeros(outer * inner);
        sum_axis(x.as_slice()?, outer, n, inner, &mut out);
        Tensor::from_vec(out, &self.reduced_shape(axis, keepdim))
    }

    /// Mean over `axis`.
    pub fn mean_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        let n = self.dim("mean_axis", axis)?;
        self.sum_axis(axis, keepdim)?.scalar_op(kernels::cpu::binary::Binary::Mul, 1.0 / n as f32)
    }

    /// Maximum over `axis` and the index of the first maximum (PyTorch `x.max(axis)`).
    pub fn max_axis(&self, axis: usize, keepdim: bool) -> Result<(Tensor, Vec<usize>)> {
        let (outer, n, inner) = self.split_at_axis("max_axis", axis)?;
        if n == 0 {
            return Err(Error::InvalidShape {
                op: "max_axis",
                shape: self.shape.clone(),
                reason: "max of an empty axis".into(),
            });
        }
        let x = self.contiguous()?;
        let mut out = vec![0.0; outer * inner];
        let mut argmax = vec![0; outer * inner];
        max_axis(x.as_slice()?, outer, n, inner, &mut out, &mut argmax);
        Ok((Tensor::from_vec(out, &self.reduced_shape(axis, keepdim))?, argmax))
    }

    /// Sum of every element, as a rank-0 tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])?.sum_axis(0, false)
    }

    /// Sums the dimensions that broadcasting expanded, so a gradient of the broadcast
    /// shape becomes a gradient of `shape` (the input's).
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape == shape {
            return Ok(self.clone());
        }
        let mismatch = || Error::ShapeMismatch { op: "sum_to_shape", lhs: self.shape.clone(), rhs: shape.to_vec() };
        if shape.len() > self.rank() {
            return Err(mismatch());
        }
        let lead = self.rank() - shape.len();
        let mut out = self.clone();
        // Leading dimensions that broadcasting added are summed away.
        for _ in 0..lead {
            out = out.sum_axis(0, false)?;
        }
        for (axis, &size) in shape.iter().enumerate() {
            match (out.shape[axis], size) {
                (a, b) if a == b => {}
                (_, 1) => out = out.sum_axis(axis, true)?,
                _ => return Err(mismatch()),
            }
        }
        Ok(out)
    }
}
