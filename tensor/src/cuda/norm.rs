//! The CUDA branch of RMSNorm and LayerNorm in `ops/norm.rs`: forwards that keep their
//! per-row statistics on the device, and backwards that accumulate into zeroed gradients.

use kernels::cuda::norm as launch;

use super::{accumulated, output, CudaStorage};
use crate::ops::{LayerNormOutput, RmsNormOutput};
use crate::{Result, Tensor};

/// Rows of `cols` in `x` (none when `cols` is 0).
fn rows(x: &Tensor, cols: usize) -> usize {
    x.numel() / cols.max(1)
}

/// RMSNorm of `x` (rows of `cols`) with `weight [cols]`; `rstd` saved per row.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, cols: usize, eps: f32) -> Result<RmsNormOutput> {
    const OP: &str = "rms_norm";
    let dev = x.cuda_device(OP)?;
    let (x, w) = (x.dense()?, weight.dense()?);
    let rows = rows(&x, cols);
    let mut rstd = CudaStorage::alloc(&dev, rows)?;
    let y = output(&dev, OP, x.shape(), |y| {
        Ok(launch::rms_norm_forward(&dev, x.cuda_f32(OP)?, w.cuda_f32(OP)?, cols, eps, y, rstd.f32_buffer_mut(OP)?)?)
    })?;
    Ok(RmsNormOutput { y, rstd: Tensor::from_cuda(rstd, &[rows])? })
}

/// `(dx, dweight)` of RMSNorm from the saved `rstd`.
pub(crate) fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    cols: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rms_norm_backward";
    let dev = x.cuda_device(OP)?;
    let (x, w, rstd, dy) = (x.dense()?, weight.dense()?, rstd.dense()?, dy.dense()?);
    let mut dw = CudaStorage::zeros(&dev, cols)?;
    let dx = accumulated(&dev, OP, x.shape(), |dx| {
        let (x, w, rstd, dy) = (x.cuda_f32(OP)?, w.cuda_f32(OP)?, rstd.cuda_f32(OP)?, dy.cuda_f32(OP)?);
        Ok(launch::rms_norm_backward(&dev, x, w, rstd, dy, cols, dx, dw.f32_buffer_mut(OP)?)?)
    })?;
    Ok((dx, Tensor::from_cuda(dw, &[cols])?))
}

/// LayerNorm of `x` (rows of `cols`) with optional `weight`/`bias [cols]`; `mean` and
/// `rstd` saved per row.
pub(crate) fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    cols: usize,
    eps: f32,
) -> Result<LayerNormOutput> {
    const OP: &str = "layer_norm";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    let w = weight.map(Tensor::dense).transpose()?;
    let b = bias.map(Tensor::dense).transpose()?;
    let rows = rows(&x, cols);
    let (mut mean, mut rstd) = (CudaStorage::alloc(&dev, rows)?, CudaStorage::alloc(&dev, rows)?);
    let y = output(&dev, OP, x.shape(), |y| {
        let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
        let b = b.as_ref().map(|b| b.cuda_f32(OP)).transpose()?;
        let (mean, rstd) = (mean.f32_buffer_mut(OP)?, rstd.f32_buffer_mut(OP)?);
        Ok(launch::layer_norm_forward(&dev, x.cuda_f32(OP)?, w, b, cols, eps, y, mean, rstd)?)
    })?;
    Ok(LayerNormOutput { y, mean: Tensor::from_cuda(mean, &[rows])?, rstd: Tensor::from_cuda(rstd, &[rows])? })
}

/// `(dx, dweight, dbias)` of LayerNorm from the saved `mean` and `rstd`; `dweight` when
/// `weight` is given, `dbias` when `with_bias`.
pub(crate) fn layer_norm_backward(
    x: &Tensor,
    weight: Option<&Tensor>,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    cols: usize,
    with_bias: bool,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    const OP: &str = "layer_norm_backward";
    let dev = x.cuda_device(OP)?;
    let (x, mean, rstd, dy) = (x.dense()?, mean.dense()?, rstd.dense()?, dy.dense()?);
    let w = weight.map(Tensor::dense).transpose()?;
    let mut dw = w.as_ref().map(|_| CudaStorage::zeros(&dev, cols)).transpose()?;
    let mut db = with_bias.then(|| CudaStorage::zeros(&dev, cols)).transpose()?;
    let dx = accumulated(&dev, OP, x.shape(), |dx| {
        let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
        let dw = dw.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
        let db = db.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
        let (x, mean, rstd, dy) = (x.cuda_f32(OP)?, mean.cuda_f32(OP)?, rstd.cuda_f32(OP)?, dy.cuda_f32(OP)?);
        Ok(launch::layer_norm_backward(&dev, x, w, mean, rstd, dy, cols, dx, dw, db)?)
    })?;
    let column = |g: CudaStorage| Tensor::from_cuda(g, &[cols]);
    Ok((dx, dw.map(column).transpose()?, db.map(column).transpose()?))
}
