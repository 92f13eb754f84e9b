//! Launchers of `rope.cu`: rotary position embedding in the Hugging Face "rotate_half"
//! layout, forward and backward (the inverse rotation, written into `dx`), of several tensors
//! in one launch (attention's q and k), and of the packed QKV product (q and k rotated out of
//! each token's `[q | k | v]` row and v moved beside them; the backward writes the rows back).
//!
//! Mirrors `cpu::rope`; the cos/sin tables are the CPU's `rope_table` uploaded once
//! (`[max_seq, D/2]` each). An output that bf16 products read (the backward's `dq`, `dk`)
//! may also be written as a bf16 twin (rounded to nearest even). The packed QKV product may
//! be read in bf16 (stored so under bf16 products), widened for the rotation.

use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::{address_list, check_owners, elementwise, length_list, ptr, size, LIST_LEN};
use super::module::{Arg, KernelFamily};
use super::values::{Values, ValuesMut};
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

/// One part of a launch as the kernel reads it: addresses of `x`, `out` and (0 when none)
/// `out`'s bf16 twin, each `[B·T, heads, D]` with its own token stride, checked by the caller.
struct Lane {
    x: u64,
    x_stride: usize,
    out: u64,
    out_stride: usize,
    out_bf16: u64,
    heads: usize,
    /// False: copied, not rotated.
    rotate: bool,
}

/// Checks every part ([`RopeDims::check`], as on the CPU; one batch, length, head dim and
/// offset for all, at most `LIST_LEN` parts), then rotates them all in one launch.
fn rotate(
    dev: &CudaDevice,
    op: &'static str,
    parts: &mut [RopePart],
    tables: [&DeviceBuffer<f32>; 2],
    backward: bool,
) -> Result<()> {
    let Some(first) = parts.first().map(|part| part.dims) else { return Ok(()) };
    ensure(parts.len() <= LIST_LEN, op, || format!("{} parts, at most {LIST_LEN} per launch", parts.len()))?;
    let mut lanes = Vec::with_capacity(parts.len());
    for part in parts.iter() {
        check_owners(dev, op, &[part.x, part.out])?;
        let d = part.dims;
        check_dims(op, d, first, part.x.len(), part.out.len(), tables)?;
        if let Some(twin) = &part.out_bf16 {
            check_twin(dev, op, twin, part.out.len())?;
        }
        let width = d.heads * d.head_dim;
        lanes.push(Lane {
            x: part.x.device_ptr(),
            x_stride: width,
            out: part.out.device_ptr(),
            out_stride: width,
            out_bf16: part.out_bf16.as_ref().map_or(0, |twin| twin.device_ptr()),
            heads: d.heads,
            rotate: true,
        });
    }
    launch(dev, first, &lanes, tables, backward, false)
}

/// Checks one part's sizes against its buffers' lengths and the tables, and that it shares
/// `first`'s batch, length, head dim and offset.
fn check_dims(
    op: &'static str,
    d: RopeDims,
    first: RopeDims,
    input: usize,
    output: usize,
    [cos, sin]: [&DeviceBuffer<f32>; 2],
) -> Result<()> {
    d.check(input, output, (cos.len(), sin.len())).map_err(|message| CudaError::shape(op, message))?;
    let shared =
        (d.batch, d.seq, d.head_dim, d.pos_offset) == (first.batch, first.seq, first.head_dim, first.pos_offset);
    ensure(shared, op, || format!("parts differ in batch, length, head dim or offset: {d:?} and {first:?}"))
}

/// Checks a bf16 twin against its output's length.
fn check_twin(dev: &CudaDevice, op: &'static str, twin: &DeviceBuffer<bf16>, len: usize) -> Result<()> {
    dev.check_owner(op, twin)?;
    ensure(twin.len() == len, op, || format!("a bf16 twin has {} elements, its output {len}", twin.len()))
}

/// One launch of `rope_rotate` over `lanes` (checked), all of `dims`' batch, length, head dim
/// and offset; every lane's `x` holds bf16 values when `x_is_bf16`, else f32.
fn launch(
    dev: &CudaDevice,
    dims: RopeDims,
    lanes: &[Lane],
    [cos, sin]: [&DeviceBuffer<f32>; 2],
    backward: bool,
    x_is_bf16: bool,
) -> Result<()> {
    check_owners(dev, "rope", &[cos, sin])?;
    let RopeDims { batch, seq, head_dim, pos_offset, .. } = dims;
    // The backward rotates by −angle (sin negated).
    let sign = if backward { -1.0 } else { 1.0 };
    let most_heads = lanes.iter().map(|lane| lane.heads).max().unwrap_or(0);
    // One thread per group of 4 pairs when D/2 allows 16-byte accesses (rope.cu), else per pair.
    let pairs_per_thread = if (head_dim / 2).is_multiple_of(4) { 4 } else { 1 };
    let mut cfg = elementwise((batch * seq * most_heads * (head_dim / 2)).div_ceil(pairs_per_thread));
    cfg.grid_dim.1 = lanes.len() as u32;
    let args = [
        address_list(lanes.iter().map(|lane| lane.x)),
        address_list(lanes.iter().map(|lane| lane.out)),
        address_list(lanes.iter().map(|lane| lane.out_bf16)),
        length_list(lanes.iter().map(|lane| lane.heads)),
        length_list(lanes.iter().map(|lane| lane.x_stride)),
        length_list(lanes.iter().map(|lane| lane.out_stride)),
        length_list(lanes.iter().map(|lane| usize::from(lane.rotate))),
        ptr(cos),
        ptr(sin),
        size(batch * seq),
        size(seq.max(1)),
        size(head_dim),
        size(pos_offset),
        Arg::F32(sign),
        Arg::I32(i32::from(x_is_bf16)),
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

/// The packed QKV product `qkv: [B, T, 3, H, D]` (each token's q, k and v side by side, as
/// one GEMM of the stacked weights writes them; f32 or bf16) into the dense `[B, T, H, D]`
/// tensors `R q`, `R k` and `v`, in one launch: f32, or rounded to bf16 (nearest even) for
/// the tensor-core attention, which reads them so. `dims` are one part's sizes.
pub fn rope_qkv_forward(
    dev: &CudaDevice,
    qkv: Values,
    dims: RopeDims,
    outputs: [ValuesMut; 3],
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rope_qkv_forward";
    let part_len = dims.len();
    qkv.check_owner(dev, OP)?;
    ensure(qkv.len() == 3 * part_len, OP, || {
        format!("qkv has {} elements, 3·[B, T, H, D] needs {}", qkv.len(), 3 * part_len)
    })?;
    for out in &outputs {
        let out = out.as_values();
        out.check_owner(dev, OP)?;
        check_dims(OP, dims, dims, part_len, out.len(), [cos, sin])?;
    }
    let width = dims.heads * dims.head_dim;
    let lane = |part: usize, out: &ValuesMut| Lane {
        x: qkv.address_at(part * width),
        x_stride: 3 * width,
        out: out.as_values().f32_address(),
        out_stride: width,
        out_bf16: out.as_values().bf16_address(),
        heads: dims.heads,
        rotate: part < 2,
    };
    let [q, k, v] = &outputs;
    let lanes = [lane(0, q), lane(1, k), lane(2, v)];
    launch(dev, dims, &lanes, [cos, sin], false, qkv.is_bf16())
}

/// The backward of [`rope_qkv_forward`]: `dqkv: [B, T, 3, H, D]` from the dense gradients of
/// its outputs (`Rᵀ dq`, `Rᵀ dk` and `dv` side by side in each token's row), in one launch.
/// The gradients are all f32 or all bf16 (the tensor-core attention's backward writes them
/// so); `dqkv` is written in f32, or rounded to bf16 alone (nearest even) when it is bf16: the
/// packed product's backward, or the fused gate's, reads it so.
pub fn rope_qkv_backward(
    dev: &CudaDevice,
    grads: [Values; 3],
    dims: RopeDims,
    dqkv: ValuesMut,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rope_qkv_backward";
    let part_len = dims.len();
    let dqkv = dqkv.as_values();
    dqkv.check_owner(dev, OP)?;
    ensure(dqkv.len() == 3 * part_len, OP, || {
        format!("dqkv has {} elements, 3·[B, T, H, D] needs {}", dqkv.len(), 3 * part_len)
    })?;
    let bf16_grads = grads[0].is_bf16();
    for grad in &grads {
        grad.check_owner(dev, OP)?;
        check_dims(OP, dims, dims, grad.len(), part_len, [cos, sin])?;
        ensure(grad.is_bf16() == bf16_grads, OP, || "dq, dk and dv differ in element type".to_string())?;
    }
    let width = dims.heads * dims.head_dim;
    let lane = |part: usize, grad: &Values| {
        let [out, out_bf16] = dqkv.typed_addresses_at(part * width);
        Lane {
            x: grad.address(),
            x_stride: width,
            out,
            out_stride: 3 * width,
            out_bf16,
            heads: dims.heads,
            rotate: part < 2,
        }
    };
    let lanes = [lane(0, &grads[0]), lane(1, &grads[1]), lane(2, &grads[2])];
    launch(dev, dims, &lanes, [cos, sin], true, bf16_grads)
}
