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
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::sum_axis(self, (outer, n, inner), &self.reduced_shape(axis, keepdim));
        }
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
    /// On a GPU the indices are downloaded, so this waits for the device.
    pub fn max_axis(&self, axis: usize, keepdim: bool) -> Result<(Tensor, Vec<usize>)> {
        let (outer, n, inner) = self.split_at_axis("max_axis", axis)?;
        if n == 0 {
            return Err(Error::InvalidShape {
                op: "max_axis",
                shape: self.shape.clone(),
                reason: "max of an empty axis".into(),
            });
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::max_axis(self, (outer, n, inner), &self.reduced_shape(axis, keepdim));
        }
        let x = self.contiguous()?;
        let mut out = vec![0.0; outer * inner];
        let mut argmax = vec![0; outer * inner];
        max_axis(x.as_slice()?, outer, n, inner, &mut out, &mut argmax);
        Ok((Tensor::from_vec(out, &self.reduced_shape(axis, keepdim))?, argmax))
    }

    /// The backward of [`Tensor::max_axis`]: `dy` (the reduced shape, with or without the
    /// kept axis) goes to the first maximum of each slice of an input of `shape`, whose
    /// indices along `axis` are `argmax`; every other element gets 0.
    pub fn max_axis_backward(dy: &Tensor, argmax: &[usize], shape: &[usize], axis: usize) -> Result<Tensor> {
        const OP: &str = "max_axis_backward";
        let n = *shape.get(axis).ok_or(Error::AxisOutOfRange { op: OP, axis, rank: shape.len() })?;
        let inner: usize = shape[axis + 1..].iter().product();
        let slots = shape[..axis].iter().product::<usize>() * inner;
        if dy.numel() != slots || argmax.len() != slots {
            return Err(Error::ShapeMismatch { op: OP, lhs: shape.to_vec(), rhs: dy.shape.clone() });
        }
        if let Some(&j) = argmax.iter().find(|&&j| j >= n) {
            return Err(Error::IndexOutOfRange { op: OP, index: j, size: n });
        }
        #[cfg(feature = "cuda")]
        if dy.cuda_storage().is_some() {
            return cuda::max_axis_backward(dy, argmax, (n, inner), shape);
        }
        let dy = dy.contiguous()?;
        let mut dx = crate::pool::zeros(shape.iter().product());
        for (slot, (&g, &j)) in dy.as_slice()?.iter().zip(argmax).enumerate() {
            let (outer, i) = (slot / inner, slot % inner);
            dx[(outer * n + j) * inner + i] += g;
        }
        Tensor::from_vec(dx, shape)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_axis_backward_routes_to_the_first_maximum() {
        // [2, 3, 2]: maxima along axis 1.
        let x = Tensor::from_vec(vec![1., 5., 3., 5., 3., 0., 2., 2., 9., 1., 9., 4.], &[2, 3, 2]).unwrap();
        let (m, argmax) = x.max_axis(1, false).unwrap();
        assert_eq!((m.to_vec(), argmax.clone()), (vec![3., 5., 9., 4.], vec![1, 0, 1, 2]));
        let dy = Tensor::from_vec(vec![10., 20., 30., 40.], &[2, 2]).unwrap();
        let dx = Tensor::max_axis_backward(&dy, &argmax, x.shape(), 1).unwrap();
        assert_eq!(dx.to_vec(), vec![0., 20., 10., 0., 0., 0., 0., 0., 30., 0., 0., 40.]);
        // keepdim gradients have the same elements.
        let dy_kept = dy.reshape(&[2, 1, 2]).unwrap();
        assert_eq!(Tensor::max_axis_backward(&dy_kept, &argmax, x.shape(), 1).unwrap().to_vec(), dx.to_vec());
    }

    #[test]
    fn max_axis_backward_rejects_bad_input() {
        let dy = Tensor::zeros(&[2]);
        assert!(Tensor::max_axis_backward(&dy, &[0, 3], &[2, 3], 1).is_err(), "index past the axis");
        assert!(Tensor::max_axis_backward(&dy, &[0], &[2, 3], 1).is_err(), "too few indices");
        assert!(Tensor::max_axis_backward(&dy, &[0, 0], &[2, 3], 2).is_err(), "axis out of range");
        assert!(Tensor::max_axis_backward(&Tensor::zeros(&[3]), &[0, 0], &[2, 3], 1).is_err(), "dy too long");
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/reduce.rs`: sum and max (with argmax) over one axis of `x`
    //! viewed as `[outer, n, inner]`, and the backward of the max.

    use kernels::cpu::embedding::grouping_table;
    use kernels::cuda::embedding::embedding_backward;
    use kernels::cuda::reduce as launch;

    use crate::cuda::{cuda_error, output};
    use crate::{DType, Error, Result, Tensor};

    /// `Σ_j x[o, j, i]` as a tensor of `shape` (`outer·inner` elements).
    pub(crate) fn sum_axis(x: &Tensor, (outer, n, inner): (usize, usize, usize), shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "sum_axis";
        let dev = x.cuda_device(OP)?;
        let x = dense_f32(x, OP)?;
        if n == 0 {
            // The sum of nothing is 0 (and the column-sum kernel takes no empty grid).
            return Tensor::zeros_on(shape, x.device);
        }
        output(&dev, OP, shape, |out| Ok(launch::sum_axis(&dev, x.cuda_f32(OP)?, outer, n, inner, out)?))
    }

    /// `max_j x[o, j, i]` as a tensor of `shape`, and the first `j` reaching it (downloaded:
    /// the indices are returned to the host, which waits for the GPU). `n > 0`.
    pub(crate) fn max_axis(
        x: &Tensor,
        (outer, n, inner): (usize, usize, usize),
        shape: &[usize],
    ) -> Result<(Tensor, Vec<usize>)> {
        const OP: &str = "max_axis";
        let dev = x.cuda_device(OP)?;
        let x = dense_f32(x, OP)?;
        let mut argmax = dev.alloc::<u32>(outer * inner).map_err(|e| cuda_error(OP, e))?;
        let values = output(&dev, OP, shape, |out| {
            Ok(launch::max_axis(&dev, x.cuda_f32(OP)?, outer, n, inner, out, &mut argmax)?)
        })?;
        let argmax = dev.download(&argmax).map_err(|e| cuda_error(OP, e))?;
        Ok((values, argmax.into_iter().map(|j| j as usize).collect()))
    }

    /// `dx[o, argmax[o, i], i] = dy[o, i]`, zero elsewhere, as a tensor of `shape`: a
    /// scatter of `dy` (dim-1 rows) to flat positions computed on the host from `argmax`
    /// (each position distinct, so the result is exact), grouped and uploaded as the
    /// embedding backward's table. `argmax` entries are `< n`.
    pub(crate) fn max_axis_backward(
        dy: &Tensor,
        argmax: &[usize],
        (n, inner): (usize, usize),
        shape: &[usize],
    ) -> Result<Tensor> {
        const OP: &str = "max_axis_backward";
        let dev = dy.cuda_device(OP)?;
        let dy = dense_f32(dy, OP)?;
        let numel: usize = shape.iter().product();
        if u32::try_from(numel).is_err() {
            return Err(Error::InvalidShape {
                op: OP,
                shape: shape.to_vec(),
                reason: "more than 2³² elements cannot be indexed on the GPU".into(),
            });
        }
        let positions: Vec<u32> = argmax
            .iter()
            .enumerate()
            .map(|(slot, &j)| ((slot / inner * n + j) * inner + slot % inner) as u32)
            .collect();
        let grouping = dev.upload(&grouping_table(&positions)).map_err(|e| cuda_error(OP, e))?;
        output(&dev, OP, shape, |dx| Ok(embedding_backward(&dev, (&grouping).into(), dy.cuda_f32(OP)?, 1, dx)?))
    }

    /// A dense view of an f32 tensor (the CPU kernels take f32 only; so do these).
    fn dense_f32(x: &Tensor, op: &'static str) -> Result<Tensor> {
        contiguous_f32(x, op)?.dense()
    }

    /// `x` as a contiguous f32 tensor (itself when it is one; an error for another type).
    fn contiguous_f32(x: &Tensor, op: &'static str) -> Result<Tensor> {
        if x.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op, expected: DType::F32, got: x.dtype() });
        }
        x.contiguous()
    }

    /// `Σ_t Σ_i t[i]²` in f64 over GPU tensors, all on one device, waiting for it once (the
    /// global gradient norm for clipping). An empty list sums to 0.
    pub fn sum_squares(tensors: &[Tensor]) -> Result<f64> {
        const OP: &str = "sum_squares";
        let Some(first) = tensors.first() else { return Ok(0.0) };
        let dev = first.cuda_device(OP)?;
        // A contiguous tensor is read where it is (a view of part of a buffer too: the packed
        // gradients of a fused gated group).
        let contiguous = tensors
            .iter()
            .map(|t| {
                first.same_device(OP, t)?;
                contiguous_f32(t, OP)
            })
            .collect::<Result<Vec<_>>>()?;
        let runs = contiguous.iter().map(|t| t.cuda_f32_run(OP)).collect::<Result<Vec<_>>>()?;
        Ok(launch::sum_squares_all(&dev, &runs)?)
    }
}
