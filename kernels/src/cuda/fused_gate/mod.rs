//! The fused gated projection on the GPU, Transponder eq. 8-10 (`layer-channel-scalar`):
//!
//! ```text
//! [Z | U_c | U_s] = x · [W | A_cᵀ | A_sᵀ]                       (eq. 8, one bf16 tensor-core GEMM)
//! γ = σ̃_αc(φ(U_c + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(U_s + a_s)·B_sᵀ + b_s)   (eq. 9, in the GEMM epilogue)
//! Ẑ = γ ⊙ Z                                                     (eq. 10)
//! ```
//!
//! Semantics are `cpu::fused_gate`'s (same [`FusedGateDims`], the same parameter roles, the
//! same `zu` saved for backward, f32 or, under bf16 products, bf16: [`DeviceValues`]). The forward
//! reads `x` and the concatenated weight in bf16
//! (`[W; A_c; A_s]` as one `[K, d_in]` bf16 buffer: [`pack_weight`] builds it in one launch;
//! in training the caller keeps it as the weights' bf16 copy, which the optimizer's update
//! rewrites) and accumulates in f32. [`fused_gate_forward`] writes `zu` only when asked
//! (training); inference writes nothing but `Ẑ`.
//!
//! [`fused_gate_forward_unfused`] is the engine's path (cuBLAS bf16 GEMM into `zu`, then
//! [`fused_gate_apply`]), for a [`GateGroup`] of projections of one input at once (q, k and
//! v; gate and up: one GEMM over their weights packed together, one gate launch); it gives
//! [`fused_gate_forward`]'s result to f32 rounding with an f32 `zu`, to bf16 rounding with a
//! bf16 one. [`fused_gate_forward_rotary_qkv`] is the same path for attention's q, k and v,
//! its gate kernel writing them as attention reads them, q and k rotated by RoPE;
//! [`fused_gate_forward_swiglu`] for the FFN's gate and up, writing SwiGLU's output too; and
//! [`fused_gate_forward_add_rms_norm`] for an output projection (o, down) whose output only the
//! residual stream's add and next RMSNorm read, its launch doing those instead of storing Ẑ.
//! The backward
//! ([`fused_gate_backward`], `backward.rs`) reads `zu`, the f32 `x` and f32 weights (under
//! bf16 products, the forward's bf16 `x` and packed weight): one row kernel (the gate's
//! elementwise backward and its rank-r products), one launch of deterministic column sums for
//! `da, db, dα, dB_s` and `dB_c = dL_cᵀ·H_c` (weighted by `H_c`), and cuBLAS products for `dx`
//! and the packed weights' gradient. For the FFN's gate and up group, whose output SwiGLU
//! read ([`fused_gate_forward_swiglu`]), the row kernel computes SwiGLU's backward from its
//! output gradient and the gated output ([`OutputGrad::Swiglu`]).
//! Gradients are written, not added.

use half::bf16;

pub use crate::cpu::fused_gate::FusedGateDims;
use crate::cpu::norm::NormDims;
pub use crate::cpu::unary::Unary;

mod backward;

pub use backward::{
    fused_gate_backward, fused_gate_backward_with_norm, DeviceFusedGateGrads, DeviceGateGrads, GateProducts, OutputGrad,
};

use super::allocator::DeviceBuffer;
use super::blas::{gemm, GemmDims, Operand, Precision};
use super::device::CudaDevice;
use super::elementwise::{pack_bf16, unary_code};
use super::error::{ensure, ensure_len, CudaError, Result};
use super::launch::{address_list, check_owners, int, length_list, ptr, size, LIST_LEN, THREADS};
use super::module::{Arg, KernelFamily};
use super::norm::rms_norm_rows;
use super::values::{output_with_twin, DeviceValues, Values, ValuesMut};
use crate::cpu::matmul::Store;

/// Largest `r_c + r_s` the kernels take (the summary tile is padded to 16, 32 or 64).
pub const MAX_RANK: usize = 64;
/// Rows, Z columns and depth of one block tile of the tensor-core kernel (FG_BM, FG_BN and
/// FG_BK in fused_gate.cu).
const BLOCK_M: usize = 128;
const BLOCK_N: usize = 128;
const BLOCK_K: usize = 32;

/// `fused_gate_mma`'s dynamic shared memory at padded rank `ru` (FgShared in fused_gate.cu):
/// two stages of bf16 tiles, x and W `[128][32]` and A `[ru][32]`, which the epilogue reuses
/// for `H` (`[128][ru + 4]` f32) and `γ_s`.
const fn mma_shared_bytes(ru: usize) -> usize {
    let stages = 2 * (BLOCK_M + BLOCK_N + ru) * BLOCK_K * 2;
    let epilogue = (BLOCK_M * (ru + 4) + BLOCK_M) * 4;
    if stages > epilogue {
        stages
    } else {
        epilogue
    }
}

// The most it takes (at rank MAX_RANK) within the 48 KiB a launch gets without opting in.
const _: () = assert!(mma_shared_bytes(MAX_RANK) <= 48 * 1024);

const FAMILY: KernelFamily = KernelFamily::FusedGate;
/// Cap on `fused_gate_apply`'s row blocks (each block loops over the rows past it).
const MAX_ROW_BLOCKS: usize = 1 << 16;

/// One modulator on the device: `A: [r, d_in]`, `a: [r]`, `B: [m, r]`, `b: [m]`, α.
#[derive(Clone, Copy, Debug)]
pub struct DeviceGateParams<'a> {
    /// `A: [r, d_in]` (f32; the forward reads its bf16 copy inside the packed weight).
    pub a_weight: &'a DeviceBuffer<f32>,
    /// `a: [r]`.
    pub a_bias: &'a DeviceBuffer<f32>,
    /// `B: [m, r]`.
    pub b_weight: &'a DeviceBuffer<f32>,
    /// `b: [m]`.
    pub b_bias: &'a DeviceBuffer<f32>,
    /// The curvature α of `σ̃_α`: a one-element buffer, read by the kernels on the device
    /// (a learnable α never has to be copied back to the host).
    pub alpha: &'a DeviceBuffer<f32>,
}

/// Everything the fused projection reads besides `x`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceFusedGateParams<'a> {
    /// `W: [d_out, d_in]` (f32).
    pub weight: &'a DeviceBuffer<f32>,
    /// The channel modulator (`m = d_out`).
    pub channel: DeviceGateParams<'a>,
    /// The scalar modulator (`m = 1`).
    pub scalar: DeviceGateParams<'a>,
    /// `φ`, the modulators' pointwise nonlinearity.
    pub phi: Unary,
}

/// One projection of a group of fused gated projections of one input (q, k and v; gate and
/// up), which the launchers below compute together: its sizes (one `rows`, `d_in`, ranks and
/// φ for the whole group; its own `d_out`) and parameters. A single projection is a group of
/// one.
#[derive(Clone, Copy, Debug)]
pub struct GateGroup<'a> {
    /// Its sizes.
    pub dims: FusedGateDims,
    /// Its weight and modulators.
    pub params: DeviceFusedGateParams<'a>,
}

/// Most projections in one group (8 parameter addresses each fill the kernels' list).
pub const MAX_GROUPS: usize = LIST_LEN / 8;

/// Where a group's projections sit: group g's `[Z_g | U_cg | U_sg]` from ZU column `zu_at[g]`
/// (ZU rows `zu_width` wide, as the packed weight's rows are ordered) and its `Ẑ_g` from
/// output column `out_at[g]` (rows `out_width` wide).
struct Layout {
    rows: usize,
    d_in: usize,
    rank_channel: usize,
    rank_scalar: usize,
    zu_at: Vec<usize>,
    out_at: Vec<usize>,
    zu_width: usize,
    out_width: usize,
}

/// Checks a group (1 to [`MAX_GROUPS`] projections sharing `rows`, `d_in`, ranks and φ, each
/// with parameters of its sizes) and lays it out.
fn layout(dev: &CudaDevice, op: &'static str, groups: &[GateGroup]) -> Result<Layout> {
    let Some(first) = groups.first() else {
        return Err(CudaError::shape(op, "a group of no projections".to_string()));
    };
    ensure(groups.len() <= MAX_GROUPS, op, || format!("{} projections, at most {MAX_GROUPS} per group", groups.len()))?;
    let d = first.dims;
    let mut layout = Layout {
        rows: d.rows,
        d_in: d.d_in,
        rank_channel: d.rank_channel,
        rank_scalar: d.rank_scalar,
        zu_at: Vec::with_capacity(groups.len()),
        out_at: Vec::with_capacity(groups.len()),
        zu_width: 0,
        out_width: 0,
    };
    for g in groups {
        check_params(dev, op, &g.dims, &g.params)?;
        let e = g.dims;
        let shared = (e.rows, e.d_in, e.rank_channel, e.rank_scalar) == (d.rows, d.d_in, d.rank_channel, d.rank_scalar);
        ensure(shared && g.params.phi == first.params.phi, op, || {
            format!("the projections of a group differ in rows, d_in, ranks or φ: {e:?} and {d:?}")
        })?;
        layout.zu_at.push(layout.zu_width);
        layout.out_at.push(layout.out_width);
        layout.zu_width += e.width();
        layout.out_width += e.d_out;
    }
    Ok(layout)
}

/// The row kernels' group arguments: every projection's eight modulator parameter addresses
/// (`a_c, B_c, b_c, α_c, a_s, B_s, b_s, α_s`) and its place (first ZU column, first output
/// column, `d_out`), as `gate_group` in fused_gate.cu reads them.
fn group_lists(groups: &[GateGroup], layout: &Layout) -> [Arg; 2] {
    let params = groups.iter().flat_map(|g| {
        let (c, s) = (&g.params.channel, &g.params.scalar);
        [c.a_bias, c.b_weight, c.b_bias, c.alpha, s.a_bias, s.b_weight, s.b_bias, s.alpha].map(DeviceBuffer::device_ptr)
    });
    let places = groups.iter().enumerate().flat_map(|(i, g)| [layout.zu_at[i], layout.out_at[i], g.dims.d_out]);
    [address_list(params), length_list(places)]
}

/// `fused_gate_backward_rows`'s blocks (FG_BACK_* in fused_gate.cu): threads per block (8
/// warps, a column each), rows per row block of its loops, and about how many blocks each
/// projection's rows are split into (two an SM on a 132-SM H100 or H200: enough to fill the
/// card for a single projection, and few enough that the blocks' terms of the cross-row sums
/// stay small beside `[N, d_out]`).
const BACKWARD_THREADS: usize = 256;
const BACKWARD_ROWS: usize = 16;
const BACKWARD_BLOCKS: usize = 256;

/// `fused_gate_backward_rows`'s split of the rows: each block's rows (a multiple of
/// [`BACKWARD_ROWS`]) and the blocks per projection. A function of `rows` alone, so that the
/// order of every sum is the same on every device.
struct BackwardSplit {
    rows_per_block: usize,
    blocks: usize,
}

impl BackwardSplit {
    fn new(rows: usize) -> BackwardSplit {
        let row_blocks = rows.div_ceil(BACKWARD_ROWS).max(1);
        let rows_per_block = row_blocks.div_ceil(BACKWARD_BLOCKS) * BACKWARD_ROWS;
        BackwardSplit { rows_per_block, blocks: rows.div_ceil(rows_per_block).max(1) }
    }

    /// The launch: (blocks, projections), with [`BACKWARD_SHARED_BYTES`] of dynamic shared
    /// memory.
    fn launch(&self, groups: usize) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: (self.blocks as u32, groups as u32, 1),
            block_dim: (BACKWARD_THREADS as u32, 1, 1),
            shared_mem_bytes: BACKWARD_SHARED_BYTES as u32,
        }
    }
}

/// `fused_gate_backward_rows`' shared memory, all of it dynamic (backward_shared_memory in
/// fused_gate.cu lays it out): each row's `H` (`MAX_RANK` floats) and `γ_s`, each warp's sums
/// of the summaries' terms (`2·MAX_RANK + 3` floats), then the stage of the row sums, the larger
/// of its two paths': off the tensor cores three f32 terms per element of a chunk of rows (a
/// row per warp) of a column tile; on them each warp's `BackwardWarpStage` (dL_c of 16 rows ×
/// 32 columns in two bf16 parts, a chunk's two f32 terms in rows padded to 36, and 16 rows of
/// 10 sums).
const BACKWARD_SHARED_BYTES: usize = {
    let warps = BACKWARD_THREADS / 32;
    let general_stage = 4 * warps * 3 * BACKWARD_THREADS;
    let warp_stage = 2 * 2 * BACKWARD_ROWS * 32 + 4 * (8 * 2 * 36 + BACKWARD_ROWS * 10);
    let stage = if general_stage > warps * warp_stage { general_stage } else { warps * warp_stage };
    4 * (BACKWARD_ROWS * (MAX_RANK + 1) + warps * (2 * MAX_RANK + 3)) + stage
};

// Within the 48 KiB a launch gets without opting in.
const _: () = assert!(BACKWARD_SHARED_BYTES <= 48 * 1024);

/// `fused_gate_apply`'s blocks (FG_APPLY_* in fused_gate.cu): threads per block, output
/// columns per block (a pair per thread; APPLY_SWIGLU's a column of each of two projections
/// per thread) and rows per block of its row loop.
const APPLY_THREADS: usize = 256;
const APPLY_TILE: usize = 2 * APPLY_THREADS;
const APPLY_ROWS: usize = 32;

/// The gate kernels' leading arguments, in their order: `zu`, the group's lists
/// ([`group_lists`]), φ and its exponent, the rows and `zu`'s row width.
fn apply_args(zu: &Values, groups: &[GateGroup], layout: &Layout) -> Vec<Arg> {
    let (phi, phi_p) = unary_code(groups[0].params.phi);
    let [params, places] = group_lists(groups, layout);
    vec![zu.arg_at(0), params, places, int(phi), Arg::F32(phi_p), size(layout.rows), size(layout.zu_width)]
}

/// `fused_gate_apply`'s launch: (row blocks, column tiles of `columns` of the widest
/// projection, projections); a block of a narrower projection past its columns returns at
/// once.
fn apply_blocks(layout: &Layout, groups: &[GateGroup], columns: usize) -> Result<cudarc::driver::LaunchConfig> {
    let widest = groups.iter().map(|g| g.dims.d_out).max().unwrap_or(0);
    let tiles = widest.div_ceil(columns);
    ensure(tiles <= u16::MAX as usize, "fused_gate_apply", || {
        format!("d_out {widest}: more than {} columns per projection", u16::MAX as usize * columns)
    })?;
    Ok(cudarc::driver::LaunchConfig {
        grid_dim: (layout.rows.div_ceil(APPLY_ROWS).min(MAX_ROW_BLOCKS) as u32, tiles as u32, groups.len() as u32),
        block_dim: (APPLY_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Checks the parameters against `dims` (as the CPU's `check_lengths`) and the rank limit.
fn check_params(dev: &CudaDevice, op: &'static str, dims: &FusedGateDims, p: &DeviceFusedGateParams) -> Result<()> {
    let FusedGateDims { d_in, d_out, rank_channel: rc, rank_scalar: rs, .. } = *dims;
    ensure(rc + rs <= MAX_RANK, op, || format!("r_c + r_s = {} exceeds {MAX_RANK}", rc + rs))?;
    let (c, s) = (&p.channel, &p.scalar);
    let expected = [
        (p.weight, d_out * d_in, "W"),
        (c.a_weight, rc * d_in, "channel A"),
        (c.a_bias, rc, "channel a"),
        (c.b_weight, d_out * rc, "channel B"),
        (c.b_bias, d_out, "channel b"),
        (s.a_weight, rs * d_in, "scalar A"),
        (s.a_bias, rs, "scalar a"),
        (s.b_weight, rs, "scalar B"),
        (s.b_bias, 1, "scalar b"),
        (c.alpha, 1, "channel α"),
        (s.alpha, 1, "scalar α"),
    ];
    for (buffer, want, name) in expected {
        dev.check_owner(op, buffer)?;
        ensure_len(op, name, buffer.len(), want)?;
    }
    Ok(())
}

/// The gate's parameter arguments shared by the kernels, in their order:
/// `a_c, B_c, b_c, α_c, a_s, B_s, b_s, α_s, φ, φ's exponent`.
fn gate_args(p: &DeviceFusedGateParams) -> [Arg; 10] {
    let (phi, phi_p) = unary_code(p.phi);
    [
        ptr(p.channel.a_bias),
        ptr(p.channel.b_weight),
        ptr(p.channel.b_bias),
        ptr(p.channel.alpha),
        ptr(p.scalar.a_bias),
        ptr(p.scalar.b_weight),
        ptr(p.scalar.b_bias),
        ptr(p.scalar.alpha),
        int(phi),
        Arg::F32(phi_p),
    ]
}

/// The concatenated weight of a group, each projection's `[W; A_c; A_s]` in turn, as one
/// bf16 `[K, d_in]` buffer (row-major), the operand of [`fused_gate_forward`] (a group of one)
/// and [`fused_gate_forward_unfused`] and of [`fused_gate_backward`]'s bf16 products, in one
/// launch. Rounds to nearest even, as the optimizer's update does when it rewrites the rows.
pub fn pack_weight(dev: &CudaDevice, groups: &[GateGroup]) -> Result<DeviceBuffer<bf16>> {
    layout(dev, "fused_gate pack_weight", groups)?;
    let parts: Vec<&DeviceBuffer<f32>> =
        groups.iter().flat_map(|g| [g.params.weight, g.params.channel.a_weight, g.params.scalar.a_weight]).collect();
    pack_bf16(dev, &parts)
}

/// Checks `x` (bf16), the packed weight and the outputs of a forward.
#[allow(clippy::too_many_arguments)]
fn check_forward(
    dev: &CudaDevice,
    op: &'static str,
    dims: &FusedGateDims,
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    p: &DeviceFusedGateParams,
    zu: Option<&DeviceBuffer<bf16>>,
    out: &Values,
) -> Result<()> {
    check_params(dev, op, dims, p)?;
    dev.check_owner(op, x)?;
    dev.check_owner(op, packed)?;
    out.check_owner(dev, op)?;
    ensure_len(op, "x", x.len(), dims.rows * dims.d_in)?;
    ensure_len(op, "packed weight", packed.len(), dims.width() * dims.d_in)?;
    ensure_len(op, "out", out.len(), dims.rows * dims.d_out)?;
    if let Some(zu) = zu {
        dev.check_owner(op, zu)?;
        ensure_len(op, "zu", zu.len(), dims.rows * dims.width())?;
    }
    Ok(())
}

/// The fused forward: `out[N×d_out] = Ẑ` (f32, or bf16 for a consumer that reads bf16) from
/// one tensor-core GEMM whose epilogue computes the gate; `zu[N×K] = x·[W; A_c; A_s]ᵀ`
/// (rounded to bf16) is written only when given (save it for backward).
/// `x` is bf16 `[N, d_in]`, `packed` is [`pack_weight`]'s output. Needs compute capability 8.0+.
pub fn fused_gate_forward(
    dev: &CudaDevice,
    dims: &FusedGateDims,
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    p: &DeviceFusedGateParams,
    zu: Option<&mut DeviceBuffer<bf16>>,
    out: ValuesMut,
) -> Result<()> {
    const OP: &str = "fused_gate_forward";
    let out = out.as_values();
    check_forward(dev, OP, dims, x, packed, p, zu.as_deref(), &out)?;
    let (major, minor) = dev.compute_capability();
    if major < 8 {
        return Err(CudaError::Invalid {
            op: OP,
            message: format!("bf16 tensor cores need compute capability 8.0, the device has {major}.{minor}"),
        });
    }
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    if rows == 0 || d_out == 0 {
        return Ok(());
    }
    let blocks_m = rows.div_ceil(BLOCK_M);
    ensure(blocks_m <= 65_535, OP, || format!("{rows} rows exceed the grid limit of {}", 65_535 * BLOCK_M))?;
    let (padded_rank, f32_out, bf16_out) = match rc + rs {
        0..=16 => (16, "fused_gate_mma_r16", "fused_gate_mma_bf16_out_r16"),
        17..=32 => (32, "fused_gate_mma_r32", "fused_gate_mma_bf16_out_r32"),
        _ => (64, "fused_gate_mma_r64", "fused_gate_mma_bf16_out_r64"),
    };
    let kernel = out.kernel(f32_out, bf16_out);
    let zu_arg = Arg::Ptr(zu.as_deref().map_or(0, DeviceBuffer::device_ptr));
    let mut args = vec![ptr(x), ptr(packed)];
    args.extend(gate_args(p));
    args.extend([size(rows), size(d_in), size(d_out), int(rc as i32), int(rs as i32), zu_arg, out.arg_at(0)]);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (d_out.div_ceil(BLOCK_N) as u32, blocks_m as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: mma_shared_bytes(padded_rank) as u32,
    };
    dev.launch(FAMILY, kernel, cfg, &args)
}

/// The gate alone from a saved `zu` (`[N, K]` in [`pack_weight`]'s column order): every
/// projection's `Ẑ_g = γ_g ⊙ Z_g`, side by side in `out` (`[N, Σ d_out]`), in one launch
/// (the second half of the unfused path). `out` is f32, or bf16 (for a consumer that reads
/// bf16) from a bf16 `zu`.
pub fn fused_gate_apply(dev: &CudaDevice, groups: &[GateGroup], zu: &DeviceValues, out: ValuesMut) -> Result<()> {
    apply(dev, groups, &layout(dev, "fused_gate_apply", groups)?, zu, out)
}

/// [`fused_gate_apply`] of a group already laid out.
fn apply(dev: &CudaDevice, groups: &[GateGroup], layout: &Layout, zu: &DeviceValues, out: ValuesMut) -> Result<()> {
    const OP: &str = "fused_gate_apply";
    let (zu, written) = (zu.values(), out.as_values());
    zu.check_owner(dev, OP)?;
    written.check_owner(dev, OP)?;
    ensure_len(OP, "zu", zu.len(), layout.rows * layout.zu_width)?;
    ensure_len(OP, "out", written.len(), layout.rows * layout.out_width)?;
    let kernel = match (zu.is_bf16(), written.is_bf16()) {
        (false, false) => "fused_gate_apply",
        (true, false) => "fused_gate_apply_bf16",
        (true, true) => "fused_gate_apply_bf16_out",
        (false, true) => {
            return Err(CudaError::Invalid {
                op: OP,
                message: "a bf16 output needs a bf16 zu (bf16 products)".to_string(),
            })
        }
    };
    let mut args = apply_args(&zu, groups, layout);
    args.extend([size(layout.out_width), int(layout.rank_channel as i32), int(layout.rank_scalar as i32)]);
    args.push(written.arg_at(0));
    dev.launch(FAMILY, kernel, apply_blocks(layout, groups, APPLY_TILE)?, &args)
}

/// The engine's forward: a cuBLAS bf16 GEMM `zu = x·packedᵀ` (`[N, K]`, f32 accumulation,
/// written in `zu`'s type), then [`fused_gate_apply`] into `out` (`[N, Σ d_out]`, f32 or
/// bf16 as [`fused_gate_apply`] takes it), for a whole
/// group in two launches. For a group of one, the inputs and outputs of
/// [`fused_gate_forward`] with `zu` given (which gates the f32 sums and saves them in bf16).
pub fn fused_gate_forward_unfused(
    dev: &CudaDevice,
    groups: &[GateGroup],
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    zu: &mut DeviceValues,
    out: ValuesMut,
) -> Result<()> {
    const OP: &str = "fused_gate_forward_unfused";
    let layout = layout(dev, OP, groups)?;
    zu_product(dev, OP, &layout, x, packed, zu)?;
    apply(dev, groups, &layout, zu, out)
}

/// Where [`fused_gate_forward_rotary_qkv`] writes attention's q, k and v, and RoPE's tables.
#[derive(Debug)]
pub struct RotaryQkv<'a> {
    /// Tokens per sequence: row n of the group is token `n % seq` of its sequence.
    pub seq: usize,
    /// The head dimension D (even): each projection's `d_out` is a whole number of heads.
    pub head_dim: usize,
    /// RoPE's cosines and sines, `[positions, D/2]` (at least `seq` positions): `rope_table`.
    pub cos: &'a DeviceBuffer<f32>,
    /// The sines.
    pub sin: &'a DeviceBuffer<f32>,
    /// q, k and v, each a dense bf16 `[N, d_out]`: `[B, T, H, D]`, written.
    pub outs: [&'a mut DeviceBuffer<bf16>; 3],
}

/// The engine's forward of attention's gated q, k and v, a group of three projections of one
/// `d_out` each under bf16 products: the GEMM of [`fused_gate_forward_unfused`] into the bf16
/// `zu`, then one launch that gates the three and writes them as attention's tensor-core
/// kernels read them, each a dense bf16 `[B, T, H, D]`, q and k rotated by RoPE (token t of a
/// sequence at table row t): what `rope::rope_qkv_forward` makes of the packed gated output,
/// without that launch, and with each value rounded once (the packed output is rounded to bf16
/// before RoPE widens and rotates it, and again after).
pub fn fused_gate_forward_rotary_qkv(
    dev: &CudaDevice,
    groups: &[GateGroup],
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    zu: &mut DeviceValues,
    rope: RotaryQkv,
) -> Result<()> {
    const OP: &str = "fused_gate_forward_rotary_qkv";
    let layout = layout(dev, OP, groups)?;
    let RotaryQkv { seq, head_dim, cos, sin, outs } = rope;
    let d_out = epilogue_group(OP, groups, &["q", "k", "v"], zu)?;
    ensure(head_dim > 0 && head_dim.is_multiple_of(2) && d_out.is_multiple_of(head_dim), OP, || {
        format!("width {d_out} is not a whole number of heads of an even dimension {head_dim}")
    })?;
    ensure(seq > 0 && layout.rows.is_multiple_of(seq), OP, || {
        format!("{} rows are not sequences of {seq}", layout.rows)
    })?;
    let table_len = seq * head_dim / 2;
    ensure(cos.len() >= table_len && sin.len() >= table_len, OP, || {
        format!("RoPE's tables hold {} and {} values, {seq} positions need {table_len}", cos.len(), sin.len())
    })?;
    // The kernel indexes the tables in 32 bits.
    ensure(table_len <= i32::MAX as usize, OP, || format!("{seq} positions of {head_dim} dims: too long a table"))?;
    dev.check_owner(OP, cos)?;
    dev.check_owner(OP, sin)?;
    for out in &outs {
        dev.check_owner(OP, &**out)?;
        ensure_len(OP, "q, k or v", out.len(), layout.rows * d_out)?;
    }
    zu_product(dev, OP, &layout, x, packed, zu)?;
    let mut args = apply_args(&zu.values(), groups, &layout);
    args.extend([int(layout.rank_channel as i32), int(layout.rank_scalar as i32)]);
    args.extend([address_list(outs.iter().map(|out| out.device_ptr())), ptr(cos), ptr(sin), size(seq), size(head_dim)]);
    dev.launch(FAMILY, "fused_gate_apply_rotary_qkv", apply_blocks(&layout, groups, APPLY_TILE)?, &args)
}

/// The engine's forward of the FFN's gated gate and up projections (a group of two of one
/// `d_out`) under bf16 products: the GEMM of [`fused_gate_forward_unfused`] into the bf16
/// `zu`, then one launch that gates both, writes them side by side into `gated` (`[N, 2·d_out]`,
/// bf16: SwiGLU's backward reads them) and writes SwiGLU of them into `out` (`[N, d_out]`,
/// bf16): the bits of [`fused_gate_forward_unfused`] into bf16 then `swiglu::swiglu_halves_forward`
/// into bf16, without the second launch and its read of `gated`.
pub fn fused_gate_forward_swiglu(
    dev: &CudaDevice,
    groups: &[GateGroup],
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    zu: &mut DeviceValues,
    gated: &mut DeviceBuffer<bf16>,
    out: &mut DeviceBuffer<bf16>,
) -> Result<()> {
    const OP: &str = "fused_gate_forward_swiglu";
    let layout = layout(dev, OP, groups)?;
    let d_out = epilogue_group(OP, groups, &["gate", "up"], zu)?;
    dev.check_owner(OP, gated)?;
    dev.check_owner(OP, out)?;
    ensure_len(OP, "gated", gated.len(), layout.rows * layout.out_width)?;
    ensure_len(OP, "out", out.len(), layout.rows * d_out)?;
    zu_product(dev, OP, &layout, x, packed, zu)?;
    let mut args = apply_args(&zu.values(), groups, &layout);
    args.extend([size(layout.out_width), int(layout.rank_channel as i32), int(layout.rank_scalar as i32)]);
    args.extend([ptr(gated), ptr(out)]);
    // A block serves APPLY_THREADS columns of both projections: one group of blocks.
    dev.launch(FAMILY, "fused_gate_apply_swiglu", apply_blocks(&layout, &groups[..1], APPLY_THREADS)?, &args)
}

/// The residual stream's add and RMSNorm that read a gated projection's output
/// ([`fused_gate_forward_add_rms_norm`]): `sum = x + Ẑ`, `y = sum / √(mean(sum²) + eps) · weight`
/// per row of `d_out`, as `norm::add_rms_norm_forward` writes them.
#[derive(Debug)]
pub struct ResidualNorm<'a> {
    /// The residual stream before the add, `[N, d_out]`.
    pub x: &'a DeviceBuffer<f32>,
    /// RMSNorm's weight, `[d_out]`.
    pub weight: &'a DeviceBuffer<f32>,
    /// Added to the mean square under the square root.
    pub eps: f32,
    /// `x + Ẑ`, `[N, d_out]`, written.
    pub sum: &'a mut DeviceBuffer<f32>,
    /// The normalised sum, `[N, d_out]`: f32, or bf16 alone (the next products' operand),
    /// written.
    pub y: ValuesMut<'a>,
    /// Each row's `1/√(mean(sum²) + eps)`, `[N]`, written (the backward reads it).
    pub rstd: &'a mut DeviceBuffer<f32>,
}

/// The engine's forward of a gated output projection (Transponder's o and down: a group of
/// one) whose output only the residual stream's add and the next RMSNorm read, under bf16
/// products: the GEMM of [`fused_gate_forward_unfused`] into the bf16 `zu`, then one launch
/// that gates each row and adds it to the stream and normalises the sum (`norm`): the bits of
/// [`fused_gate_forward_unfused`] into bf16 then `norm::add_rms_norm_forward` of its output,
/// without that launch, and without storing `Ẑ` or reading it back.
pub fn fused_gate_forward_add_rms_norm(
    dev: &CudaDevice,
    groups: &[GateGroup],
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    zu: &mut DeviceValues,
    norm: ResidualNorm,
) -> Result<()> {
    const OP: &str = "fused_gate_forward_add_rms_norm";
    let layout = layout(dev, OP, groups)?;
    let d_out = epilogue_group(OP, groups, &["the output projection"], zu)?;
    let ResidualNorm { x: stream, weight, eps, sum, y, rstd } = norm;
    let y = y.as_values();
    // norm::add_rms_norm_forward's checks of the same operands.
    check_owners(dev, OP, &[stream, weight, sum, rstd])?;
    let [y_f32, y_bf16] = output_with_twin(dev, OP, y, None)?;
    let dims = NormDims { rows: layout.rows, cols: d_out, eps };
    let row_operands = [("x", stream.len()), ("sum", sum.len()), ("y", y.len())];
    let params = [("weight", Some(weight.len()))];
    dims.check(&row_operands, &[("rstd", rstd.len())], &params).map_err(|message| CudaError::shape(OP, message))?;
    zu_product(dev, OP, &layout, x, packed, zu)?;
    let mut args = apply_args(&zu.values(), groups, &layout);
    args.extend([int(layout.rank_channel as i32), int(layout.rank_scalar as i32)]);
    args.extend([ptr(stream), ptr(weight), ptr(sum), y_f32, y_bf16, ptr(rstd), Arg::F32(eps)]);
    dev.launch(FAMILY, "fused_gate_add_rms_norm", rms_norm_rows(layout.rows), &args)
}

/// Checks the group of an epilogue that serves exactly the projections `names` (q, k and v;
/// gate and up), of one width, from a bf16 `zu` (bf16 products); returns that width.
fn epilogue_group(op: &'static str, groups: &[GateGroup], names: &[&str], zu: &DeviceValues) -> Result<usize> {
    ensure(groups.len() == names.len(), op, || format!("{} projections, not {}", groups.len(), names.join(", ")))?;
    let d_out = groups[0].dims.d_out;
    ensure(groups.iter().all(|g| g.dims.d_out == d_out), op, || format!("{} differ in width", names.join(", ")))?;
    ensure(zu.values().is_bf16(), op, || "the epilogue reads a bf16 zu (bf16 products)".to_string())?;
    Ok(d_out)
}

/// The group's GEMM `zu = x·packedᵀ` (`[N, K]`, f32 accumulation, written in `zu`'s type),
/// checked against the group's `layout`.
fn zu_product(
    dev: &CudaDevice,
    op: &'static str,
    layout: &Layout,
    x: &DeviceBuffer<bf16>,
    packed: &DeviceBuffer<bf16>,
    zu: &mut DeviceValues,
) -> Result<()> {
    for buffer in [x, packed] {
        dev.check_owner(op, buffer)?;
    }
    zu.values().check_owner(dev, op)?;
    let (k, d_in) = (layout.zu_width, layout.d_in);
    ensure_len(op, "x", x.len(), layout.rows * d_in)?;
    ensure_len(op, "packed weight", packed.len(), k * d_in)?;
    ensure_len(op, "zu", zu.len(), layout.rows * k)?;
    let (a, b) = (Operand::rows(x.device_ptr(), d_in), Operand::transposed(packed.device_ptr(), d_in));
    let product = GemmDims { m: layout.rows, n: k, k: d_in };
    let precision = match zu {
        DeviceValues::F32(_) => Precision::Bf16,
        DeviceValues::Bf16(_) => Precision::Bf16Out,
    };
    gemm(dev, precision, product, a, b, Store::Overwrite, (zu.values().address(), k))
}
