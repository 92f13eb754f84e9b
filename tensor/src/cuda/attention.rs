//! The CUDA branch of causal attention in `ops/attention.rs`: the flash-style forward (output and
//! per-query log-sum-exp, both left on the device) and its backward. Head dims above
//! `kernels::cuda::attention::MAX_HEAD_DIM` are refused with an error.

use kernels::cuda::attention as launch;

use super::{accumulated, output, CudaStorage};
use crate::{Result, Tensor};

/// `[B, Tq, Tk, H, D]` of shapes the caller has checked.
fn dims(op: &'static str, q: &Tensor, k: &Tensor) -> Result<[usize; 5]> {
    let [b, tq, h, d] = q.dims4(op)?;
    Ok([b, tq, k.dim(op, 1)?, h, d])
}

/// `(out [B, Tq, H, D], lse [B, H, Tq])` of causal attention.
pub(crate) fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Tensor)> {
    const OP: &str = "causal_attention";
    let dev = q.cuda_device(OP)?;
    let [b, tq, tk, h, d] = dims(OP, q, k)?;
    let (q, k, v) = (q.dense()?, k.dense()?, v.dense()?);
    let mut lse = CudaStorage::alloc(&dev, b * h * tq)?;
    let out = output(&dev, OP, q.shape(), |out| {
        let (q, k, v) = (q.cuda_f32(OP)?, k.cuda_f32(OP)?, v.cuda_f32(OP)?);
        Ok(launch::causal_attention_forward(&dev, q, k, v, b, tq, tk, h, d, scale, out, lse.f32_buffer_mut(OP)?)?)
    })?;
    Ok((out, Tensor::from_cuda(lse, &[b, h, tq])?))
}

/// `(dq, dk, dv)` of causal attention from the saved output and `lse`.
pub(crate) fn causal_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "causal_attention_backward";
    let dev = q.cuda_device(OP)?;
    let [b, tq, tk, h, d] = dims(OP, q, k)?;
    let (q, k, v) = (q.dense()?, k.dense()?, v.dense()?);
    let (out, lse, dout) = (out.dense()?, lse.dense()?, dout.dense()?);
    let (mut dk, mut dv) = (CudaStorage::zeros(&dev, k.numel())?, CudaStorage::zeros(&dev, v.numel())?);
    let dq = accumulated(&dev, OP, q.shape(), |dq| {
        let (q, k, v) = (q.cuda_f32(OP)?, k.cuda_f32(OP)?, v.cuda_f32(OP)?);
        let (out, lse, dout) = (out.cuda_f32(OP)?, lse.cuda_f32(OP)?, dout.cuda_f32(OP)?);
        let (dk, dv) = (dk.f32_buffer_mut(OP)?, dv.f32_buffer_mut(OP)?);
        Ok(launch::causal_attention_backward(&dev, q, k, v, out, lse, dout, b, tq, tk, h, d, scale, dq, dk, dv)?)
    })?;
    Ok((dq, Tensor::from_cuda(dk, k.shape())?, Tensor::from_cuda(dv, v.shape())?))
}
