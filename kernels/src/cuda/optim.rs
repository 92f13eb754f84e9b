//! Launchers of `optim.cu`: fused AdamW / Adam (up to [`TENSORS_PER_LAUNCH`] tensors per
//! launch) and SGD-with-momentum updates in place, and the step guard ([`step_guard`]): the
//! gradient norm, clipping factor and finiteness verdict of a training step, computed on the
//! device and read there by the Adam update, so the host learns them without holding it up.
//!
//! Mirrors `cpu::optim` (same [`AdamHyper`], same per-step constants computed in f64 on the
//! host), so the two backends agree to f32 rounding. There is no backward. Adam reads its
//! per-step constants from device memory ([`adam_constants`], written by the host before the
//! update), so an update captured in a CUDA graph reads each replay's step and learning rate.

pub use crate::cpu::optim::AdamHyper;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::allocator::{DeviceBuffer, DeviceRun};
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, Result};
use super::launch::{
    address_table, block_table, check_owners, elementwise, int, length_table, ptr, size, TABLE_LEN, THREADS,
};
use super::module::{Arg, KernelFamily};
use super::reduce::sum_squares_partials;

/// Length of Adam's per-step constants ([`adam_constants`]).
pub const ADAM_CONSTANTS_LEN: usize = 4;

/// The per-step scalars of Adam (`decoupled = false`) or AdamW at `h`'s step, learning rate
/// and weight decay, `[step_size, 1/√(1 − β2ᵗ), decay, l2]`, computed in f64 as the CPU
/// kernels do: copy them to the device buffer [`adam_step`] reads.
pub fn adam_constants(h: &AdamHyper, decoupled: bool) -> Result<[f32; ADAM_CONSTANTS_LEN]> {
    ensure(h.step >= 1, "adam_constants", || "step is 1-based".to_string())?;
    let t = i32::try_from(h.step).unwrap_or(i32::MAX);
    let correction1 = 1.0 - f64::from(h.beta1).powi(t);
    let correction2 = 1.0 - f64::from(h.beta2).powi(t);
    let step_size = (f64::from(h.lr) / correction1) as f32;
    let inv_sqrt_correction2 = (1.0 / correction2.sqrt()) as f32;
    let (decay, l2) = if decoupled { (1.0 - h.lr * h.weight_decay, 0.0) } else { (1.0, h.weight_decay) };
    Ok([step_size, inv_sqrt_correction2, decay, l2])
}

/// Tensors one `adam_step` launch updates (a `TensorTable` of common.cuh holds 512): a
/// model's whole decay group, so one launch per group.
pub const TENSORS_PER_LAUNCH: usize = TABLE_LEN;

/// Most blocks of one tensor in an `adam_step` launch (its threads loop over the rest): about
/// one full wave of a large GPU, so a big tensor alone still fills the device.
const ADAM_MAX_BLOCKS: usize = 1024;

/// An `adam_step` tensor's blocks: one thread per 4 elements (its 16-byte accesses), capped.
fn adam_blocks(len: usize) -> usize {
    len.div_ceil(4 * THREADS as usize).min(ADAM_MAX_BLOCKS)
}

/// Where an Adam update writes a parameter's bf16 copy: the parameter's length of elements
/// of `buffer` from element `at`.
///
/// The buffer is borrowed shared because it may hold the copies of several parameters back to
/// back (a fused gated projection's packed `[W; A_c; A_s]`, which its GEMM reads as one
/// operand): each part is rewritten by its own parameter's update, possibly in the same
/// launch. The update checks that the parts it writes do not overlap.
#[derive(Debug)]
pub struct Bf16Destination<'a> {
    /// The bf16 buffer that holds the copy.
    pub buffer: &'a DeviceBuffer<bf16>,
    /// Where the copy starts in it.
    pub at: usize,
}

/// One tensor of an Adam update: the parameter and its moments, updated in place, its
/// gradient (all of one length) and, optionally, where to rewrite the parameter's bf16 copy.
#[derive(Debug)]
pub struct AdamTensor<'a> {
    /// The parameter.
    pub param: &'a mut DeviceBuffer<f32>,
    /// The parameter's bf16 copy, rewritten from the updated parameter (rounded to nearest
    /// even), when bf16 products read it: no conversion launch before the next step's.
    pub param_bf16: Option<Bf16Destination<'a>>,
    /// Its gradient (a whole buffer, or its part of a packed gradient buffer).
    pub grad: DeviceRun<'a, f32>,
    /// The first moment.
    pub m: &'a mut DeviceBuffer<f32>,
    /// The second moment.
    pub v: &'a mut DeviceBuffer<f32>,
}

/// Length of a step guard: `[update, scale, norm, loss]` ([`step_guard`]).
pub const STEP_GUARD_LEN: usize = 4;

/// The step whose guard a [`step_guard`] comes after.
#[derive(Clone, Copy, Debug)]
pub enum Previous<'a> {
    /// None: the first step of a run.
    First,
    /// The guard in this buffer.
    Guard(&'a DeviceBuffer<f32>),
    /// The guard the new one overwrites (read before it is written): one buffer for every
    /// step, as a step captured in a CUDA graph rewrites at each replay.
    InPlace,
}

/// The step guard of a training step into `guard` ([`STEP_GUARD_LEN`] f32 on the device):
/// `[1 when the update may run, else 0; the clipping factor of the gradients; the global
/// gradient norm ‖g‖ before clipping; the mean loss loss_sum / loss_divisor]`. The update may
/// run when the loss and ‖g‖ are finite; the factor is `max_norm / (‖g‖ + 1e-6)` when
/// `‖g‖ > max_norm` (pass `f32::INFINITY` for no clipping), else 1, as PyTorch's
/// `clip_grad_norm_`. ‖g‖ sums `grads`' squares in f64 in the order [`sum_squares_all`]
/// does, so it is that function's value bit for bit. With the `previous` step's guard, the
/// update may run only when that step's did too (a host that reads guards one step late
/// stops a run whose weights then stay as they were). Two launches per
/// [`TENSORS_PER_LAUNCH`] gradients at most, and no wait for the device.
///
/// [`sum_squares_all`]: super::reduce::sum_squares_all
pub fn step_guard(
    dev: &CudaDevice,
    grads: &[DeviceRun<f32>],
    loss_sum: &DeviceBuffer<f32>,
    loss_divisor: f32,
    max_norm: f32,
    previous: Previous,
    guard: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "step_guard";
    check_owners(dev, OP, &[loss_sum, guard])?;
    ensure_len(OP, "loss_sum", loss_sum.len(), 1)?;
    ensure_len(OP, "guard", guard.len(), STEP_GUARD_LEN)?;
    let previous = match previous {
        Previous::First => Arg::Ptr(0),
        Previous::Guard(previous) => {
            check_owners(dev, OP, &[previous])?;
            ensure_len(OP, "previous", previous.len(), STEP_GUARD_LEN)?;
            ptr(previous)
        }
        Previous::InPlace => ptr(guard),
    };
    let partial = sum_squares_partials(dev, grads)?;
    let args = [
        ptr(&partial),
        size(partial.len()),
        ptr(loss_sum),
        Arg::F32(loss_divisor),
        Arg::F32(max_norm),
        previous,
        ptr(guard),
    ];
    let one_thread = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    dev.launch(KernelFamily::Optim, "step_guard", one_thread, &args)
}

/// Adam or AdamW (as [`adam_constants`] says) over `tensors`, in place on every tensor's
/// parameter, bf16 copy and moments, with `h`'s β1, β2 and ε and the per-step constants read
/// from `constants` ([`ADAM_CONSTANTS_LEN`] f32 on the device) when the update runs: one
/// launch per [`TENSORS_PER_LAUNCH`] tensors. With a `guard` ([`step_guard`]) the device
/// skips the update or clips the gradients as it says.
pub fn adam_step(
    dev: &CudaDevice,
    tensors: &mut [AdamTensor],
    h: &AdamHyper,
    constants: DeviceRun<f32>,
    guard: Option<&DeviceBuffer<f32>>,
) -> Result<()> {
    let op = "adam_step";
    dev.check_owner(op, constants.buffer())?;
    ensure_len(op, "constants", constants.len(), ADAM_CONSTANTS_LEN)?;
    if let Some(guard) = guard {
        dev.check_owner(op, guard)?;
        ensure_len(op, "guard", guard.len(), STEP_GUARD_LEN)?;
    }
    for t in tensors.iter() {
        check_owners(dev, op, &[t.param, t.grad.buffer(), t.m, t.v])?;
        ensure_len(op, "grad", t.grad.len(), t.param.len())?;
        ensure_len(op, "m", t.m.len(), t.param.len())?;
        ensure_len(op, "v", t.v.len(), t.param.len())?;
        if let Some(copy) = &t.param_bf16 {
            dev.check_owner(op, copy.buffer)?;
            let end = copy.at + t.param.len();
            ensure(end <= copy.buffer.len(), op, || {
                format!("param_bf16 {}..{end} past the end of {} elements", copy.at, copy.buffer.len())
            })?;
        }
    }
    check_disjoint_copies(op, tensors)?;
    for chunk in tensors.chunks_mut(TENSORS_PER_LAUNCH) {
        // Each tensor's own blocks, end to end along x: none idle beside a longer tensor.
        let (first_block, blocks) = block_table(chunk.iter().map(|t| adam_blocks(t.param.len())));
        if blocks == 0 {
            continue;
        }
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let args = [
            address_table(chunk.iter().map(|t| t.param.device_ptr())),
            address_table(chunk.iter().map(|t| t.param_bf16.as_ref().map_or(0, |copy| copy.buffer.ptr_at(copy.at)))),
            address_table(chunk.iter().map(|t| t.grad.device_ptr())),
            address_table(chunk.iter().map(|t| t.m.device_ptr())),
            address_table(chunk.iter().map(|t| t.v.device_ptr())),
            length_table(chunk.iter().map(|t| t.param.len())),
            first_block,
            size(chunk.len()),
            Arg::Ptr(guard.map_or(0, DeviceBuffer::device_ptr)),
            Arg::F32(h.beta1),
            Arg::F32(h.beta2),
            Arg::F32(h.eps),
            Arg::Ptr(constants.device_ptr()),
        ];
        dev.launch(KernelFamily::Optim, "adam_step", cfg, &args)?;
    }
    Ok(())
}

/// Errors when two tensors' bf16 copies share elements (call after the bounds checks): each
/// copy is written by its own tensor's update, and a shared element would be written twice.
fn check_disjoint_copies(op: &'static str, tensors: &[AdamTensor]) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> = tensors
        .iter()
        .filter_map(|t| {
            let copy = t.param_bf16.as_ref()?;
            Some((copy.buffer.ptr_at(copy.at), copy.buffer.ptr_at(copy.at + t.param.len())))
        })
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        ensure(pair[0].1 <= pair[1].0, op, || "two tensors' bf16 copies overlap".to_string())?;
    }
    Ok(())
}

/// SGD with momentum (PyTorch semantics, dampening 0; `nesterov` optional) at the learning
/// rate `lr` holds on the device (one element, read when the update runs, so a captured
/// update reads each replay's). A zeroed buffer reproduces PyTorch's first step. With
/// `momentum == 0` the buffer is not touched and may be empty.
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    dev: &CudaDevice,
    param: &mut DeviceBuffer<f32>,
    grad: &DeviceBuffer<f32>,
    momentum_buf: &mut DeviceBuffer<f32>,
    lr: &DeviceBuffer<f32>,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) -> Result<()> {
    const OP: &str = "sgd_step";
    check_owners(dev, OP, &[param, grad, momentum_buf, lr])?;
    ensure_len(OP, "grad", grad.len(), param.len())?;
    ensure_len(OP, "lr", lr.len(), 1)?;
    let use_buffer = momentum != 0.0;
    if use_buffer {
        ensure_len(OP, "momentum_buf", momentum_buf.len(), param.len())?;
    }
    let args = [
        ptr(param),
        ptr(grad),
        ptr(momentum_buf),
        size(param.len()),
        ptr(lr),
        Arg::F32(momentum),
        Arg::F32(weight_decay),
        int(i32::from(nesterov)),
        int(i32::from(use_buffer)),
    ];
    dev.launch(KernelFamily::Optim, "sgd_step", elementwise(param.len()), &args)
}
