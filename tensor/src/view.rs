//! Views: new shapes and strides over the same storage, no copies (except `contiguous`
//! and a `reshape` of a non-contiguous tensor, which must copy).

use std::sync::Arc;

use crate::shape::contiguous_strides;
use crate::{Error, Result, Storage, Tensor};

impl Tensor {
    /// A row-major copy when the view is strided; the tensor itself when already contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return self.dense();
        }
        let storage = Storage::from_f32(self.to_vec(), self.dtype());
        Tensor::from_storage(storage, &self.shape)
    }

    /// Same elements, new shape (PyTorch `reshape`). One dimension may be `usize::MAX`
    /// to be inferred. A view when contiguous, a copy otherwise.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let shape = self.infer_shape(shape)?;
        let base = self.contiguous()?;
        Ok(Tensor {
            storage: Arc::clone(&base.storage),
            strides: contiguous_strides(&shape),
            shape,
            offset: base.offset,
            device: base.device,
        })
    }

    fn infer_shape(&self, shape: &[usize]) -> Result<Vec<usize>> {
        let numel = self.numel();
        let bad = |reason: String| Error::InvalidShape { op: "reshape", shape: self.shape.clone(), reason };
        let inferred: Vec<usize> = shape.iter().enumerate().filter(|(_, &d)| d == usize::MAX).map(|(i, _)| i).collect();
        let mut out = shape.to_vec();
        match inferred.as_slice() {
            [] => {}
            [axis] => {
                let known: usize = shape.iter().filter(|&&d| d != usize::MAX).product();
                if known == 0 || !numel.is_multiple_of(known) {
                    return Err(bad(format!("cannot infer a dimension of {shape:?}")));
                }
                out[*axis] = numel / known;
            }
            _ => return Err(bad("at most one dimension can be inferred".into())),
        }
        if out.iter().product::<usize>() != numel {
            return Err(bad(format!("cannot view {numel} elements as {out:?}")));
        }
        Ok(out)
    }

    /// Reorders dimensions: output dimension i is input dimension `axes[i]`.
    pub fn permute(&self, axes: &[usize]) -> Result<Tensor> {
        let mut seen = vec![false; self.rank()];
        if axes.len() != self.rank() || axes.iter().any(|&a| a >= self.rank() || std::mem::replace(&mut seen[a], true))
        {
            return Err(Error::InvalidShape {
                op: "permute",
                shape: self.shape.clone(),
                reason: format!("{axes:?} is not a permutation of the axes"),
            });
        }
        let mut out = self.clone();
        out.shape = axes.iter().map(|&a| self.shape[a]).collect();
        out.strides = axes.iter().map(|&a| self.strides[a]).collect();
        Ok(out)
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let rank = self.rank();
        for axis in [a, b] {
            if axis >= rank {
                return Err(Error::AxisOutOfRange { op: "transpose", axis, rank });
            }
        }
        let mut axes: Vec<usize> = (0..rank).collect();
        axes.swap(a, b);
        self.permute(&axes)
    }

    /// The slice `start..start + len` of dimension `axis` (PyTorch `narrow`).
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        let size = self.dim("narrow", axis)?;
        if start + len > size {
            return Err(Error::IndexOutOfRange { op: "narrow", index: start + len, size });
        }
        let mut out = self.clone();
        out.offset += start * self.strides[axis];
        out.shape[axis] = len;
        Ok(out)
    }

    /// Broadcasts size-1 (or missing leading) dimensions to `shape` with stride 0.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let mismatch = || Error::ShapeMismatch { op: "expand", lhs: self.shape.clone(), rhs: shape.to_vec() };
        if shape.len() < self.rank() {
            return Err(mismatch());
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (i, &size) in shape.iter().enumerate().skip(lead) {
            let (own, stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = match own {
                s if s == size => stride,
                1 => 0,
                _ => return Err(mismatch()),
            };
        }
        let mut out = self.clone();
        out.shape = shape.to_vec();
        out.strides = strides;
        Ok(out)
    }

    /// Inserts a size-1 dimension at `axis`.
    pub fn unsqueeze(&self, axis: usize) -> Result<Tensor> {
        if axis > self.rank() {
            return Err(Error::AxisOutOfRange { op: "unsqueeze", axis, rank: self.rank() });
        }
        let mut out = self.clone();
        let stride = self.strides.get(axis).map_or(1, |&s| s * self.shape[axis]);
        out.shape.insert(axis, 1);
        out.strides.insert(axis, stride);
        Ok(out)
    }

    /// Removes the size-1 dimension `axis`.
    pub fn squeeze(&self, axis: usize) -> Result<Tensor> {
        if self.dim("squeeze", axis)? != 1 {
            return Err(Error::InvalidShape {
                op: "squeeze",
                shape: self.shape.clone(),
                reason: format!("dimension {axis} is not of size 1"),
            });
        }
        let mut out = self.clone();
        out.shape.remove(axis);
        out.strides.remove(axis);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        let n = shape.iter().product::<usize>();
        Tensor::from_vec((0..n).map(|i| i as f32).collect(), shape).unwrap()
    }

    #[test]
    fn views_share_storage_and_read_correctly() {
        let t = iota(&[2, 3]);
        let tt = t.transpose(0, 1).unwrap();
        assert!(!tt.is_contiguous());
        assert_eq!(tt.to_vec(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(t.narrow(1, 1, 2).unwrap().to_vec(), vec![1.0, 2.0, 4.0, 5.0]);
        assert_eq!(
            iota(&[3]).reshape(&[1, 3]).unwrap().expand(&[2, 3]).unwrap().to_vec(),
            vec![0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
        );
        assert_eq!(t.reshape(&[usize::MAX, 2]).unwrap().shape(), &[3, 2]);
        assert_eq!(tt.reshape(&[6]).unwrap().to_vec(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(t.unsqueeze(1).unwrap().shape(), &[2, 1, 3]);
        assert_eq!(t.unsqueeze(1).unwrap().squeeze(1).unwrap().to_vec(), t.to_vec());
    }

    #[test]
    fn bad_views_are_errors() {
        let t = iota(&[2, 3]);
        assert!(t.reshape(&[4]).is_err());
        assert!(t.permute(&[0, 0]).is_err());
        assert!(t.narrow(1, 2, 2).is_err());
        assert!(t.expand(&[2, 4]).is_err());
        assert!(t.squeeze(0).is_err());
    }
}
