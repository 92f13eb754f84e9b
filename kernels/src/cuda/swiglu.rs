//! Launchers of `swiglu.cu`: SwiGLU gating `y = silu(g) ⊙ u` and its backward, the
//! elementwise half of LLaMA's FFN.
//!
//! Mirrors `cpu::swiglu` with slices replaced by device buffers: the forward reads `g` and
//! `u` once, the backward recomputes σ(g) from `g` and writes (`dg = ...`,
//! `du = ...`). All buffers hold the same number of elements (any shape, flattened), or, for
//! the `halves` forms, the gate and up values are the two halves of each row of one product,
//! f32 or bf16 ([`Values`]: a bf16 product's output). Each output may also be written as a bf16 twin (rounded to
//! nearest even) for the bf16 products that read it, instead of a conversion launch.

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, opt_ptr, ptr, ptr_at, size};
use super::module::KernelFamily;
use super::values::{output_with_twin, Values, ValuesMut};

const FAMILY: KernelFamily = KernelFamily::Swiglu;

/// The grid of both kernels: one thread per 4 elements (they load and store 16 bytes at a time,
/// swiglu.cu); the grid-stride loops make any grid correct.
fn grid(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(4))
}

/// Checks that an output's bf16 twin belongs to `dev` and has `n` elements.
fn check_twin(dev: &CudaDevice, op: &'static str, twin: &Option<&mut DeviceBuffer<bf16>>, n: usize) -> Result<()> {
    if let Some(twin) = twin {
        dev.check_owner(op, twin)?;
        ensure(twin.len() == n, op, || format!("a bf16 twin has {} elements, its output {n}", twin.len()))?;
    }
    Ok(())
}

/// `out[i] = silu(gate[i]) · up[i]`: f32 (and `out_bf16[i]` = it rounded to bf16, when
/// given), or bf16 alone (rounded so; no twin) when only bf16 products read it.
pub fn swiglu_forward(
    dev: &CudaDevice,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    (out, out_bf16): (ValuesMut<'_>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "swiglu_forward";
    check_owners(dev, OP, &[gate, up])?;
    let out = out.as_values();
    let [out_f32, out_bf16] = output_with_twin(dev, OP, out, out_bf16.as_deref())?;
    let n = out.len();
    ensure(gate.len() == n && up.len() == n, OP, || {
        format!("gate ({}), up ({}) and out ({n}) differ in length", gate.len(), up.len())
    })?;
    let args = [ptr(gate), ptr(up), out_f32, out_bf16, size(n), size(n), size(n)];
    dev.launch(FAMILY, "swiglu_forward", grid(n), &args)
}

/// SwiGLU of the two halves of one product `gate_up: [rows, 2·cols]` (gate in columns
/// `[0, cols)`, up in `[cols, 2·cols)`, the FFN's one GEMM over its packed gate and up
/// weights): `out[r, c] = silu(gate_up[r, c]) · gate_up[r, cols + c]`, `out: [rows, cols]`,
/// written as [`swiglu_forward`]'s.
pub fn swiglu_halves_forward(
    dev: &CudaDevice,
    gate_up: Values,
    cols: usize,
    (out, out_bf16): (ValuesMut<'_>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "swiglu_halves_forward";
    gate_up.check_owner(dev, OP)?;
    let out = out.as_values();
    let [out_f32, out_bf16] = output_with_twin(dev, OP, out, out_bf16.as_deref())?;
    let n = out.len();
    check_halves(OP, gate_up.len(), cols, n)?;
    let (gate, up) = (gate_up.arg_at(0), gate_up.arg_at(cols));
    let args = [gate, up, out_f32, out_bf16, size(n), size(cols), size(2 * cols)];
    dev.launch(FAMILY, gate_up.kernel("swiglu_forward", "swiglu_forward_bf16"), grid(n), &args)
}

/// Errors unless `gate_up` (`len` elements) holds the two `[rows, cols]` halves of an output of `n`.
fn check_halves(op: &'static str, len: usize, cols: usize, n: usize) -> Result<()> {
    ensure(cols > 0 && n.is_multiple_of(cols) && len == 2 * n, op, || {
        format!("gate_up ({len}) must be [rows, 2·{cols}] for an output of {n} = rows·{cols}")
    })
}

/// `dgate = dout · up · silu'(gate)` and `dup = dout · silu(gate)`, recomputing σ(gate); each
/// also rounded to bf16 into its twin of `twins` (`(dgate, dup)`) when given.
pub fn swiglu_backward(
    dev: &CudaDevice,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<f32>,
    dgate: &mut DeviceBuffer<f32>,
    dup: &mut DeviceBuffer<f32>,
    twins: (Option<&mut DeviceBuffer<bf16>>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "swiglu_backward";
    check_owners(dev, OP, &[gate, up, dout, dgate, dup])?;
    let n = dgate.len();
    ensure(gate.len() == n && up.len() == n && dout.len() == n && dup.len() == n, OP, || {
        format!(
            "gate ({}), up ({}), dout ({}), dgate ({n}) and dup ({}) differ in length",
            gate.len(),
            up.len(),
            dout.len(),
            dup.len()
        )
    })?;
    check_twin(dev, OP, &twins.0, n)?;
    check_twin(dev, OP, &twins.1, n)?;
    let (dgate_bf16, dup_bf16) = (opt_ptr(twins.0.as_deref()), opt_ptr(twins.1.as_deref()));
    let args = [ptr(gate), ptr(up), ptr(dout), ptr(dgate), ptr(dup), dgate_bf16, dup_bf16, size(n), size(n), size(n)];
    dev.launch(FAMILY, "swiglu_backward", grid(n), &args)
}

/// The backward of [`swiglu_halves_forward`]: `d_gate_up: [rows, 2·cols]` (the gate's
/// gradient in the first `cols` columns of each row, up's in the rest) for `dout: [rows, cols]`,
/// recomputing σ(gate); also rounded to bf16 into `d_gate_up_bf16` when given.
pub fn swiglu_halves_backward(
    dev: &CudaDevice,
    gate_up: Values,
    dout: &DeviceBuffer<f32>,
    cols: usize,
    d_gate_up: &mut DeviceBuffer<f32>,
    d_gate_up_bf16: Option<&mut DeviceBuffer<bf16>>,
) -> Result<()> {
    const OP: &str = "swiglu_halves_backward";
    gate_up.check_owner(dev, OP)?;
    check_owners(dev, OP, &[dout, d_gate_up])?;
    let n = dout.len();
    check_halves(OP, gate_up.len(), cols, n)?;
    check_halves(OP, d_gate_up.len(), cols, n)?;
    check_twin(dev, OP, &d_gate_up_bf16, 2 * n)?;
    let twin = d_gate_up_bf16.as_deref();
    let (dgate_bf16, dup_bf16) = (opt_ptr(twin), twin.map_or(opt_ptr::<bf16>(None), |t| ptr_at(t, cols)));
    let args = [
        gate_up.arg_at(0),
        gate_up.arg_at(cols),
        ptr(dout),
        ptr(d_gate_up),
        ptr_at(d_gate_up, cols),
        dgate_bf16,
        dup_bf16,
        size(n),
        size(cols),
        size(2 * cols),
    ];
    dev.launch(FAMILY, gate_up.kernel("swiglu_backward", "swiglu_backward_bf16"), grid(n), &args)
}
