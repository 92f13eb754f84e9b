//! The CUDA branch of the embedding lookup in `ops/embedding.rs` and its scatter-add backward.
//! The host ids (already range-checked) are copied to the device for each call.

use kernels::cuda::embedding as launch;

use super::{accumulated, output};
use crate::{Result, Tensor};

/// Rows of `weight: [V, C]` picked by `ids`, as a tensor of `out_shape` (`ids_shape + [C]`).
pub(crate) fn embedding(weight: &Tensor, ids: &[u32], out_shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "embedding";
    let dev = weight.cuda_device(OP)?;
    let dim = weight.dim(OP, 1)?;
    let weight = weight.dense()?;
    let ids = dev.upload(ids)?;
    output(&dev, OP, out_shape, |out| Ok(launch::embedding_forward(&dev, weight.cuda_f32(OP)?, dim, &ids, out)?))
}

/// `dW: [vocab, dim]` with `dW[ids[i]] += dy[i]` (atomic adds: repeated ids agree with the
/// CPU to rounding, not bit for bit).
pub(crate) fn embedding_backward(ids: &[u32], dy: &Tensor, vocab: usize, dim: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    let dev = dy.cuda_device(OP)?;
    let dy = dy.dense()?;
    let ids = dev.upload(ids)?;
    accumulated(&dev, OP, &[vocab, dim], |dw| Ok(launch::embedding_backward(&dev, &ids, dy.cuda_f32(OP)?, dim, dw)?))
}
