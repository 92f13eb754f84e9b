//! The CUDA branch of `ops/batch_norm.rs`: batch normalisation through
//! `kernels::cuda::batch_norm` (training forward and backward, evaluation forward).
//!
//! The evaluation backward has no kernel of its own; it is composed of launchers that
//! compute exactly its formulas: `d/dx = dy·weight/√(rv + eps)` is the evaluation forward
//! applied to `dy` with a zero mean and no bias, and `d/dweight = Σ dy·x̂`, `d/dbias = Σ dy`
//! (with `x̂ = (x − rm)·rstd`, `rstd = 1/√(rv + eps)`) are the sums the training backward
//! computes when given `rm` and that `rstd` as its statistics (its own `dx`, which subtracts
//! batch terms, goes to a scratch buffer that is dropped).

use std::sync::Arc;

use kernels::cuda::elementwise::{scalar_forward, unary_forward, Binary, Unary};
use kernels::cuda::{batch_norm as launch, DeviceBuffer};

use super::{output, CudaStorage};
use crate::ops::{BatchNormGrads, BatchNormOutput};
use crate::{Error, Result, Storage, Tensor};

/// `(N, C, S)`: batch, channels and plane size, checked by the caller.
type Dims = (usize, usize, usize);

/// The running statistics a training forward updates in place.
pub(crate) struct RunningStats<'a> {
    pub(crate) mean: &'a mut Tensor,
    pub(crate) var: &'a mut Tensor,
    pub(crate) momentum: f32,
}

/// The f32 device buffer of `t` for writing in place, first replacing `t` by a private
/// dense copy when it is strided, part of a larger buffer or shared with another tensor
/// (copy-on-write, as `Tensor::as_mut_slice` on the host).
fn owned_f32_mut<'t>(t: &'t mut Tensor, op: &'static str) -> Result<&'t mut DeviceBuffer<f32>> {
    let dense = t.is_contiguous() && t.offset == 0 && t.storage.len() == t.numel();
    let shared = Arc::strong_count(&t.storage) > 1 || Arc::weak_count(&t.storage) > 0;
    if !dense || shared {
        *t = t.deep_copy()?;
    }
    let device = t.device;
    match Arc::get_mut(&mut t.storage) {
        Some(Storage::Cuda(storage)) => storage.f32_buffer_mut(op),
        _ => Err(Error::UnsupportedDevice { op, device }),
    }
}

/// Dense views of optional per-channel tensors.
fn dense_all<const K: usize>(tensors: [Option<&Tensor>; K]) -> Result<[Option<Tensor>; K]> {
    let mut out = [const { None }; K];
    for (slot, t) in out.iter_mut().zip(tensors) {
        *slot = t.map(Tensor::dense).transpose()?;
    }
    Ok(out)
}

/// The f32 buffer of an optional dense tensor.
fn buffer<'t>(t: &'t Option<Tensor>, op: &'static str) -> Result<Option<&'t DeviceBuffer<f32>>> {
    t.as_ref().map(|t| t.cuda_f32(op)).transpose()
}

/// Training forward: `y`, the batch mean and rstd; updates the running statistics.
pub(crate) fn train(
    x: &Tensor,
    (n, c, s): Dims,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    stats: RunningStats,
    eps: f32,
) -> Result<BatchNormOutput> {
    const OP: &str = "batch_norm_train";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    let [w, b] = dense_all([weight, bias])?;
    let mut y = CudaStorage::alloc(&dev, x.numel())?;
    let (mut mean, mut rstd) = (CudaStorage::alloc(&dev, c)?, CudaStorage::alloc(&dev, c)?);
    launch::batch_norm_train_forward(
        &dev,
        x.cuda_f32(OP)?,
        n,
        c,
        s,
        buffer(&w, OP)?,
        buffer(&b, OP)?,
        eps,
        stats.momentum,
        owned_f32_mut(stats.mean, OP)?,
        owned_f32_mut(stats.var, OP)?,
        y.f32_buffer_mut(OP)?,
        mean.f32_buffer_mut(OP)?,
        rstd.f32_buffer_mut(OP)?,
    )?;
    Ok(BatchNormOutput {
        y: Tensor::from_cuda(y, x.shape())?,
        mean: Tensor::from_cuda(mean, &[c])?,
        rstd: Tensor::from_cuda(rstd, &[c])?,
    })
}

/// Evaluation forward with the running statistics `[mean, var]`.
pub(crate) fn eval(
    x: &Tensor,
    (n, c, s): Dims,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    [running_mean, running_var]: [&Tensor; 2],
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "batch_norm_eval";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    let [w, b] = dense_all([weight, bias])?;
    let (rm, rv) = (running_mean.dense()?, running_var.dense()?);
    let (rm, rv) = (rm.cuda_f32(OP)?, rv.cuda_f32(OP)?);
    output(&dev, OP, x.shape(), |y| {
        let (w, b) = (buffer(&w, OP)?, buffer(&b, OP)?);
        Ok(launch::batch_norm_eval_forward(&dev, x.cuda_f32(OP)?, n, c, s, w, b, eps, rm, rv, y)?)
    })
}

/// Zeroed `[C]` gradients for the weight (when there is one) and the bias (when asked).
fn per_channel_zeros(
    dev: &Arc<kernels::cuda::CudaDevice>,
    c: usize,
    weight: bool,
    bias: bool,
) -> Result<[Option<CudaStorage>; 2]> {
    let zeros = |need: bool| need.then(|| CudaStorage::zeros(dev, c)).transpose();
    Ok([zeros(weight)?, zeros(bias)?])
}

/// The f32 buffer of an optional gradient storage, for writing.
fn grad_mut<'s>(s: &'s mut Option<CudaStorage>, op: &'static str) -> Result<Option<&'s mut DeviceBuffer<f32>>> {
    s.as_mut().map(|s| s.f32_buffer_mut(op)).transpose()
}

/// `[dx, dweight?, dbias?]` as [`BatchNormGrads`].
fn grads(dx: Tensor, [dw, db]: [Option<CudaStorage>; 2], c: usize) -> Result<BatchNormGrads> {
    Ok(BatchNormGrads {
        x: dx,
        weight: dw.map(|s| Tensor::from_cuda(s, &[c])).transpose()?,
        bias: db.map(|s| Tensor::from_cuda(s, &[c])).transpose()?,
    })
}

/// Training backward from the saved batch `[mean, rstd]`.
pub(crate) fn train_backward(
    x: &Tensor,
    (n, c, s): Dims,
    weight: Option<&Tensor>,
    [mean, rstd]: [&Tensor; 2],
    dy: &Tensor,
    bias: bool,
) -> Result<BatchNormGrads> {
    const OP: &str = "batch_norm_train_backward";
    let dev = x.cuda_device(OP)?;
    let (x, dy, mean, rstd) = (x.dense()?, dy.dense()?, mean.dense()?, rstd.dense()?);
    let [w] = dense_all([weight])?;
    let mut dx = CudaStorage::zeros(&dev, x.numel())?;
    let mut per_channel = per_channel_zeros(&dev, c, w.is_some(), bias)?;
    {
        let [dw, db] = &mut per_channel;
        launch::batch_norm_train_backward(
            &dev,
            x.cuda_f32(OP)?,
            n,
            c,
            s,
            buffer(&w, OP)?,
            mean.cuda_f32(OP)?,
            rstd.cuda_f32(OP)?,
            dy.cuda_f32(OP)?,
            dx.f32_buffer_mut(OP)?,
            grad_mut(dw, OP)?,
            grad_mut(db, OP)?,
        )?;
    }
    grads(Tensor::from_cuda(dx, x.shape())?, per_channel, c)
}

/// Evaluation backward with the running statistics `[mean, var]` (see the module doc).
#[allow(clippy::too_many_arguments)]
pub(crate) fn eval_backward(
    x: &Tensor,
    (n, c, s): Dims,
    weight: Option<&Tensor>,
    [running_mean, running_var]: [&Tensor; 2],
    eps: f32,
    dy: &Tensor,
    bias: bool,
) -> Result<BatchNormGrads> {
    const OP: &str = "batch_norm_eval_backward";
    let dev = x.cuda_device(OP)?;
    let (x, dy, rm, rv) = (x.dense()?, dy.dense()?, running_mean.dense()?, running_var.dense()?);
    let [w] = dense_all([weight])?;
    let (rm, rv) = (rm.cuda_f32(OP)?, rv.cuda_f32(OP)?);
    // d/dx = dy·weight/√(rv + eps): the evaluation forward of dy with mean 0 and no bias.
    let zero_mean = CudaStorage::zeros(&dev, c)?;
    let dx = output(&dev, OP, x.shape(), |dx| {
        let zero_mean = zero_mean.f32_buffer(OP)?;
        Ok(launch::batch_norm_eval_forward(
            &dev,
            dy.cuda_f32(OP)?,
            n,
            c,
            s,
            buffer(&w, OP)?,
            None,
            eps,
            zero_mean,
            rv,
            dx,
        )?)
    })?;
    let mut per_channel = per_channel_zeros(&dev, c, w.is_some(), bias)?;
    if w.is_some() || bias {
        // d/dweight = Σ dy·(x − rm)·rstd, d/dbias = Σ dy: the training backward's sums at
        // mean rm and rstd = 1/√(rv + eps).
        let mut rstd = CudaStorage::alloc(&dev, c)?;
        let mut shifted = CudaStorage::alloc(&dev, c)?;
        scalar_forward(&dev, Binary::Add, rv, eps, shifted.f32_buffer_mut(OP)?)?;
        unary_forward(&dev, Unary::Rsqrt, shifted.f32_buffer(OP)?, rstd.f32_buffer_mut(OP)?)?;
        let mut scratch = CudaStorage::alloc(&dev, x.numel())?;
        let [dw, db] = &mut per_channel;
        launch::batch_norm_train_backward(
            &dev,
            x.cuda_f32(OP)?,
            n,
            c,
            s,
            None,
            rm,
            rstd.f32_buffer(OP)?,
            dy.cuda_f32(OP)?,
            scratch.f32_buffer_mut(OP)?,
            grad_mut(dw, OP)?,
            grad_mut(db, OP)?,
        )?;
    }
    grads(dx, per_channel, c)
}
