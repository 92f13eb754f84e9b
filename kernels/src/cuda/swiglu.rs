//! Launchers of `swiglu.cu`: SwiGLU gating `y = silu(g) ⊙ u` and its backward, the
//! elementwise half of LLaMA's FFN.
//!
//! Mirrors `cpu::swiglu` with slices replaced by device buffers: the forward reads `g` and
//! `u` once, the backward recomputes σ(g) from `g` and writes (`dg = ...`,
//! `du = ...`). All buffers hold the same number of elements (any shape, flattened).

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, ptr, size};
use super::module::KernelFamily;

const FAMILY: KernelFamily = KernelFamily::Swiglu;

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn swiglu_forward(
    dev: &CudaDevice,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "swiglu_forward";
    check_owners(dev, OP, &[gate, up, out])?;
    let n = out.len();
    ensure(gate.len() == n && up.len() == n, OP, || {
        format!("gate ({}), up ({}) and out ({n}) differ in length", gate.len(), up.len())
    })?;
    let args = [ptr(gate), ptr(up), ptr(out), size(n)];
    dev.launch(FAMILY, "swiglu_forward", elementwise(n), &args)
}

/// `dgate = dout · up · silu'(gate)` and `dup = dout · silu(gate)`, recomputing σ(gate).
pub fn swiglu_backward(
    dev: &CudaDevice,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<f32>,
    dgate: &mut DeviceBuffer<f32>,
    dup: &mut DeviceBuffer<f32>,
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
    let args = [ptr(gate), ptr(up), ptr(dout), ptr(dgate), ptr(dup), size(n)];
    dev.launch(FAMILY, "swiglu_backward", elementwise(n), &args)
}
