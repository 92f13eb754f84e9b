//! The CUDA branch of `ops/swiglu.rs`: SwiGLU gating `silu(g) ⊙ u` and its backward.

use kernels::cuda::swiglu as launch;

use super::{output, CudaStorage};
use crate::{Result, Tensor};

/// `silu(gate) ⊙ up`, both of one shape.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu";
    let dev = gate.cuda_device(OP)?;
    let (gate, up) = (gate.dense()?, up.dense()?);
    output(&dev, OP, gate.shape(), |y| Ok(launch::swiglu_forward(&dev, gate.cuda_f32(OP)?, up.cuda_f32(OP)?, y)?))
}

/// `(d/dgate, d/dup)` of `silu(gate) ⊙ up` for the output gradient `dy` (one shape).
pub(crate) fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "swiglu_backward";
    let dev = gate.cuda_device(OP)?;
    let (gate, up, dy) = (gate.dense()?, up.dense()?, dy.dense()?);
    let (mut dgate, mut dup) = (CudaStorage::zeros(&dev, gate.numel())?, CudaStorage::zeros(&dev, up.numel())?);
    launch::swiglu_backward(
        &dev,
        gate.cuda_f32(OP)?,
        up.cuda_f32(OP)?,
        dy.cuda_f32(OP)?,
        dgate.f32_buffer_mut(OP)?,
        dup.f32_buffer_mut(OP)?,
    )?;
    Ok((Tensor::from_cuda(dgate, gate.shape())?, Tensor::from_cuda(dup, up.shape())?))
}
