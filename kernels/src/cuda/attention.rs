//! Launchers of `attention.cu` and `attention_mma.cu`: causal scaled-dot-product attention,
//! flash-style forward (online softmax, only `lse` saved) and backward (recomputed
//! probabilities, no atomics), with f32 products on the CUDA cores or bf16 products on the
//! tensor cores ([`AttentionPrecision`]).
//!
//! Mirrors `cpu::attention`: q `[B, Tq, H, D]`, k and v `[B, Tk, H, D]`, `lse [B, H, Tq]`;
//! query i sits at position `i + (Tk − Tq)`. The f32 kernels keep four head dims per lane,
//! so `D ≤` [`MAX_HEAD_DIM`]; the tensor-core kernels take `D` ∈ {16, 32, 48, 64}
//! ([`tensor_cores_fit`]); `B·H` is a grid dimension (≤ 65 535). Backward writes
//! `dq`, `dk`, `dv` (every row once). The output and `dv`, which bf16 products read, may
//! also be written as bf16 twins (rounded to nearest even) instead of converted later; the
//! tensor-core kernels may write each gradient in bf16 alone, or write the three as the
//! gradient of the packed QKV product RoPE took them from, dq and dk rotated back
//! ([`causal_attention_backward_packed`]); they may also read q, k and v from that packed
//! product unrotated, rotating q and k as they load them ([`QkvInputs::Packed`],
//! [`rotary_causal_attention_forward_packed`]), so that RoPE takes no launch at all. q, k
//! and v are f32, or (for the tensor-core kernels) bf16 ([`Values`]): RoPE writes them so
//! under bf16 products, rounded as the kernels' staging would round them. From bf16 q, k and
//! v the output may be written in bf16 only, as FlashAttention-2 stores it; the backward then
//! reads it so (δ = Σ dO ⊙ O from the stored O). f32 q, k and v go with an f32 output. The
//! tensor-core kernels stage bf16 tiles by `cp.async` into two shared buffers, the next tile
//! in flight while the current one is multiplied; the `cp.async` copies need every bf16 input
//! 16-byte aligned, which whole device buffers are.

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, CudaError, Result};
use super::launch::{check_owners, elementwise, opt_ptr, ptr, size};
use super::module::{Arg, KernelFamily};
use super::values::{Values, ValuesMut};
use crate::cpu::attention::AttentionDims;

/// Largest head dimension of the GPU kernels.
pub const MAX_HEAD_DIM: usize = 128;
/// Head dimensions of the tensor-core kernels: multiples of one mma's depth (16) whose
/// accumulators fit in registers.
const TENSOR_CORE_HEAD_DIMS: [usize; 4] = [16, 32, 48, 64];
/// Rows of the output per tensor-core block (16 per warp, 4 warps).
const TENSOR_CORE_ROWS: usize = 64;
/// Queries (or keys) per block: one warp each.
const WARPS: usize = 8;
/// Keys (or queries) per shared-memory tile.
const TILE: usize = 32;
/// Largest `B·H` (grid.y).
const MAX_HEADS_TOTAL: usize = 65_535;

const FAMILY: KernelFamily = KernelFamily::Attention;
const MMA_FAMILY: KernelFamily = KernelFamily::AttentionMma;
const MMA_FORWARD: [&str; 4] = [
    "attention_mma_forward_d16",
    "attention_mma_forward_d32",
    "attention_mma_forward_d48",
    "attention_mma_forward_d64",
];
/// The backward (dk, dv and the groups' partial dq in one pass over each key tile), then the
/// finish of dq.
const MMA_BACKWARD: [&str; 4] = [
    "attention_mma_backward_d16",
    "attention_mma_backward_d32",
    "attention_mma_backward_d48",
    "attention_mma_backward_d64",
];
const MMA_DQ_FINISH: [&str; 4] = [
    "attention_mma_backward_dq_finish_d16",
    "attention_mma_backward_dq_finish_d32",
    "attention_mma_backward_dq_finish_d48",
    "attention_mma_backward_dq_finish_d64",
];
/// The same kernels reading bf16 q, k and v.
const MMA_FORWARD_BF16: [&str; 4] = [
    "attention_mma_forward_bf16_d16",
    "attention_mma_forward_bf16_d32",
    "attention_mma_forward_bf16_d48",
    "attention_mma_forward_bf16_d64",
];
const MMA_BACKWARD_BF16: [&str; 4] = [
    "attention_mma_backward_bf16_d16",
    "attention_mma_backward_bf16_d32",
    "attention_mma_backward_bf16_d48",
    "attention_mma_backward_bf16_d64",
];
/// The backward reading a bf16 dout too.
const MMA_BACKWARD_DOUT_BF16: [&str; 4] = [
    "attention_mma_backward_bf16_dout_bf16_d16",
    "attention_mma_backward_bf16_dout_bf16_d32",
    "attention_mma_backward_bf16_dout_bf16_d48",
    "attention_mma_backward_bf16_dout_bf16_d64",
];

/// The arithmetic of attention's products (`q·kᵀ`, `P·v` and the backward's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPrecision {
    /// f32 operands on the CUDA cores: agrees with the CPU to rounding.
    F32,
    /// bf16 operands on the tensor cores (`mma.sync`, f32 accumulation; compute capability
    /// 8.0+), as PyTorch's SDPA under bf16 autocast: q, k, v, dO and the probabilities are
    /// rounded to bf16 before their products; softmax statistics and sums stay f32.
    Bf16,
}

/// Whether the tensor-core kernels take head dimension `head_dim`.
pub fn tensor_cores_fit(head_dim: usize) -> bool {
    TENSOR_CORE_HEAD_DIMS.contains(&head_dim)
}

/// The launch geometry of `dims` (the CPU kernels' [`AttentionDims`], checked once by
/// [`check`]).
struct Dims(AttentionDims);

/// [`AttentionDims::check`] against the buffers' lengths, then the GPU kernels' own limits.
fn check(op: &'static str, dims: &AttentionDims, q: usize, k: usize, v: usize) -> Result<Dims> {
    dims.check(q, k, v).map_err(|message| CudaError::shape(op, message))?;
    let AttentionDims { batch, heads, head_dim, .. } = *dims;
    ensure(head_dim <= MAX_HEAD_DIM, op, || {
        format!("head_dim {head_dim} > {MAX_HEAD_DIM} is not supported on the GPU")
    })?;
    ensure(batch * heads <= MAX_HEADS_TOTAL, op, || {
        format!("batch·heads = {} exceeds {MAX_HEADS_TOTAL}", batch * heads)
    })?;
    Ok(Dims(*dims))
}

impl Dims {
    /// Checks that `precision` can run these dims on `dev`.
    fn check_precision(&self, dev: &CudaDevice, op: &'static str, precision: AttentionPrecision) -> Result<()> {
        if precision == AttentionPrecision::F32 {
            return Ok(());
        }
        let head_dim = self.0.head_dim;
        ensure(tensor_cores_fit(head_dim), op, || {
            format!("head_dim {head_dim} is not one of the tensor-core kernels' {TENSOR_CORE_HEAD_DIMS:?}")
        })?;
        let (major, minor) = dev.compute_capability();
        if major < 8 {
            let message = format!("bf16 tensor cores need compute capability 8.0, the device has {major}.{minor}");
            return Err(CudaError::Invalid { op, message });
        }
        Ok(())
    }

    /// The tensor-core kernel of `kernels` (one per entry of [`TENSOR_CORE_HEAD_DIMS`]) for
    /// this head dimension (checked by [`Dims::check_precision`]).
    fn mma_kernel(&self, kernels: [&'static str; 4]) -> &'static str {
        let at = TENSOR_CORE_HEAD_DIMS.iter().position(|&d| d == self.0.head_dim);
        kernels[at.expect("checked by check_precision")]
    }

    /// One tensor-core block per 64 rows of `rows`, per (b, h); shared memory is static.
    fn mma_grid(&self, rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(TENSOR_CORE_ROWS) as u32, (self.0.batch * self.0.heads) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The tensor-core kernels' trailing arguments: `Tq, Tk, H, scale`.
    fn mma_args(&self) -> [Arg; 4] {
        let d = &self.0;
        [size(d.q_seq), size(d.kv_seq), size(d.heads), Arg::F32(d.scale)]
    }

    /// Odd shared-memory row stride of the tiles.
    fn tile_stride(&self) -> usize {
        self.0.head_dim | 1
    }

    /// One block per `WARPS` rows of `rows`, per (b, h).
    fn grid(&self, rows: usize, shared_floats: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS) as u32, (self.0.batch * self.0.heads) as u32, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (shared_floats * std::mem::size_of::<f32>()) as u32,
        }
    }

    /// The trailing size arguments every kernel takes, then `scale`.
    fn args(&self) -> [Arg; 6] {
        let d = &self.0;
        [size(d.batch), size(d.q_seq), size(d.kv_seq), size(d.heads), size(d.head_dim), Arg::F32(d.scale)]
    }

    fn is_empty(&self) -> bool {
        self.0.lse_len() == 0
    }
}

/// Checks that q, k and v live on `dev` and share one element type, which bf16 only with
/// tensor-core `precision` (the f32 kernels read f32); whether they are bf16.
fn check_qkv(dev: &CudaDevice, op: &'static str, qkv: &[Values; 3], precision: AttentionPrecision) -> Result<bool> {
    for values in qkv {
        values.check_owner(dev, op)?;
    }
    let bf16 = qkv[0].is_bf16();
    ensure(qkv.iter().all(|values| values.is_bf16() == bf16), op, || {
        "q, k and v must share one element type".to_string()
    })?;
    ensure(!bf16 || precision == AttentionPrecision::Bf16, op, || {
        "bf16 q, k and v need the tensor-core kernels (AttentionPrecision::Bf16)".to_string()
    })?;
    Ok(bf16)
}

/// Checks that a bf16 twin belongs to `dev` and has `len` elements.
fn check_twin(
    dev: &CudaDevice,
    op: &'static str,
    name: &str,
    twin: &Option<&mut DeviceBuffer<bf16>>,
    len: usize,
) -> Result<()> {
    if let Some(twin) = twin {
        dev.check_owner(op, twin)?;
        ensure_len(op, name, twin.len(), len)?;
    }
    Ok(())
}

/// `out` and `lse` (the log-sum-exp of each query's scaled scores, saved for backward) of
/// the operands `dims` describes (`qkv`: q, k and v), as
/// `cpu::attention::causal_attention_forward`, with products in `precision`. `out` is f32
/// (`out_bf16`, when given, gets it rounded to nearest even), or, from bf16 q, k and v, bf16
/// only (rounded to nearest even; no twin).
pub fn causal_attention_forward(
    dev: &CudaDevice,
    qkv: [Values; 3],
    dims: &AttentionDims,
    precision: AttentionPrecision,
    (out, out_bf16): (ValuesMut, Option<&mut DeviceBuffer<bf16>>),
    lse: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "causal_attention_forward";
    let bf16_inputs = check_qkv(dev, OP, &qkv, precision)?;
    let out = out.as_values();
    out.check_owner(dev, OP)?;
    check_owners(dev, OP, &[lse])?;
    let [q, k, v] = qkv;
    let d = check(OP, dims, q.len(), k.len(), v.len())?;
    ensure_len(OP, "out", out.len(), q.len())?;
    ensure(!out.is_bf16() || (bf16_inputs && out_bf16.is_none()), OP, || {
        "a bf16 output needs bf16 q, k and v, and no twin".to_string()
    })?;
    check_twin(dev, OP, "out_bf16", &out_bf16, out.len())?;
    ensure_len(OP, "lse", lse.len(), dims.lse_len())?;
    d.check_precision(dev, OP, precision)?;
    if d.is_empty() {
        return Ok(());
    }
    let out_bf16 = if out.is_bf16() { out.arg_at(0) } else { opt_ptr(out_bf16.as_deref()) };
    if precision == AttentionPrecision::Bf16 {
        let inputs = RowsIn::dense([q, k, v], dims);
        return launch_mma_forward(dev, &d, inputs, bf16_inputs, [Arg::Ptr(out.f32_address()), out_bf16], lse);
    }
    let mut args = vec![q.arg_at(0), k.arg_at(0), v.arg_at(0), Arg::Ptr(out.f32_address()), out_bf16, ptr(lse)];
    let shared = 2 * TILE * d.tile_stride() + WARPS * dims.head_dim;
    args.extend(d.args());
    dev.launch(FAMILY, "attention_forward", d.grid(dims.q_seq, shared), &args)
}

/// Where the tensor-core kernels read q, k and v (`RowsIn` in attention_mma.cu).
#[derive(Clone, Copy, Debug)]
pub enum QkvInputs<'a> {
    /// Dense `[B, T, H, D]` q, k and v, as attention reads them (RoPE, or the fused gate's
    /// rotary epilogue, has rotated q and k already).
    Dense([Values<'a>; 3]),
    /// The packed QKV product `[B, T, 3, H, D]` in bf16, q and k not rotated: the kernels
    /// rotate them by RoPE's tables (the ones the launcher is given, token t at position t) as
    /// they load them, with rope.cu's arithmetic and rounding, so they compute what they would
    /// from `rope_qkv_forward`'s outputs, bit for bit.
    Packed(Values<'a>),
}

/// A kernel's q, k and v arguments and their `RowsIn`: the three addresses, the elements
/// between two tokens' rows and RoPE's tables (null when q and k are read as they are).
struct RowsIn {
    qkv: [Arg; 3],
    layout: [Arg; 3],
}

impl RowsIn {
    /// Dense q, k and v of `dims`, read as they are.
    fn dense(qkv: [Values; 3], dims: &AttentionDims) -> RowsIn {
        let width = dims.heads * dims.head_dim;
        RowsIn { qkv: qkv.map(|x| x.arg_at(0)), layout: [size(width), Arg::Ptr(0), Arg::Ptr(0)] }
    }

    /// A packed product of `dims`, its q and k rotated by `[cos, sin]` as they are loaded.
    fn packed(qkv: Values, dims: &AttentionDims, [cos, sin]: [Arg; 2]) -> RowsIn {
        let width = dims.heads * dims.head_dim;
        RowsIn { qkv: [qkv.arg_at(0), qkv.arg_at(width), qkv.arg_at(2 * width)], layout: [size(3 * width), cos, sin] }
    }
}

impl QkvInputs<'_> {
    /// The kernels' arguments for these inputs of `dims` (checked by the caller): a packed
    /// product's q and k rotated by `tables` (`[cos, sin]`), dense ones read as they are.
    fn rows_in(&self, dims: &AttentionDims, tables: [Arg; 2]) -> RowsIn {
        match *self {
            QkvInputs::Dense(qkv) => RowsIn::dense(qkv, dims),
            QkvInputs::Packed(qkv) => RowsIn::packed(qkv, dims, tables),
        }
    }

    /// Checks the inputs against `dims`: owned by `dev`, one element type (bf16 with tensor-core
    /// `precision` only), and a packed product bf16 and of one length (Tq = Tk; its launcher
    /// checks RoPE's tables); returns the launch geometry and whether they are bf16.
    fn check(
        &self,
        dev: &CudaDevice,
        op: &'static str,
        dims: &AttentionDims,
        precision: AttentionPrecision,
    ) -> Result<(Dims, bool)> {
        match self {
            QkvInputs::Dense(qkv) => {
                let bf16 = check_qkv(dev, op, qkv, precision)?;
                Ok((check(op, dims, qkv[0].len(), qkv[1].len(), qkv[2].len())?, bf16))
            }
            QkvInputs::Packed(qkv) => {
                qkv.check_owner(dev, op)?;
                ensure(qkv.is_bf16() && precision == AttentionPrecision::Bf16, op, || {
                    "an unrotated packed product is read by the tensor-core kernels, in bf16".to_string()
                })?;
                let AttentionDims { q_seq, kv_seq, head_dim, .. } = *dims;
                ensure(q_seq == kv_seq, op, || {
                    format!("a packed product has one length, not Tq {q_seq} and Tk {kv_seq}")
                })?;
                let part = dims.batch * kv_seq * dims.heads * head_dim;
                ensure_len(op, "qkv", qkv.len(), 3 * part)?;
                Ok((check(op, dims, part, part, part)?, true))
            }
        }
    }
}

/// Checks that RoPE's tables are `dev`'s and cover `dims`' key positions.
fn check_tables(
    dev: &CudaDevice,
    op: &'static str,
    dims: &AttentionDims,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    check_owners(dev, op, &[cos, sin])?;
    let table_len = dims.kv_seq * dims.head_dim / 2;
    ensure(cos.len() >= table_len && sin.len() >= table_len, op, || {
        format!("RoPE's tables hold {} and {} values, {} positions need {table_len}", cos.len(), sin.len(), dims.kv_seq)
    })
}

/// The tensor-core forward's launch (checked by the caller): `out` as `[f32, bf16]` addresses.
fn launch_mma_forward(
    dev: &CudaDevice,
    d: &Dims,
    inputs: RowsIn,
    bf16_inputs: bool,
    out: [Arg; 2],
    lse: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let mut args = Vec::from(inputs.qkv);
    args.extend(inputs.layout);
    args.extend(out);
    args.push(ptr(lse));
    args.extend(d.mma_args());
    let kernels = if bf16_inputs { MMA_FORWARD_BF16 } else { MMA_FORWARD };
    dev.launch(MMA_FAMILY, d.mma_kernel(kernels), d.mma_grid(d.0.q_seq), &args)
}

/// [`causal_attention_forward`] on the tensor cores over RoPE's rotations of q and k, read
/// from the packed QKV product `qkv` (`[B, T, 3, H, D]`, bf16) and rotated as they are loaded
/// by `cos` and `sin` (`[positions, D/2]`, token t at row t): the bits of
/// `rope::rope_qkv_forward` then [`causal_attention_forward`], with no launch and no dense
/// q, k, v in between. `out` is f32 or bf16 alone (as FlashAttention-2 stores it), `lse` f32.
pub fn rotary_causal_attention_forward_packed(
    dev: &CudaDevice,
    qkv: Values,
    dims: &AttentionDims,
    out: ValuesMut,
    lse: &mut DeviceBuffer<f32>,
    (cos, sin): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
) -> Result<()> {
    const OP: &str = "rotary_causal_attention_forward_packed";
    let (d, _) = QkvInputs::Packed(qkv).check(dev, OP, dims, AttentionPrecision::Bf16)?;
    check_tables(dev, OP, dims, cos, sin)?;
    check_owners(dev, OP, &[lse])?;
    let out = out.as_values();
    out.check_owner(dev, OP)?;
    ensure_len(OP, "out", out.len(), dims.batch * dims.q_seq * dims.heads * dims.head_dim)?;
    ensure_len(OP, "lse", lse.len(), dims.lse_len())?;
    d.check_precision(dev, OP, AttentionPrecision::Bf16)?;
    if d.is_empty() {
        return Ok(());
    }
    let inputs = RowsIn::packed(qkv, dims, [ptr(cos), ptr(sin)]);
    launch_mma_forward(dev, &d, inputs, true, out.typed_args_at(0), lse)
}

/// `dq, dk, dv =` gradients, recomputing probabilities from q, k and `lse`
/// (`δ_i = Σ dout_i ⊙ out_i`), with products in `precision` (that of the forward which made
/// `out` and `lse`); `out` is bf16 for bf16 q, k and v, else f32, and so may `dout` be (the
/// output projection's input gradient under bf16 products). Each gradient is written
/// in f32, or (the tensor-core kernels) rounded to bf16 alone when it is a bf16 buffer (its
/// readers under bf16 products: RoPE's backward, the projections' products); `dv_bf16`, when
/// given beside an f32 `dv`, gets `dv` rounded to nearest even.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_backward(
    dev: &CudaDevice,
    qkv: [Values; 3],
    out: Values,
    lse: &DeviceBuffer<f32>,
    dout: Values,
    dims: &AttentionDims,
    precision: AttentionPrecision,
    dq: ValuesMut,
    mut dk: ValuesMut,
    (mut dv, mut dv_bf16): (ValuesMut, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "causal_attention_backward";
    let (d, _) = check_backward_inputs(dev, OP, &QkvInputs::Dense(qkv), &out, lse, &dout, dims, precision)?;
    let [q, k, v] = qkv;
    check_grads(dev, OP, [dq.as_values(), dk.as_values(), dv.as_values()], [q.len(), k.len(), v.len()], precision)?;
    ensure(!dv.as_values().is_bf16() || dv_bf16.is_none(), OP, || "a bf16 dv takes no bf16 twin".to_string())?;
    check_twin(dev, OP, "dv_bf16", &dv_bf16, v.len())?;
    if d.is_empty() {
        // No queries: keys and values that nothing attends to have zero gradients.
        if let Some(twin) = dv_bf16.as_deref_mut() {
            dev.fill_zero(twin)?;
        }
        dk.fill_zero(dev)?;
        return dv.fill_zero(dev);
    }
    let (dq, dk, dv) = (dq.as_values(), dk.as_values(), dv.as_values());
    let [dv_f32, dv_own_bf16] = dv.typed_args_at(0);
    let dv_bf16 = if dv.is_bf16() { dv_own_bf16 } else { opt_ptr(dv_bf16.as_deref()) };
    if precision == AttentionPrecision::Bf16 {
        // The tensor-core kernels take each gradient's bf16 pointer beside its f32 one.
        let rows = GradRows {
            dq: dq.typed_args_at(0),
            dk: dk.typed_args_at(0),
            dv: [dv_f32, dv_bf16],
            stride: dims.heads * dims.head_dim,
            tables: [Arg::Ptr(0), Arg::Ptr(0)],
        };
        let inputs = RowsIn::dense([q, k, v], dims);
        return launch_mma_backward(dev, &d, (inputs, q.is_bf16()), out, lse, dout, rows);
    }
    let AttentionDims { q_seq, kv_seq, head_dim, .. } = *dims;
    // δ per query (Σ dout ⊙ out), written by the dq kernel and read by the dk, dv kernel.
    // It goes back to the pool on return; later users are queued after these kernels.
    let delta = dev.alloc::<f32>(dims.lse_len())?;
    let (q, k, v) = (q.arg_at(0), k.arg_at(0), v.arg_at(0));
    let [dq_f32, _] = dq.typed_args_at(0);
    let [dk_f32, _] = dk.typed_args_at(0);
    let mut dq_args =
        vec![q.clone(), k.clone(), v.clone(), out.arg_at(0), dout.arg_at(0), ptr(lse), ptr(&delta), dq_f32];
    let mut dkv_args = vec![q, k, v, dout.arg_at(0), ptr(lse), ptr(&delta), dk_f32];
    let stride = d.tile_stride();
    dq_args.extend(d.args());
    dev.launch(FAMILY, "attention_backward_dq", d.grid(q_seq, 2 * TILE * stride + 2 * WARPS * head_dim), &dq_args)?;
    dkv_args.extend([dv_f32, dv_bf16]);
    dkv_args.extend(d.args());
    let shared = 2 * TILE * stride + 2 * WARPS * head_dim + 2 * TILE;
    dev.launch(FAMILY, "attention_backward_dkv", d.grid(kv_seq, shared), &dkv_args)
}

/// [`causal_attention_backward`] of attention over RoPE's rotations of q and k taken out of
/// one packed QKV product, written straight into that product's gradient
/// `dqkv: [B, T, 3, H, D]`: each token's row is `[Rᵀ dq | Rᵀ dk | dv]`, what
/// `rope::rope_qkv_backward` makes of the three gradients, with no launch of its own and no
/// dense gradients in between. `inputs` are `rope::rope_qkv_forward`'s rotated q, k and v
/// (bf16), or the packed product itself, rotated as it is loaded ([`QkvInputs::Packed`]). The
/// kernels rotate dq and dk back by the tables the forward rotated by (`cos`, `sin`:
/// `[positions, D/2]`, token t at row t; a packed product's q and k are rotated by them as
/// they are loaded) as they store them, from their f32 sums, so each value
/// is rounded once (the unfused path rounds dq to bf16 before RoPE's backward reads it, and
/// again after). `dqkv` is f32, or bf16 alone (rounded to nearest even): the packed product's
/// backward, or the fused gate's, reads it so. Tensor-core kernels only: bf16 inputs, `Tq = Tk`.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_backward_packed(
    dev: &CudaDevice,
    inputs: QkvInputs,
    out: Values,
    lse: &DeviceBuffer<f32>,
    dout: Values,
    dims: &AttentionDims,
    dqkv: ValuesMut,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "causal_attention_backward_packed";
    let (d, bf16_inputs) = check_backward_inputs(dev, OP, &inputs, &out, lse, &dout, dims, AttentionPrecision::Bf16)?;
    ensure(bf16_inputs, OP, || "the packed backward reads bf16 q, k and v (RoPE's output)".to_string())?;
    let AttentionDims { q_seq, kv_seq, heads, head_dim, .. } = *dims;
    ensure(q_seq == kv_seq, OP, || format!("a packed product has one length, not Tq {q_seq} and Tk {kv_seq}"))?;
    let dqkv = dqkv.as_values();
    dqkv.check_owner(dev, OP)?;
    let part = dims.batch * q_seq * heads * head_dim;
    ensure_len(OP, "dqkv", dqkv.len(), 3 * part)?;
    check_tables(dev, OP, dims, cos, sin)?;
    if d.is_empty() {
        return Ok(());
    }
    let width = heads * head_dim;
    let tables = [ptr(cos), ptr(sin)];
    let rows = GradRows {
        dq: dqkv.typed_args_at(0),
        dk: dqkv.typed_args_at(width),
        dv: dqkv.typed_args_at(2 * width),
        stride: 3 * width,
        tables: tables.clone(),
    };
    launch_mma_backward(dev, &d, (inputs.rows_in(dims, tables), true), out, lse, dout, rows)
}

/// Checks the backward's inputs: q, k and v ([`QkvInputs::check`]), the forward's `out` and
/// `lse` and `dout`, on `dev`, of `dims`' sizes, `out` bf16 exactly when q, k and v are, `dout`
/// bf16 only beside them, and `precision` runnable on `dev`; returns the launch geometry and
/// whether the inputs are bf16.
#[allow(clippy::too_many_arguments)]
fn check_backward_inputs(
    dev: &CudaDevice,
    op: &'static str,
    inputs: &QkvInputs,
    out: &Values,
    lse: &DeviceBuffer<f32>,
    dout: &Values,
    dims: &AttentionDims,
    precision: AttentionPrecision,
) -> Result<(Dims, bool)> {
    let (d, bf16_inputs) = inputs.check(dev, op, dims, precision)?;
    out.check_owner(dev, op)?;
    check_owners(dev, op, &[lse])?;
    dout.check_owner(dev, op)?;
    ensure(out.is_bf16() == bf16_inputs, op, || {
        "the saved output is bf16 exactly when q, k and v are (the tensor-core kernels)".to_string()
    })?;
    ensure(!dout.is_bf16() || bf16_inputs, op, || "a bf16 dout needs bf16 q, k and v".to_string())?;
    let q_len = dims.batch * dims.q_seq * dims.heads * dims.head_dim;
    ensure(out.len() == q_len && dout.len() == q_len, op, || "out or dout has the wrong length".to_string())?;
    ensure_len(op, "lse", lse.len(), dims.lse_len())?;
    d.check_precision(dev, op, precision)?;
    Ok((d, bf16_inputs))
}

/// Where the tensor-core backward stores dq, dk and dv (`RowsOut` in attention_mma.cu): each
/// gradient's f32 and bf16 addresses (null where it has none), the elements between two
/// tokens' rows, and RoPE's tables (null: stored as summed; else dq and dk rotated back).
struct GradRows {
    dq: [Arg; 2],
    dk: [Arg; 2],
    dv: [Arg; 2],
    stride: usize,
    tables: [Arg; 2],
}

/// Blocks of the tensor-core backward wanted at least, about 4 per SM of a 132-SM GPU (2
/// run at once by registers): where `B·H` heads give fewer, each head's key tiles are split
/// into up to [`MAX_KEY_GROUPS`] groups, a block each.
const BACKWARD_BLOCKS: usize = 512;
/// Most groups of key tiles per head: each holds a partial dq of its own (f32, `Tq × D` a head).
const MAX_KEY_GROUPS: usize = 16;

/// The groups of each head's key tiles (grid.x of the backward, `attention_mma.cu`): as few as
/// give [`BACKWARD_BLOCKS`] blocks, at least one, at most one per key tile and [`MAX_KEY_GROUPS`].
fn key_tile_groups(kv_seq: usize, heads_total: usize) -> usize {
    let tiles = kv_seq.div_ceil(TENSOR_CORE_ROWS).max(1);
    BACKWARD_BLOCKS.div_ceil(heads_total.max(1)).clamp(1, tiles.min(MAX_KEY_GROUPS))
}

/// The tensor-core backward's two launches (checked by the caller): dk, dv and each group's
/// partial dq in one pass over each key tile, by the element types of the inputs (`inputs.1`:
/// bf16) and dout, then the finish that adds the partials up into dq.
fn launch_mma_backward(
    dev: &CudaDevice,
    d: &Dims,
    (inputs, bf16_inputs): (RowsIn, bool),
    out: Values,
    lse: &DeviceBuffer<f32>,
    dout: Values,
    rows: GradRows,
) -> Result<()> {
    let kernels = match (bf16_inputs, dout.is_bf16()) {
        (true, true) => MMA_BACKWARD_DOUT_BF16,
        (true, false) => MMA_BACKWARD_BF16,
        (false, _) => MMA_BACKWARD,
    };
    let AttentionDims { batch, heads, q_seq, kv_seq, head_dim, .. } = d.0;
    let heads_total = batch * heads;
    let groups = key_tile_groups(kv_seq, heads_total);
    // Each group's δ per query (Σ dout ⊙ out) and partial dq, written and read by its block
    // alone, then dq's finish. They go back to the pool on return; later users are queued
    // after these kernels.
    let delta = dev.alloc::<f32>(groups * heads_total * q_seq)?;
    let dq_part = dev.alloc::<f32>(groups * heads_total * q_seq * head_dim)?;
    let [cos, sin] = rows.tables;
    let layout = [size(rows.stride), cos, sin];
    let mut args = Vec::from(inputs.qkv);
    args.extend(inputs.layout);
    args.extend([out.arg_at(0), dout.arg_at(0), ptr(lse), ptr(&delta), ptr(&dq_part)]);
    args.extend(rows.dk);
    args.extend(rows.dv);
    args.extend(layout.clone());
    args.extend(d.mma_args());
    let grid = LaunchConfig { grid_dim: (groups as u32, heads_total as u32, 1), ..d.mma_grid(kv_seq) };
    dev.launch(MMA_FAMILY, d.mma_kernel(kernels), grid, &args)?;
    let mut finish_args = vec![ptr(&dq_part), size(groups)];
    finish_args.extend(rows.dq);
    finish_args.extend(layout);
    finish_args.extend(d.mma_args());
    dev.launch(MMA_FAMILY, d.mma_kernel(MMA_DQ_FINISH), d.mma_grid(q_seq), &finish_args)
}

/// Checks the backward's gradients `[dq, dk, dv]`: `dev`'s, of the lengths of q, k and v, and
/// in bf16 only for the tensor-core kernels.
fn check_grads(
    dev: &CudaDevice,
    op: &'static str,
    grads: [Values; 3],
    lens: [usize; 3],
    precision: AttentionPrecision,
) -> Result<()> {
    for (grad, len) in grads.iter().zip(lens) {
        grad.check_owner(dev, op)?;
        ensure(grad.len() == len, op, || format!("a gradient has {} elements, its input {len}", grad.len()))?;
        ensure(!grad.is_bf16() || precision == AttentionPrecision::Bf16, op, || {
            "gradients in bf16 need the tensor-core kernels".to_string()
        })?;
    }
    Ok(())
}

/// The unfused baseline (for benches): materialises the `[B·H·Tq, Tk]` score matrix in
/// device memory, one thread per query. Same semantics as [`causal_attention_forward`]
/// without `lse`.
pub fn causal_attention_naive(
    dev: &CudaDevice,
    q: &DeviceBuffer<f32>,
    k: &DeviceBuffer<f32>,
    v: &DeviceBuffer<f32>,
    dims: &AttentionDims,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "causal_attention_naive";
    check_owners(dev, OP, &[q, k, v, out])?;
    let d = check(OP, dims, q.len(), k.len(), v.len())?;
    ensure_len(OP, "out", out.len(), q.len())?;
    if d.is_empty() {
        return Ok(());
    }
    let rows = dims.lse_len();
    let scores = dev.alloc::<f32>(rows * dims.kv_seq)?;
    let mut args = vec![ptr(q), ptr(k), ptr(v), ptr(out), ptr(&scores)];
    args.extend(d.args());
    dev.launch(FAMILY, "attention_naive_forward", elementwise(rows), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One group where the heads alone fill the GPU (the anchor's 64 × 8 heads), more for fewer
    /// heads, never more than the key tiles nor [`MAX_KEY_GROUPS`], and one for no keys.
    #[test]
    fn key_tile_groups_split_few_heads_long_sequences_only() {
        assert_eq!(key_tile_groups(256, 512), 1);
        assert_eq!(key_tile_groups(256, 256), 2);
        assert_eq!(key_tile_groups(256, 8), 4);
        assert_eq!(key_tile_groups(8192, 8), MAX_KEY_GROUPS);
        assert_eq!(key_tile_groups(150, 256), 2);
        assert_eq!(key_tile_groups(0, 4), 1);
    }
}
