//! The CUDA branch of `ops/reduce.rs`: sum and max (with argmax) over one axis of `x`
//! viewed as `[outer, n, inner]`, and the backward of the max.

use kernels::cuda::embedding::embedding_backward;
use kernels::cuda::reduce as launch;

use super::{accumulated, cuda_error, output};
use crate::{DType, Error, Result, Tensor};

/// `Σ_j x[o, j, i]` as a tensor of `shape` (`outer·inner` elements).
pub(crate) fn sum_axis(x: &Tensor, (outer, n, inner): (usize, usize, usize), shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "sum_axis";
    let dev = x.cuda_device(OP)?;
    let x = dense_f32(x, OP)?;
    if n == 0 {
        // The sum of nothing is 0 (and the column-sum kernel takes no empty grid).
        return accumulated(&dev, OP, shape, |_| Ok(()));
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
    let values =
        output(&dev, OP, shape, |out| Ok(launch::max_axis(&dev, x.cuda_f32(OP)?, outer, n, inner, out, &mut argmax)?))?;
    let argmax = dev.download(&argmax).map_err(|e| cuda_error(OP, e))?;
    Ok((values, argmax.into_iter().map(|j| j as usize).collect()))
}

/// `dx[o, argmax[o, i], i] = dy[o, i]`, zero elsewhere, as a tensor of `shape`: a
/// scatter of `dy` (dim-1 rows) to flat positions computed on the host from `argmax`
/// (each position distinct, so the result is exact). `argmax` entries are `< n`.
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
    let positions: Vec<u32> =
        argmax.iter().enumerate().map(|(slot, &j)| ((slot / inner * n + j) * inner + slot % inner) as u32).collect();
    let positions = dev.upload(&positions).map_err(|e| cuda_error(OP, e))?;
    accumulated(&dev, OP, shape, |dx| Ok(embedding_backward(&dev, &positions, dy.cuda_f32(OP)?, 1, dx)?))
}

/// A dense view of an f32 tensor (the CPU kernels take f32 only; so do these).
fn dense_f32(x: &Tensor, op: &'static str) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: x.dtype() });
    }
    x.dense()
}

/// `Σ_t Σ_i t[i]²` in f64 over GPU tensors, all on one device, waiting for it once (the
/// global gradient norm for clipping). An empty list sums to 0.
pub fn sum_squares(tensors: &[Tensor]) -> Result<f64> {
    const OP: &str = "sum_squares";
    let Some(first) = tensors.first() else { return Ok(0.0) };
    let dev = first.cuda_device(OP)?;
    let dense = tensors
        .iter()
        .map(|t| {
            first.same_device(OP, t)?;
            dense_f32(t, OP)
        })
        .collect::<Result<Vec<_>>>()?;
    let buffers = dense.iter().map(|t| t.cuda_f32(OP)).collect::<Result<Vec<_>>>()?;
    Ok(launch::sum_squares_all(&dev, &buffers)?)
}
