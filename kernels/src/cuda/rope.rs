//! Launchers of `rope.cu`: rotary position embedding in the Hugging Face "rotate_half"
//! layout, forward and backward (the inverse rotation, written into `dx`).
//!
//! Mirrors `cpu::rope`; the cos/sin tables are the CPU's `rope_table` uploaded once
//! (`[max_seq, D/2]` each). The backward's `dx`, which bf16 products read, may also be
//! written as a bf16 twin (rounded to nearest even).

use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::{check_owners, elementwise, opt_ptr, ptr, size};
use super::module::{Arg, KernelFamily};
use crate::cpu::rope::RopeDims;

/// Checks `dims` against the buffers ([`RopeDims::check`], as on the CPU), then rotates.
fn rotate(
    dev: &CudaDevice,
    op: &'static str,
    [x, cos, sin]: [&DeviceBuffer<f32>; 3],
    dims: &RopeDims,
    backward: bool,
    (out, out_bf16): (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    check_owners(dev, op, &[x, cos, sin, out])?;
    dims.check(x.len(), out.len(), (cos.len(), sin.len())).map_err(|message| CudaError::shape(op, message))?;
    if let Some(twin) = &out_bf16 {
        dev.check_owner(op, twin)?;
        ensure(twin.len() == out.len(), op, || {
            format!("the bf16 twin has {} elements, the output {}", twin.len(), out.len())
        })?;
    }
    let RopeDims { batch, seq, heads, head_dim, pos_offset } = *dims;
    // The backward rotates by −angle (sin negated).
    let sign = if backward { -1.0 } else { 1.0 };
    let pairs = batch * seq * heads * (head_dim / 2);
    let args = [
        ptr(x),
        ptr(cos),
        ptr(sin),
        ptr(out),
        opt_ptr(out_bf16.as_deref()),
        size(batch * seq),
        size(seq.max(1)),
        size(heads),
        size(head_dim),
        size(pos_offset),
        Arg::F32(sign),
    ];
    dev.launch(KernelFamily::Rope, "rope_rotate", elementwise(pairs), &args)
}

/// `x, y: [B, T, H, D]`; token t uses table row `pos_offset + t`.
pub fn rope_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    dims: &RopeDims,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    rotate(dev, "rope_forward", [x, cos, sin], dims, false, (y, None))
}

/// `dx = Rᵀ dy` (the inverse rotation); `dx_bf16`, when given, gets `dx` rounded to bf16.
pub fn rope_backward(
    dev: &CudaDevice,
    dy: &DeviceBuffer<f32>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    dims: &RopeDims,
    dx: (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    // d/dx (R x) = Rᵀ: the rotation by −angle.
    rotate(dev, "rope_backward", [dy, cos, sin], dims, true, dx)
}
