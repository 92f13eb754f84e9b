//! Launchers of `softmax.cu`: softmax and log-softmax over rows of `cols`, and the fused
//! cross-entropy with an ignore index.
//!
//! Mirrors `cpu::softmax` and `cpu::cross_entropy`. The backward kernels write their gradients. The
//! cross-entropy forward returns the number of rows not ignored, so it waits for the
//! device; a target ≥ `cols` is reported as [`CudaError::Invalid`] (the CPU asserts).

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, CudaError, Result};
use super::launch::{check_owners, int, per_row, ptr, row_threads, size};
use super::module::{Arg, KernelFamily};

const FAMILY: KernelFamily = KernelFamily::Softmax;

/// Rows of `cols` in `len` elements, or a shape error.
fn rows_of(op: &'static str, len: usize, cols: usize) -> Result<usize> {
    ensure(cols > 0 || len == 0, op, || "zero columns".to_string())?;
    ensure(cols == 0 || len.is_multiple_of(cols), op, || format!("length {len} is not a multiple of cols {cols}"))?;
    Ok(len.checked_div(cols).unwrap_or(0))
}

fn forward(
    dev: &CudaDevice,
    op: &'static str,
    x: &DeviceBuffer<f32>,
    cols: usize,
    y: &mut DeviceBuffer<f32>,
    log: bool,
) -> Result<()> {
    check_owners(dev, op, &[x, y])?;
    ensure_len(op, "y", y.len(), x.len())?;
    let rows = rows_of(op, x.len(), cols)?;
    let args = [ptr(x), ptr(y), size(rows), size(cols), int(i32::from(log))];
    dev.launch(FAMILY, "softmax_forward", per_row(rows, row_threads(cols)), &args)
}

fn backward(
    dev: &CudaDevice,
    op: &'static str,
    y: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    cols: usize,
    dx: &mut DeviceBuffer<f32>,
    log: bool,
) -> Result<()> {
    check_owners(dev, op, &[y, dy, dx])?;
    ensure_len(op, "dx", dx.len(), y.len())?;
    ensure_len(op, "dy", dy.len(), y.len())?;
    let rows = rows_of(op, y.len(), cols)?;
    let args = [ptr(y), ptr(dy), ptr(dx), size(rows), size(cols), int(i32::from(log))];
    dev.launch(FAMILY, "softmax_backward", per_row(rows, row_threads(cols)), &args)
}

/// `y = softmax(x)` over rows of `cols`.
pub fn softmax_forward(dev: &CudaDevice, x: &DeviceBuffer<f32>, cols: usize, y: &mut DeviceBuffer<f32>) -> Result<()> {
    forward(dev, "softmax_forward", x, cols, y, false)
}

/// `dx = y ⊙ (dy − Σ dy⊙y)` from the saved output `y`.
pub fn softmax_backward(
    dev: &CudaDevice,
    y: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    cols: usize,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    backward(dev, "softmax_backward", y, dy, cols, dx, false)
}

/// `y = log_softmax(x)` over rows of `cols`.
pub fn log_softmax_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    cols: usize,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    forward(dev, "log_softmax_forward", x, cols, y, true)
}

/// `dx = dy − exp(y)·Σ dy` from the saved output `y`.
pub fn log_softmax_backward(
    dev: &CudaDevice,
    y: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    cols: usize,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    backward(dev, "log_softmax_backward", y, dy, cols, dx, true)
}

/// The kernel's encoding of the ignore index: −1 for none.
fn ignore_code(ignore_index: Option<u32>) -> Arg {
    Arg::I64(ignore_index.map_or(-1, i64::from))
}

/// Per row r: `lse[r] = logsumexp(logits row)`; `losses[r] = lse[r] − logits[r, targets[r]]`,
/// or 0 when `targets[r] == ignore_index`. Returns the number of rows not ignored (waits for
/// the device); a target ≥ `cols` is an error.
pub fn cross_entropy_forward(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    cols: usize,
    targets: &DeviceBuffer<u32>,
    ignore_index: Option<u32>,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<usize> {
    let Some(counters) = launch_cross_entropy(dev, logits, cols, targets, ignore_index, losses, lse)? else {
        return Ok(0);
    };
    let counts = dev.download(&counters)?;
    if counts[1] > 0 {
        let message = format!("{} targets out of range 0..{cols}", counts[1]);
        return Err(CudaError::Invalid { op: "cross_entropy_forward", message });
    }
    Ok(counts[0] as usize)
}

/// [`cross_entropy_forward`] without waiting for the device: for a caller that has checked
/// every target against `cols` and counted the kept rows on the host (the tensor op), so a
/// training step does not stall the GPU's queue in the middle of its forward pass. Rows
/// with a target ≥ `cols` get loss 0 here instead of an error.
pub fn cross_entropy_forward_queued(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    cols: usize,
    targets: &DeviceBuffer<u32>,
    ignore_index: Option<u32>,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<()> {
    launch_cross_entropy(dev, logits, cols, targets, ignore_index, losses, lse).map(drop)
}

/// Checks and queues the forward kernel; returns its counters `[kept rows, targets out of
/// range]` (still being written), or `None` when there are no rows.
fn launch_cross_entropy(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    cols: usize,
    targets: &DeviceBuffer<u32>,
    ignore_index: Option<u32>,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<Option<DeviceBuffer<u32>>> {
    const OP: &str = "cross_entropy_forward";
    check_owners(dev, OP, &[logits, losses, lse])?;
    dev.check_owner(OP, targets)?;
    let rows = targets.len();
    ensure_len(OP, "logits", logits.len(), rows * cols)?;
    ensure_len(OP, "losses", losses.len(), rows)?;
    ensure_len(OP, "lse", lse.len(), rows)?;
    ensure(cols > 0 || rows == 0, OP, || "zero columns".to_string())?;
    if rows == 0 {
        return Ok(None);
    }
    // Dropped by the caller while the kernel may still run: the allocator hands a block out
    // again only to work queued later on the same stream.
    let counters = dev.zeros::<u32>(2)?;
    let args = [
        ptr(logits),
        ptr(targets),
        size(rows),
        size(cols),
        ignore_code(ignore_index),
        ptr(losses),
        ptr(lse),
        ptr(&counters),
    ];
    dev.launch(FAMILY, "cross_entropy_forward", per_row(rows, row_threads(cols)), &args)?;
    Ok(Some(counters))
}

/// The factor of [`cross_entropy_backward`]: `upstream[0] / count`, the gradient of the mean
/// loss (a one-element device buffer, read by the kernel: the host does not wait for it)
/// over the rows it averaged (0 rows: a factor of 0).
#[derive(Clone, Copy, Debug)]
pub struct MeanLossGrad<'a> {
    /// `d L / d loss`, one element.
    pub upstream: &'a DeviceBuffer<f32>,
    /// The rows the loss averaged.
    pub count: usize,
}

/// `dlogits[r] = scale·(softmax(logits[r]) − onehot(targets[r]))` from the saved `lse`, zeros
/// for ignored rows and rows whose target is ≥ `cols` (the forward reports those), with
/// `scale = upstream[0] / count` computed on the device ([`MeanLossGrad`]).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    cols: usize,
    targets: &DeviceBuffer<u32>,
    ignore_index: Option<u32>,
    lse: &DeviceBuffer<f32>,
    scale: MeanLossGrad,
    dlogits: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    check_owners(dev, OP, &[logits, lse, scale.upstream, dlogits])?;
    dev.check_owner(OP, targets)?;
    let rows = targets.len();
    ensure_len(OP, "logits", logits.len(), rows * cols)?;
    ensure_len(OP, "lse", lse.len(), rows)?;
    ensure_len(OP, "upstream", scale.upstream.len(), 1)?;
    ensure_len(OP, "dlogits", dlogits.len(), logits.len())?;
    let args = [
        ptr(logits),
        ptr(targets),
        ptr(lse),
        size(rows),
        size(cols),
        ignore_code(ignore_index),
        ptr(scale.upstream),
        Arg::F32(scale.count as f32),
        ptr(dlogits),
    ];
    dev.launch(FAMILY, "cross_entropy_backward", per_row(rows, row_threads(cols)), &args)
}
