//! Launchers of `norm.cu`: RMSNorm and LayerNorm over the last axis (`x` is `[N, C]`).
//!
//! Mirrors `cpu::norm`: the forward saves `rstd` (and `mean`) per row; the backward writes
//! `dx = ...` and `dweight`/`dbias = ...` (never reads them). The parameter gradients are column
//! sums over rows in a fixed order (partial sums per chunk of rows, then the chunks in
//! order), so they repeat bit for bit.

use cudarc::driver::LaunchConfig;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, Result};
use super::launch::{check_owners, opt_ptr, per_row, ptr, row_threads, size};
use super::module::{Arg, KernelFamily};
use super::reduce::{chunking, finish_column_sums};

const FAMILY: KernelFamily = KernelFamily::Norm;

/// Checks `x` is whole rows of `cols` and the outputs match; returns the row count.
fn check_rows(op: &'static str, x: usize, cols: usize, out: usize, stats: usize) -> Result<usize> {
    ensure(cols > 0 || x == 0, op, || "zero columns".to_string())?;
    ensure(cols == 0 || x.is_multiple_of(cols), op, || format!("length {x} is not a multiple of cols {cols}"))?;
    ensure_len(op, "output", out, x)?;
    let rows = x.checked_div(cols).unwrap_or(0);
    ensure_len(op, "per-row statistics", stats, rows)?;
    Ok(rows)
}

/// `y = x·rstd·weight`, `rstd = 1/√(mean(x²) + eps)` saved per row.
pub fn rms_norm_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    cols: usize,
    eps: f32,
    y: &mut DeviceBuffer<f32>,
    rstd: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rms_norm_forward";
    check_owners(dev, OP, &[x, weight, y, rstd])?;
    let rows = check_rows(OP, x.len(), cols, y.len(), rstd.len())?;
    ensure_len(OP, "weight", weight.len(), cols)?;
    let args = [ptr(x), ptr(weight), ptr(y), ptr(rstd), size(rows), size(cols), Arg::F32(eps)];
    dev.launch(FAMILY, "rms_norm_forward", per_row(rows, row_threads(cols)), &args)
}

/// `dx = ∂L/∂x` and `dweight = ∂L/∂weight` for RMSNorm, from the saved `rstd`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    cols: usize,
    dx: &mut DeviceBuffer<f32>,
    dweight: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rms_norm_backward";
    check_owners(dev, OP, &[x, weight, rstd, dy, dx, dweight])?;
    let rows = check_rows(OP, x.len(), cols, dx.len(), rstd.len())?;
    ensure(weight.len() == cols && dweight.len() == cols, OP, || "weight length differs from cols".to_string())?;
    ensure_len(OP, "dy", dy.len(), x.len())?;
    let args = [ptr(x), ptr(weight), ptr(rstd), ptr(dy), ptr(dx), size(rows), size(cols)];
    dev.launch(FAMILY, "rms_norm_backward", per_row(rows, row_threads(cols)), &args)?;
    param_grads(dev, x, dy, None, rstd, rows, cols, Some(dweight), None)
}

/// `y = (x − mean)·rstd (· weight + bias if given)`; `mean` and `rstd` saved per row.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: Option<&DeviceBuffer<f32>>,
    bias: Option<&DeviceBuffer<f32>>,
    cols: usize,
    eps: f32,
    y: &mut DeviceBuffer<f32>,
    mean: &mut DeviceBuffer<f32>,
    rstd: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "layer_norm_forward";
    check_owners(dev, OP, &[x, y, mean, rstd])?;
    check_owners(dev, OP, &weight.into_iter().chain(bias).collect::<Vec<_>>())?;
    let rows = check_rows(OP, x.len(), cols, y.len(), rstd.len())?;
    ensure_len(OP, "mean", mean.len(), rows)?;
    ensure(weight.is_none_or(|w| w.len() == cols), OP, || "weight length differs from cols".to_string())?;
    ensure(bias.is_none_or(|b| b.len() == cols), OP, || "bias length differs from cols".to_string())?;
    let args =
        [ptr(x), opt_ptr(weight), opt_ptr(bias), ptr(y), ptr(mean), ptr(rstd), size(rows), size(cols), Arg::F32(eps)];
    dev.launch(FAMILY, "layer_norm_forward", per_row(rows, row_threads(cols)), &args)
}

/// `dx = ∂L/∂x`, and `dweight`/`dbias` = their gradients when given, for LayerNorm.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: Option<&DeviceBuffer<f32>>,
    mean: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    cols: usize,
    dx: &mut DeviceBuffer<f32>,
    dweight: Option<&mut DeviceBuffer<f32>>,
    dbias: Option<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    check_owners(dev, OP, &[x, mean, rstd, dy, dx])?;
    let rows = check_rows(OP, x.len(), cols, dx.len(), rstd.len())?;
    ensure(mean.len() == rows && dy.len() == x.len(), OP, || "mean or dy has the wrong length".to_string())?;
    ensure(weight.is_none_or(|w| w.len() == cols), OP, || "weight length differs from cols".to_string())?;
    ensure(dweight.as_ref().is_none_or(|w| w.len() == cols), OP, || "dweight length differs from cols".to_string())?;
    ensure(dbias.as_ref().is_none_or(|b| b.len() == cols), OP, || "dbias length differs from cols".to_string())?;
    if let Some(w) = weight {
        dev.check_owner(OP, w)?;
    }
    let args = [ptr(x), opt_ptr(weight), ptr(mean), ptr(rstd), ptr(dy), ptr(dx), size(rows), size(cols)];
    dev.launch(FAMILY, "layer_norm_backward", per_row(rows, row_threads(cols)), &args)?;
    param_grads(dev, x, dy, Some(mean), rstd, rows, cols, dweight, dbias)
}

/// `dweight = Σ_rows dy ⊙ x̂`, `dbias = Σ_rows dy` (either may be absent).
#[allow(clippy::too_many_arguments)]
fn param_grads(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    mean: Option<&DeviceBuffer<f32>>,
    rstd: &DeviceBuffer<f32>,
    rows: usize,
    cols: usize,
    dweight: Option<&mut DeviceBuffer<f32>>,
    dbias: Option<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "norm parameter gradients";
    if cols == 0 || (dweight.is_none() && dbias.is_none()) {
        return Ok(());
    }
    for buffer in dweight.iter().chain(dbias.iter()) {
        dev.check_owner(OP, buffer)?;
    }
    let (per_chunk, chunks) = chunking(rows, 1);
    let partial_w = dweight.as_ref().map(|_| dev.alloc::<f32>(chunks * cols)).transpose()?;
    let partial_b = dbias.as_ref().map(|_| dev.alloc::<f32>(chunks * cols)).transpose()?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        ptr(x),
        ptr(dy),
        opt_ptr(mean),
        ptr(rstd),
        size(rows),
        size(cols),
        size(per_chunk),
        opt_ptr(partial_w.as_ref()),
        opt_ptr(partial_b.as_ref()),
    ];
    dev.launch(FAMILY, "norm_param_grads_partial", cfg, &args)?;
    if let (Some(partial), Some(dw)) = (&partial_w, dweight) {
        finish_column_sums(dev, partial, 1, chunks, cols, dw.device_ptr())?;
    }
    if let (Some(partial), Some(db)) = (&partial_b, dbias) {
        finish_column_sums(dev, partial, 1, chunks, cols, db.device_ptr())?;
    }
    Ok(())
}
