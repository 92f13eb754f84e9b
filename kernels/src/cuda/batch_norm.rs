//! Launchers of `batch_norm.cu`: batch normalisation of `x[N, C, S]` per channel, training
//! and eval forward, training backward.
//!
//! Mirrors `cpu::batch_norm`: training saves `mean[C]` and `rstd[C]` and updates the running
//! statistics (unbiased variance); gradients are written, not added. Statistics are summed
//! in f64.

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure_len, Result};
use super::launch::{check_owners, elementwise, opt_ptr, per_row, ptr, size, THREADS};
use super::module::{Arg, KernelFamily};

const FAMILY: KernelFamily = KernelFamily::BatchNorm;

/// Checks `x` and the optional per-channel parameters.
#[allow(clippy::too_many_arguments)]
fn check(
    dev: &CudaDevice,
    op: &'static str,
    x: &DeviceBuffer<f32>,
    batch: usize,
    channels: usize,
    spatial: usize,
    weight: Option<&DeviceBuffer<f32>>,
    bias: Option<&DeviceBuffer<f32>>,
) -> Result<()> {
    dev.check_owner(op, x)?;
    ensure_len(op, "x", x.len(), batch * channels * spatial)?;
    for (param, name) in [(weight, "weight"), (bias, "bias")] {
        if let Some(param) = param {
            dev.check_owner(op, param)?;
            ensure_len(op, name, param.len(), channels)?;
        }
    }
    Ok(())
}

/// Training mode: batch statistics; writes `y`, saves `mean[C]` and `rstd[C]`, and updates
/// the running statistics in place (`running = (1 − momentum)·running + momentum·batch`,
/// unbiased variance). `weight`/`bias` `None` = no affine. `batch·spatial` should be ≥ 2.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_train_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    batch: usize,
    channels: usize,
    spatial: usize,
    weight: Option<&DeviceBuffer<f32>>,
    bias: Option<&DeviceBuffer<f32>>,
    eps: f32,
    momentum: f32,
    running_mean: &mut DeviceBuffer<f32>,
    running_var: &mut DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
    mean: &mut DeviceBuffer<f32>,
    rstd: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "batch_norm_train_forward";
    check(dev, OP, x, batch, channels, spatial, weight, bias)?;
    check_owners(dev, OP, &[running_mean, running_var, y, mean, rstd])?;
    for (buffer, name) in
        [(&*running_mean, "running_mean"), (&*running_var, "running_var"), (&*mean, "mean"), (&*rstd, "rstd")]
    {
        ensure_len(OP, name, buffer.len(), channels)?;
    }
    ensure_len(OP, "y", y.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
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
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_eval_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    batch: usize,
    channels: usize,
    spatial: usize,
    weight: Option<&DeviceBuffer<f32>>,
    bias: Option<&DeviceBuffer<f32>>,
    eps: f32,
    running_mean: &DeviceBuffer<f32>,
    running_var: &DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "batch_norm_eval_forward";
    check(dev, OP, x, batch, channels, spatial, weight, bias)?;
    check_owners(dev, OP, &[running_mean, running_var, y])?;
    ensure_len(OP, "running_mean", running_mean.len(), channels)?;
    ensure_len(OP, "running_var", running_var.len(), channels)?;
    ensure_len(OP, "y", y.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
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
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_train_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    batch: usize,
    channels: usize,
    spatial: usize,
    weight: Option<&DeviceBuffer<f32>>,
    mean: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    dx: &mut DeviceBuffer<f32>,
    dweight: Option<&mut DeviceBuffer<f32>>,
    dbias: Option<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "batch_norm_train_backward";
    check(dev, OP, x, batch, channels, spatial, weight, None)?;
    check_owners(dev, OP, &[mean, rstd, dy, dx])?;
    ensure_len(OP, "mean", mean.len(), channels)?;
    ensure_len(OP, "rstd", rstd.len(), channels)?;
    ensure_len(OP, "dy", dy.len(), x.len())?;
    ensure_len(OP, "dx", dx.len(), x.len())?;
    for (grad, name) in [(dweight.as_deref(), "dweight"), (dbias.as_deref(), "dbias")] {
        if let Some(grad) = grad {
            dev.check_owner(OP, grad)?;
            ensure_len(OP, name, grad.len(), channels)?;
        }
    }
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
