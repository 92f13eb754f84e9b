//! Launchers of `softmax.cu`: softmax and log-softmax over rows of `cols`, and the fused
//! cross-entropy with an ignore index.
//!
//! Mirrors `cpu::softmax` and `cpu::cross_entropy`. The backward kernels write their gradients. The
//! cross-entropy forward returns the number of rows not ignored, so it waits for the
//! device; a target ≥ `cols` is reported as [`CudaError::Invalid`] (the CPU asserts).
//! [`cross_entropy_forward_backward`] is the LM head's chunked pass: the loss of a chunk of
//! rows and their gradient written over their logits, in one launch.

use half::bf16;

use super::allocator::{DeviceBuffer, DeviceRun};
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, CudaError, Result};
use super::launch::{check_owners, int, opt_ptr, per_row, ptr, ptr_at, row_threads, run_ptr_at, size};
use super::module::{Arg, KernelFamily};
use super::values::ValuesMut;

pub use crate::cpu::cross_entropy::CrossEntropyDims;
pub use crate::cpu::softmax::SoftmaxDims;

const FAMILY: KernelFamily = KernelFamily::Softmax;

/// The rows of an input of `len` elements in rows of `cols` whose other operands (name and
/// length) match it ([`SoftmaxDims::of`] and [`SoftmaxDims::check`], as on the CPU), or a
/// shape error naming `op`.
fn rows_of(op: &'static str, (len, cols): (usize, usize), operands: &[(&str, usize)]) -> Result<usize> {
    let dims = SoftmaxDims::of(len, cols).and_then(|dims| dims.check(operands).map(|()| dims));
    Ok(dims.map_err(|message| CudaError::shape(op, message))?.rows)
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
    let rows = rows_of(op, (x.len(), cols), &[("y", y.len())])?;
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
    let rows = rows_of(op, (y.len(), cols), &[("dx", dx.len()), ("dy", dy.len())])?;
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
    targets: &DeviceBuffer<u32>,
    dims: &CrossEntropyDims,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<usize> {
    let Some(counters) = launch_cross_entropy(dev, logits, targets, dims, losses, lse)? else {
        return Ok(0);
    };
    let counts = dev.download(&counters)?;
    if counts[1] > 0 {
        let message = format!("{} targets out of range 0..{}", counts[1], dims.cols);
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
    targets: &DeviceBuffer<u32>,
    dims: &CrossEntropyDims,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<()> {
    launch_cross_entropy(dev, logits, targets, dims, losses, lse).map(drop)
}

/// [`CrossEntropyDims::check`], as on the CPU, as a shape error naming `op`, then the GPU's
/// own condition: some columns unless there are no rows.
fn check(op: &'static str, dims: &CrossEntropyDims, logits: usize, per_row: &[(&str, usize)]) -> Result<()> {
    dims.check(logits, per_row).map_err(|message| CudaError::shape(op, message))?;
    ensure(dims.cols > 0 || dims.rows == 0, op, || "zero columns".to_string())
}

/// Checks and queues the forward kernel; returns its counters `[kept rows, targets out of
/// range]` (still being written), or `None` when there are no rows.
fn launch_cross_entropy(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    targets: &DeviceBuffer<u32>,
    dims: &CrossEntropyDims,
    losses: &mut DeviceBuffer<f32>,
    lse: &mut DeviceBuffer<f32>,
) -> Result<Option<DeviceBuffer<u32>>> {
    const OP: &str = "cross_entropy_forward";
    check_owners(dev, OP, &[logits, losses, lse])?;
    dev.check_owner(OP, targets)?;
    let rows_of_one = [("targets", targets.len()), ("losses", losses.len()), ("lse", lse.len())];
    check(OP, dims, logits.len(), &rows_of_one)?;
    let CrossEntropyDims { rows, cols, ignore_index } = *dims;
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
/// `scale = upstream[0] / count` computed on the device ([`MeanLossGrad`]); `dlogits_bf16`,
/// when given, gets `dlogits` rounded to nearest even (for the bf16 products that read it).
pub fn cross_entropy_backward(
    dev: &CudaDevice,
    logits: &DeviceBuffer<f32>,
    targets: &DeviceBuffer<u32>,
    dims: &CrossEntropyDims,
    lse: &DeviceBuffer<f32>,
    scale: MeanLossGrad,
    (dlogits, dlogits_bf16): (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    check_owners(dev, OP, &[logits, lse, scale.upstream, dlogits])?;
    dev.check_owner(OP, targets)?;
    dims.check(logits.len(), &[("targets", targets.len()), ("lse", lse.len())])
        .map_err(|message| CudaError::shape(OP, message))?;
    let CrossEntropyDims { rows, cols, ignore_index } = *dims;
    ensure_len(OP, "upstream", scale.upstream.len(), 1)?;
    ensure_len(OP, "dlogits", dlogits.len(), logits.len())?;
    if let Some(twin) = &dlogits_bf16 {
        dev.check_owner(OP, twin)?;
        ensure_len(OP, "dlogits_bf16", twin.len(), dlogits.len())?;
    }
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
        opt_ptr(dlogits_bf16.as_deref()),
    ];
    dev.launch(FAMILY, "cross_entropy_backward", per_row(rows, row_threads(cols)), &args)
}

/// Rows `first_row..first_row + dims.rows` of a cross-entropy whose logits are the first
/// `dims.rows × dims.cols` elements of `logits` (a chunk: `Tensor::linear_cross_entropy`):
/// `losses[first_row + r]` as [`cross_entropy_forward`] writes them (0 for rows whose target
/// is the ignore index or ≥ `cols`: the caller refuses those first), and with `grad_scale`
/// the logits overwritten by `grad_scale·(softmax − onehot)` as [`cross_entropy_backward`]
/// writes `dlogits` (zeros for those rows). The logits are f32, or bf16 (a bf16 product's
/// output under bf16 products), read as their f32 values and overwritten by the gradient
/// rounded to nearest even (its readers are the two bf16 products). `targets` is a run of
/// device ids (the ids of a batch's `tensor::Tokens`, read in place). Does not wait for the
/// device.
pub fn cross_entropy_forward_backward(
    dev: &CudaDevice,
    logits: ValuesMut<'_>,
    targets: DeviceRun<'_, u32>,
    first_row: usize,
    dims: &CrossEntropyDims,
    grad_scale: Option<f32>,
    losses: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "cross_entropy_forward_backward";
    let logits = logits.as_values();
    logits.check_owner(dev, OP)?;
    check_owners(dev, OP, &[losses])?;
    dev.check_owner(OP, targets.buffer())?;
    let CrossEntropyDims { rows, cols, ignore_index } = *dims;
    let chunk = rows * cols;
    ensure(logits.len() >= chunk, OP, || format!("logits have {} elements, the chunk needs {chunk}", logits.len()))?;
    for (name, len) in [("targets", targets.len()), ("losses", losses.len())] {
        ensure(len >= first_row + rows, OP, || format!("{name} has {len} elements, rows end at {}", first_row + rows))?;
    }
    ensure(cols > 0 || rows == 0, OP, || "zero columns".to_string())?;
    if rows == 0 {
        return Ok(());
    }
    let args = [
        logits.arg_at(0),
        run_ptr_at(&targets, first_row),
        size(rows),
        size(cols),
        ignore_code(ignore_index),
        ptr_at(losses, first_row),
        int(i32::from(grad_scale.is_some())),
        Arg::F32(grad_scale.unwrap_or(0.0)),
    ];
    let kernel = logits.kernel("cross_entropy_forward_backward", "cross_entropy_forward_backward_bf16");
    dev.launch(FAMILY, kernel, per_row(rows, row_threads(cols)), &args)
}
