//! Launchers of `rope.cu`: rotary position embedding in the Hugging Face "rotate_half"
//! layout, forward and backward (the inverse rotation, written into `dx`), of several tensors
//! in one launch (attention's q and k).
//!
//! Mirrors `cpu::rope`; the cos/sin tables are the CPU's `rope_table` uploaded once
//! (`[max_seq, D/2]` each). An output that bf16 products read (the backward's `dq`, `dk`)
//! may also be written as a bf16 twin (rounded to nearest even).

use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::{address_list, check_owners, elementwise, length_list, ptr, size, LIST_LEN};
use super::module::{Arg, KernelFamily};
use crate::cpu::rope::RopeDims;

/// One tensor of a rotation: `x` and `out` of the sizes `dims` (`[B, T, H, D]`, token t at
/// table row `pos_offset + t`), and optionally `out`'s bf16 twin.
#[derive(Debug)]
pub struct RopePart<'a> {
    /// The input.
    pub x: &'a DeviceBuffer<f32>,
    /// Its sizes.
    pub dims: RopeDims,
    /// The output, written.
    pub out: &'a mut DeviceBuffer<f32>,
    /// The output rounded to bf16, written when given.
    pub out_bf16: Option<&'a mut DeviceBuffer<bf16>>,
}

/// Checks every part ([`RopeDims::check`], as on the CPU; one batch, length, head dim and
/// offset for all, at most `LIST_LEN` parts), then rotates them all in one launch.
fn rotate(
    dev: &CudaDevice,
    op: &'static str,
    parts: &mut [RopePart],
    [cos, sin]: [&DeviceBuffer<f32>; 2],
    backward: bool,
) -> Result<()> {
    let Some(first) = parts.first().map(|part| part.dims) else { return Ok(()) };
    ensure(parts.len() <= LIST_LEN, op, || format!("{} parts, at most {LIST_LEN} per launch", parts.len()))?;
    check_owners(dev, op, &[cos, sin])?;
    for part in parts.iter() {
        check_owners(dev, op, &[part.x, part.out])?;
        let d = part.dims;
        d.check(part.x.len(), part.out.len(), (cos.len(), sin.len()))
            .map_err(|message| CudaError::shape(op, message))?;
        let shared =
            (d.batch, d.seq, d.head_dim, d.pos_offset) == (first.batch, first.seq, first.head_dim, first.pos_offset);
        ensure(shared, op, || format!("parts differ in batch, length, head dim or offset: {d:?} and {first:?}"))?;
        if let Some(twin) = &part.out_bf16 {
            dev.check_owner(op, twin)?;
            ensure(twin.len() == part.out.len(), op, || {
                format!("a bf16 twin has {} elements, its output {}", twin.len(), part.out.len())
            })?;
        }
    }
    let RopeDims { batch, seq, head_dim, pos_offset, .. } = first;
    // The backward rotates by −angle (sin negated).
    let sign = if backward { -1.0 } else { 1.0 };
    let most_heads = parts.iter().map(|part| part.dims.heads).max().unwrap_or(0);
    // One thread per group of 4 pairs when D/2 allows 16-byte accesses (rope.cu), else per pair.
    let pairs_per_thread = if (head_dim / 2).is_multiple_of(4) { 4 } else { 1 };
    let mut cfg = elementwise((batch * seq * most_heads * (head_dim / 2)).div_ceil(pairs_per_thread));
    cfg.grid_dim.1 = parts.len() as u32;
    let args = [
        address_list(parts.iter().map(|part| part.x.device_ptr())),
        address_list(parts.iter().map(|part| part.out.device_ptr())),
        address_list(parts.iter().map(|part| part.out_bf16.as_ref().map_or(0, |twin| twin.device_ptr()))),
        length_list(parts.iter().map(|part| part.dims.heads)),
        ptr(cos),
        ptr(sin),
        size(batch * seq),
        size(seq.max(1)),
        size(head_dim),
        size(pos_offset),
        Arg::F32(sign),
    ];
    dev.launch(KernelFamily::Rope, "rope_rotate", cfg, &args)
}

/// `out = R x` for every part (`x, out: [B, T, H, D]`), in one launch.
pub fn rope_forward(
    dev: &CudaDevice,
    parts: &mut [RopePart],
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    rotate(dev, "rope_forward", parts, [cos, sin], false)
}

/// `out = Rᵀ x` (the inverse rotation: `dx` from `dy = x`) for every part, in one launch.
pub fn rope_backward(
    dev: &CudaDevice,
    parts: &mut [RopePart],
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    // d/dx (R x) = Rᵀ: the rotation by −angle.
    rotate(dev, "rope_backward", parts, [cos, sin], true)
}
