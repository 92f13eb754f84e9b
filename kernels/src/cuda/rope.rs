//! Launchers of `rope.cu`: rotary position embedding in the Hugging Face "rotate_half"
//! layout, forward and backward (the inverse rotation, accumulated into `dx`).
//!
//! Mirrors `cpu::rope`; the cos/sin tables are the CPU's `rope_table` uploaded once
//! (`[max_seq, D/2]` each).

use super::allocator::DeviceBuffer;
use super::device::{Arg, CudaDevice};
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, int, ptr, size};
use super::module::KernelFamily;

/// Sizes of one rotation: `x` is `[batch, seq, heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
fn check(
    op: &'static str,
    input: usize,
    output: usize,
    table: (usize, usize),
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    pos_offset: usize,
) -> Result<()> {
    ensure(head_dim.is_multiple_of(2), op, || format!("head_dim {head_dim} must be even"))?;
    ensure(input == batch * seq * heads * head_dim, op, || "input has the wrong length".to_string())?;
    ensure(output == input, op, || "output has the wrong length".to_string())?;
    let needed = (pos_offset + seq) * head_dim / 2;
    ensure(table.0 >= needed && table.1 >= needed, op, || "table shorter than pos_offset + seq".to_string())
}

#[allow(clippy::too_many_arguments)]
fn rotate(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    pos_offset: usize,
    backward: bool,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    // The backward rotates by −angle (sin negated) and accumulates.
    let sign = if backward { -1.0 } else { 1.0 };
    let pairs = batch * seq * heads * (head_dim / 2);
    let args = [
        ptr(x),
        ptr(cos),
        ptr(sin),
        ptr(out),
        size(batch * seq),
        size(seq.max(1)),
        size(heads),
        size(head_dim),
        size(pos_offset),
        Arg::F32(sign),
        int(i32::from(backward)),
    ];
    dev.launch(KernelFamily::Rope, "rope_rotate", elementwise(pairs), &args)
}

/// `x, y: [B, T, H, D]`; token t uses table row `pos_offset + t`.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    pos_offset: usize,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rope_forward";
    check_owners(dev, OP, &[x, cos, sin, y])?;
    check(OP, x.len(), y.len(), (cos.len(), sin.len()), batch, seq, heads, head_dim, pos_offset)?;
    rotate(dev, x, cos, sin, batch, seq, heads, head_dim, pos_offset, false, y)
}

/// `dx += Rᵀ dy` (the inverse rotation).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward(
    dev: &CudaDevice,
    dy: &DeviceBuffer<f32>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    pos_offset: usize,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rope_backward";
    check_owners(dev, OP, &[dy, cos, sin, dx])?;
    check(OP, dy.len(), dx.len(), (cos.len(), sin.len()), batch, seq, heads, head_dim, pos_offset)?;
    // d/dx (R x) = Rᵀ: the rotation by −angle.
    rotate(dev, dy, cos, sin, batch, seq, heads, head_dim, pos_offset, true, dx)
}
