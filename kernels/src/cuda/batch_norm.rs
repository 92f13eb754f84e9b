//! Launchers of `batch_norm.cu`: batch normalisation of `x[N, C, S]` per channel, training
//! and eval forward, training backward.
//!
//! Mirrors `cpu::batch_norm`: training saves `mean[C]` and `rstd[C]` and updates the running
//! statistics (unbiased variance); gradients are written, not added. Statistics are summed
//! in f64.

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{CudaError, Result};
use super::launch::{check_owners, elementwise, opt_ptr, per_row, ptr, size, THREADS};
use super::module::{Arg, KernelFamily};
pub use crate::cpu::batch_norm::{Affine, BatchNormDims, BatchStats, RunningStats};
pub use crate::cpu::norm::NormGrads;

const FAMILY: KernelFamily = KernelFamily::BatchNorm;

/// Checks that `x` and the optional affine parameters live on `dev`, then
/// [`BatchNormDims::check`] (as on the CPU) as a shape error naming `op`.
fn check(
    dev: &CudaDevice,
    op: &'static str,
    (x, affine): (&DeviceBuffer<f32>, Affine<'_, DeviceBuffer<f32>>),
    dims: &BatchNormDims,
    planes: &[(&str, usize)],
    per_channel: &[(&str, Option<usize>)],
) -> Result<()> {
    dev.check_owner(op, x)?;
    for param in affine.weight.into_iter().chain(affine.bias) {
        dev.check_owner(op, param)?;
    }
    dims.check(planes, per_channel).map_err(|message| CudaError::shape(op, message))
}

/// Training mode: batch statistics; writes `y`, saves `mean[C]` and `rstd[C]`, and updates
/// the running statistics in place (`running = (1 − momentum)·running + momentum·batch`,
/// unbiased variance). `weight`/`bias` `None` = no affine. `batch·spatial` should be ≥ 2.
pub fn batch_norm_train_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    affine: Affine<'_, DeviceBuffer<f32>>,
    dims: &BatchNormDims,
    running: RunningStats<&mut DeviceBuffer<f32>>,
    y: &mut DeviceBuffer<f32>,
    stats: BatchStats<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "batch_norm_train_forward";
    let (RunningStats { mean: running_mean, var: running_var }, BatchStats { mean, rstd }) = (running, stats);
    let (weight, bias) = (affine.weight, affine.bias);
    check_owners(dev, OP, &[running_mean, running_var, y, mean, rstd])?;
    check(
        dev,
        OP,
        (x, affine),
        dims,
        &[("x", x.len()), ("y", y.len())],
        &[
            ("weight", weight.map(|w| w.len())),
            ("bias", bias.map(|b| b.len())),
            ("running_mean", Some(running_mean.len())),
            ("running_var", Some(running_var.len())),
            ("mean", Some(mean.len())),
            ("rstd", Some(rstd.len())),
        ],
    )?;
    if x.is_empty() {
        return Ok(());
    }
    let BatchNormDims { batch, channels, spatial, eps, momentum } = *dims;
    let args = [
        ptr(x),
        opt_ptr(weight),
        opt_ptr(bias),
        ptr(y),
        ptr(mean),
        ptr(rstd),
        ptr(running_mean),
        ptr(running_var),
        size(batch),
        size(channels),
        size(spatial),
        Arg::F32(eps),
        Arg::F32(momentum),
    ];
    dev.launch(FAMILY, "batch_norm_train_forward", per_row(channels, THREADS), &args)
}

/// Eval mode: normalise with the running statistics.
pub fn batch_norm_eval_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    affine: Affine<'_, DeviceBuffer<f32>>,
    dims: &BatchNormDims,
    running: RunningStats<&DeviceBuffer<f32>>,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "batch_norm_eval_forward";
    let RunningStats { mean: running_mean, var: running_var } = running;
    let (weight, bias) = (affine.weight, affine.bias);
    check_owners(dev, OP, &[running_mean, running_var, y])?;
    check(
        dev,
        OP,
        (x, affine),
        dims,
        &[("x", x.len()), ("y", y.len())],
        &[
            ("weight", weight.map(|w| w.len())),
            ("bias", bias.map(|b| b.len())),
            ("running_mean", Some(running_mean.len())),
            ("running_var", Some(running_var.len())),
        ],
    )?;
    if x.is_empty() {
        return Ok(());
    }
    let BatchNormDims { channels, spatial, eps, .. } = *dims;
    let args = [
        ptr(x),
        opt_ptr(weight),
        opt_ptr(bias),
        ptr(running_mean),
        ptr(running_var),
        ptr(y),
        size(x.len()),
        size(channels),
        size(spatial),
        Arg::F32(eps),
    ];
    dev.launch(FAMILY, "batch_norm_eval_forward", elementwise(x.len()), &args)
}

/// Training-mode backward: `dx = ...`, `dweight = Σ dy·x̂`, `dbias = Σ dy` (each optional
/// gradient skipped when `None`).
pub fn batch_norm_train_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: Option<&DeviceBuffer<f32>>,
    stats: BatchStats<&DeviceBuffer<f32>>,
    dy: &DeviceBuffer<f32>,
    dims: &BatchNormDims,
    grads: NormGrads<'_, DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "batch_norm_train_backward";
    let (BatchStats { mean, rstd }, NormGrads { dx, dweight, dbias }) = (stats, grads);
    check_owners(dev, OP, &[mean, rstd, dy, dx])?;
    for grad in dweight.as_deref().into_iter().chain(dbias.as_deref()) {
        dev.check_owner(OP, grad)?;
    }
    check(
        dev,
        OP,
        (x, Affine { weight, bias: None }),
        dims,
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[
            ("weight", weight.map(|w| w.len())),
            ("mean", Some(mean.len())),
            ("rstd", Some(rstd.len())),
            ("dweight", dweight.as_ref().map(|g| g.len())),
            ("dbias", dbias.as_ref().map(|g| g.len())),
        ],
    )?;
    let BatchNormDims { batch, channels, spatial, .. } = *dims;
    let args = [
        ptr(x),
        opt_ptr(weight),
        ptr(mean),
        ptr(rstd),
        ptr(dy),
        ptr(dx),
        opt_ptr(dweight.as_deref()),
        opt_ptr(dbias.as_deref()),
        size(batch),
        size(channels),
        size(spatial),
    ];
    dev.launch(FAMILY, "batch_norm_train_backward", per_row(channels, THREADS), &args)
}
