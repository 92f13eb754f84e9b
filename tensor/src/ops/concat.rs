//! Concatenation along one axis (PyTorch `torch.cat`).

use crate::{Error, Result, Tensor};

impl Tensor {
    /// Joins `tensors` along `axis`; every other dimension must agree.
    pub fn cat(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::InvalidShape {
            op: "cat",
            shape: vec![],
            reason: "nothing to concatenate".into(),
        })?;
        first.dim("cat", axis)?;
        for t in tensors {
            first.same_device("cat", t)?;
            let same_rank = t.rank() == first.rank();
            if !same_rank || (0..t.rank()).any(|d| d != axis && t.shape[d] != first.shape[d]) {
                return Err(Error::ShapeMismatch { op: "cat", lhs: first.shape.clone(), rhs: t.shape.clone() });
            }
        }
        #[cfg(feature = "cuda")]
        if first.cuda_storage().is_some() {
            let mut shape = first.shape.clone();
            shape[axis] = tensors.iter().map(|t| t.shape[axis]).sum();
            return crate::cuda::concat::cat(tensors, axis, &shape);
        }
        let outer: usize = first.shape[..axis].iter().product();
        let inner: usize = first.shape[axis + 1..].iter().product();
        let parts: Vec<Vec<f32>> = tensors.iter().map(|t| t.to_vec()).collect();
        let total: usize = tensors.iter().map(|t| t.shape[axis]).sum();
        let mut out = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            for (t, part) in tensors.iter().zip(&parts) {
                let run = t.shape[axis] * inner;
                out.extend_from_slice(&part[o * run..(o + 1) * run]);
            }
        }
        let mut shape = first.shape.clone();
        shape[axis] = total;
        Tensor::from_vec(out, &shape)
    }
}
