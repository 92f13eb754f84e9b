//! Launchers of `swiglu.cu`: SwiGLU gating `y = silu(g) ⊙ u` and its backward, the
//! elementwise half of LLaMA's FFN.
//!
//! Mirrors `cpu::swiglu` with slices replaced by device buffers: the forward reads `g` and
//! `u` once, the backward recomputes σ(g) from `g` and writes (`dg = ...`,
//! `du = ...`). All buffers hold the same number of elements (any shape, flattened), or, for
//! the `halves` forms, the gate and up values are the two halves of each row of one product,
//! f32 or bf16 ([`Values`]: a bf16 product's output). The forward's output may also be written
//! as a bf16 twin (rounded to nearest even) for the bf16 products that read it, instead of a
//! conversion launch, or in bf16 alone; the backward's gradients in f32 or in bf16 alone.

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, ptr, size};
use super::module::KernelFamily;
use super::values::{kernel_for_gradient, output_with_twin, Values, ValuesMut};

const FAMILY: KernelFamily = KernelFamily::Swiglu;

/// The grid of both kernels: one thread per 4 elements (they load and store 16 bytes at a time,
/// swiglu.cu); the grid-stride loops make any grid correct.
fn grid(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(4))
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
/// written in f32, or rounded to bf16 alone when it is a bf16 buffer (its readers are bf16
/// products, or a kernel that reads bf16).
pub fn swiglu_backward(
    dev: &CudaDevice,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<f32>,
    dgate: ValuesMut,
    dup: ValuesMut,
) -> Result<()> {
    const OP: &str = "swiglu_backward";
    check_owners(dev, OP, &[gate, up, dout])?;
    let (dgate, dup) = (dgate.as_values(), dup.as_values());
    dgate.check_owner(dev, OP)?;
    dup.check_owner(dev, OP)?;
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
    let ([dg, dg_bf16], [du, du_bf16]) = (dgate.typed_args_at(0), dup.typed_args_at(0));
    let args = [ptr(gate), ptr(up), ptr(dout), dg, du, dg_bf16, du_bf16, size(n), size(n), size(n)];
    dev.launch(FAMILY, "swiglu_backward", grid(n), &args)
}

/// The backward of [`swiglu_halves_forward`]: `d_gate_up: [rows, 2·cols]` (the gate's
/// gradient in the first `cols` columns of each row, up's in the rest) for `dout: [rows, cols]`,
/// recomputing σ(gate); written in f32, or rounded to bf16 alone when `d_gate_up` is bf16
/// (under bf16 products: the gate and up product's backward, or the fused gate's, reads it so).
/// `dout` is f32, or bf16 beside a bf16 `gate_up` (the down product's input gradient).
pub fn swiglu_halves_backward(
    dev: &CudaDevice,
    gate_up: Values,
    dout: Values,
    cols: usize,
    d_gate_up: ValuesMut,
) -> Result<()> {
    const OP: &str = "swiglu_halves_backward";
    gate_up.check_owner(dev, OP)?;
    let d_gate_up = d_gate_up.as_values();
    d_gate_up.check_owner(dev, OP)?;
    dout.check_owner(dev, OP)?;
    let kernels = ["swiglu_backward", "swiglu_backward_bf16", "swiglu_backward_bf16_dout_bf16"];
    let kernel = kernel_for_gradient(OP, gate_up, dout, kernels)?;
    let n = dout.len();
    check_halves(OP, gate_up.len(), cols, n)?;
    check_halves(OP, d_gate_up.len(), cols, n)?;
    let ([dgate, dgate_bf16], [dup, dup_bf16]) = (d_gate_up.typed_args_at(0), d_gate_up.typed_args_at(cols));
    let args = [
        gate_up.arg_at(0),
        gate_up.arg_at(cols),
        dout.arg_at(0),
        dgate,
        dup,
        dgate_bf16,
        dup_bf16,
        size(n),
        size(cols),
        size(2 * cols),
    ];
    dev.launch(FAMILY, kernel, grid(n), &args)
}
