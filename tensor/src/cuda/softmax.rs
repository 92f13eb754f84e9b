//! The CUDA branch of the softmax family in `ops/softmax.rs`: softmax and log-softmax over the
//! last axis with their backward, and the fused cross-entropy with its backward.

use kernels::cuda::elementwise::{scalar_forward, Binary};
use kernels::cuda::reduce::sum_axis;
use kernels::cuda::softmax as launch;

use super::{accumulated, output, CudaStorage};
use crate::ops::CrossEntropy;
use crate::{Result, Tensor};

/// Softmax (or log-softmax when `log`) over rows of `cols`.
pub(crate) fn softmax(x: &Tensor, cols: usize, log: bool) -> Result<Tensor> {
    const OP: &str = "softmax";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    output(&dev, OP, x.shape(), |y| {
        let x = x.cuda_f32(OP)?;
        let forward = if log { launch::log_softmax_forward } else { launch::softmax_forward };
        Ok(forward(&dev, x, cols, y)?)
    })
}

/// The backward of softmax (or log-softmax when `log`) from its saved output `y`.
pub(crate) fn softmax_backward(y: &Tensor, dy: &Tensor, cols: usize, log: bool) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    let dev = y.cuda_device(OP)?;
    let (y, dy) = (y.dense()?, dy.dense()?);
    accumulated(&dev, OP, y.shape(), |dx| {
        let backward = if log { launch::log_softmax_backward } else { launch::softmax_backward };
        Ok(backward(&dev, y.cuda_f32(OP)?, dy.cuda_f32(OP)?, cols, dx)?)
    })
}

/// Mean cross-entropy of `[N, cols]` logits against host `targets` (already range-checked):
/// the loss stays on the device as a rank-0 tensor, and nothing waits for the device (the
/// kept rows are counted on the host).
pub(crate) fn cross_entropy(
    logits: &Tensor,
    cols: usize,
    targets: &[u32],
    ignore_index: Option<u32>,
) -> Result<CrossEntropy> {
    const OP: &str = "cross_entropy";
    let dev = logits.cuda_device(OP)?;
    let logits = logits.dense()?;
    let rows = targets.len();
    let count = targets.iter().filter(|&&t| Some(t) != ignore_index).count();
    let targets = dev.upload(targets)?;
    let mut losses = CudaStorage::alloc(&dev, rows)?;
    let mut lse = CudaStorage::alloc(&dev, rows)?;
    launch::cross_entropy_forward_queued(
        &dev,
        logits.cuda_f32(OP)?,
        cols,
        &targets,
        ignore_index,
        losses.f32_buffer_mut(OP)?,
        lse.f32_buffer_mut(OP)?,
    )?;
    // Ignored rows hold loss 0: the mean over counted rows is Σ losses / count.
    let loss = if count == 0 {
        CudaStorage::zeros(&dev, 1)?
    } else {
        let mut total = dev.alloc::<f32>(1)?;
        sum_axis(&dev, losses.f32_buffer(OP)?, 1, rows, 1, &mut total)?;
        let mut mean = CudaStorage::alloc(&dev, 1)?;
        scalar_forward(&dev, Binary::Div, &total, count as f32, mean.f32_buffer_mut(OP)?)?;
        mean
    };
    Ok(CrossEntropy { loss: Tensor::from_cuda(loss, &[])?, lse: Tensor::from_cuda(lse, &[rows])?, count })
}

/// `dlogits = scale·(softmax − onehot)` per row not ignored, from the saved `lse`.
pub(crate) fn cross_entropy_backward(
    logits: &Tensor,
    cols: usize,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy_backward";
    let dev = logits.cuda_device(OP)?;
    let (logits, lse) = (logits.dense()?, lse.dense()?);
    let targets = dev.upload(targets)?;
    accumulated(&dev, OP, logits.shape(), |dlogits| {
        let (logits, lse) = (logits.cuda_f32(OP)?, lse.cuda_f32(OP)?);
        Ok(launch::cross_entropy_backward(&dev, logits, cols, &targets, ignore_index, lse, scale, dlogits)?)
    })
}
