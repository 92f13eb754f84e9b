//! Fused gated projection, Transponder eq. 8-10 (the `layer-channel-scalar` projection):
//!
//! ```text
//! [Z | U_c | U_s] = x · [W | A_cᵀ | A_sᵀ]                         (eq. 8, ONE GEMM)
//! γ_c = σ̃_αc(φ(U_c + a_c)·B_cᵀ + b_c),  γ_s = σ̃_αs(φ(U_s + a_s)·B_sᵀ + b_s)   (eq. 9)
//! Ẑ   = γ_c ⊙ γ_s ⊙ Z                                             (eq. 10)
//! ```
//! with `σ̃_α(z) = 2·σ(α·z)`. Legend: `N` rows (B·T tokens), `d_in`, `d_out`, ranks `r_c`
//! (channel modulator, `B_c: d_out × r_c`) and `r_s` (scalar modulator, `B_s: 1 × r_s`);
//! `K = d_out + r_c + r_s` is the width of the concatenated GEMM output `ZU`.
//!
//! Weights are stored as PyTorch stores them: `W: [d_out, d_in]`, `A: [r, d_in]`, so the
//! concatenated operand is the row stack `[W; A_c; A_s]` read transposed through strides.
//!
//! On the CPU the GEMM output `ZU` is one buffer, kept with the rank-r path's small
//! results for the backward ([`FusedGateSaved`]). The rank-r products (`H_c·B_cᵀ` and, in
//! the backward, `dL_c·B_c` and `dL_cᵀ·H_c`) run as register-tiled products per block of
//! rows inside one parallel SIMD pass that also computes and applies the gate, never
//! materialising γ or an `N × d_out` logit buffer. PyTorch equivalent of the whole
//! op: `(x @ W.T) * 2*sigmoid(αc*(phi(x @ Ac.T + ac) @ Bc.T + bc)) * 2*sigmoid(αs*(...))`.
//!
//! The backward writes its gradient buffers (`dx = ...`; the crate's contract, see `lib.rs`).

use rayon::prelude::*;

use super::gate_rows::{gate_row_backward, gate_row_forward};
use super::matmul::{matmul, matmul_serial, GemmDims, MatRef, Store};
use super::scratch::with_scratch;
use super::simd::LANES;
use super::tile_gemm::{tile_gemm, TileA, TileB};
use super::unary::{unary_backward, unary_forward, unary_reference, Unary};

/// Sizes of one fused projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedGateDims {
    /// `N`: rows (tokens).
    pub rows: usize,
    /// Input width.
    pub d_in: usize,
    /// Output width of the projection.
    pub d_out: usize,
    /// `r_c`: rank of the channel modulator.
    pub rank_channel: usize,
    /// `r_s`: rank of the scalar modulator.
    pub rank_scalar: usize,
}

impl FusedGateDims {
    /// `K = d_out + r_c + r_s`: the width of the concatenated GEMM output `ZU`.
    pub fn width(&self) -> usize {
        self.d_out + self.rank_channel + self.rank_scalar
    }
}

/// One modulator `σ̃_α(B·φ(A·x + a) + b)`: `A: [r, d_in]`, `a: [r]`, `B: [m, r]`, `b: [m]`
/// with `m = d_out` (channel) or 1 (scalar).
#[derive(Clone, Copy, Debug)]
pub struct GateParams<'a> {
    /// `A: [r, d_in]`.
    pub a_weight: &'a [f32],
    /// `a: [r]`.
    pub a_bias: &'a [f32],
    /// `B: [m, r]`.
    pub b_weight: &'a [f32],
    /// `b: [m]`.
    pub b_bias: &'a [f32],
    /// The curvature α of `σ̃_α`.
    pub alpha: f32,
}

/// Everything the fused projection reads besides `x`.
#[derive(Clone, Copy, Debug)]
pub struct FusedGateParams<'a> {
    /// `W: [d_out, d_in]`.
    pub weight: &'a [f32],
    /// The channel modulator (`m = d_out`).
    pub channel: GateParams<'a>,
    /// The scalar modulator (`m = 1`).
    pub scalar: GateParams<'a>,
    /// `φ`, the modulators' pointwise nonlinearity (sigmoid, SiLU or ReLU in practice).
    pub phi: Unary,
}

/// Gradient buffers of one modulator, written by the backward.
#[derive(Debug)]
pub struct GateGrads<'a> {
    /// `dA: [r, d_in]`.
    pub a_weight: &'a mut [f32],
    /// `da: [r]`.
    pub a_bias: &'a mut [f32],
    /// `dB: [m, r]`.
    pub b_weight: &'a mut [f32],
    /// `db: [m]`.
    pub b_bias: &'a mut [f32],
    /// `dα`.
    pub alpha: &'a mut f32,
}

/// Gradient buffers of the fused projection, written by the backward.
#[derive(Debug)]
pub struct FusedGateGrads<'a> {
    /// `dx: [N, d_in]`.
    pub x: &'a mut [f32],
    /// `dW: [d_out, d_in]`.
    pub weight: &'a mut [f32],
    /// The channel modulator's gradients.
    pub channel: GateGrads<'a>,
    /// The scalar modulator's gradients.
    pub scalar: GateGrads<'a>,
}

/// `σ̃_α(z) = 2σ(αz)`, evaluated through `e^-|αz|` so it never overflows.
fn calibrated_sigmoid(alpha: f32, z: f32) -> f32 {
    2.0 * unary_reference(Unary::Sigmoid, alpha * z)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The row stack `[W; A_c; A_s]` (`K × d_in`), whose transpose is eq. 8's `C`.
fn concatenated_weight(p: &FusedGateParams) -> Vec<f32> {
    [p.weight, p.channel.a_weight, p.scalar.a_weight].concat()
}

fn check_lengths(dims: &FusedGateDims, x: &[f32], p: &FusedGateParams) {
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    assert!(d_in > 0 && d_out > 0, "fused_gate: d_in and d_out must be positive");
    assert_eq!(x.len(), rows * d_in, "fused_gate: x is not N × d_in");
    assert_eq!(p.weight.len(), d_out * d_in, "fused_gate: W is not d_out × d_in");
    assert!(p.channel.a_weight.len() == rc * d_in && p.channel.a_bias.len() == rc, "fused_gate: channel A, a");
    assert!(p.channel.b_weight.len() == d_out * rc && p.channel.b_bias.len() == d_out, "fused_gate: channel B, b");
    assert!(p.scalar.a_weight.len() == rs * d_in && p.scalar.a_bias.len() == rs, "fused_gate: scalar A, a");
    assert!(p.scalar.b_weight.len() == rs && p.scalar.b_bias.len() == 1, "fused_gate: scalar B, b");
}

/// A row-major `rows × cols` operand at `offset` of a buffer with row stride `stride`.
fn rows_of(data: &[f32], offset: usize, stride: usize) -> MatRef<'_> {
    MatRef { data, offset, row_stride: stride as isize, col_stride: 1 }
}

/// The transpose of [`rows_of`].
fn columns_of(data: &[f32], offset: usize, stride: usize) -> MatRef<'_> {
    MatRef { data, offset, row_stride: 1, col_stride: stride as isize }
}

/// What the forward keeps for the backward besides `x`, the parameters and the GEMM output
/// `ZU` (`N × K`, in a buffer the caller owns): `H = φ(U + a)` (`N × (r_c + r_s)`) and the
/// scalar gate `γ_s` and its logit per row. With `ZU` that is `N·(K + r + 2)` floats; the
/// channel logits `H_c·B_cᵀ + b_c` are recomputed in the backward's row pass (r_c
/// multiply-adds per element, cheaper than writing and reading an `N × d_out` buffer).
#[derive(Debug)]
pub struct FusedGateSaved {
    hidden: Vec<f32>,
    gate_scalar: Vec<f32>,
    logit_scalar: Vec<f32>,
}

/// Rows per task. Each task multiplies its own rows on its thread (`x·C` in the forward,
/// `dZU·[W; A_c; A_s]` in the backward) and runs the gate pass on the result while it is
/// still in cache (a 256 × 144 block of `ZU` is 144 KiB). `gemm` packs the weights once per
/// call, so blocks must be large enough for that to be cheap next to the product (measured
/// at llama-tiny shapes on two threads: 256 rows ≈ 10 % faster than 64, whose packing took
/// 12 % of the forward), and small enough to balance threads (16 blocks at 4096 rows).
const BLOCK_ROWS: usize = 256;

/// The channel modulator's second stage, `σ̃_αc(h_c·B_cᵀ + b_c)`, laid out for tile products
/// over `d_pad` columns, the next multiple of [`LANES`] above `d_out`: `B_c` transposed to
/// `[r_c, d_pad]` and padded to `[d_pad, r_c]`, `b_c` to `[d_pad]`, with zeros past `d_out`.
/// Padded lanes see zero inputs and produce zero gradients, so rows run in whole vectors.
struct ChannelGate {
    b_t: Vec<f32>,
    b_padded: Vec<f32>,
    bias: Vec<f32>,
    rank: usize,
    d_pad: usize,
    alpha: f32,
}

impl ChannelGate {
    fn new(g: &GateParams, d_out: usize) -> Self {
        let rank = g.a_bias.len();
        let d_pad = d_out.next_multiple_of(LANES);
        let mut b_padded = g.b_weight.to_vec();
        b_padded.resize(d_pad * rank, 0.0);
        let mut b_t = vec![0.0; rank * d_pad];
        for (j, b_row) in g.b_weight.chunks_exact(rank.max(1)).take(d_out).enumerate() {
            for (t, &b) in b_row.iter().enumerate() {
                b_t[t * d_pad + j] = b;
            }
        }
        let mut bias = vec![0.0; d_pad];
        bias[..d_out].copy_from_slice(g.b_bias);
        Self { b_t, b_padded, bias, rank, d_pad, alpha: g.alpha }
    }

    /// Writes `H_c·B_cᵀ` (without the bias) for the rows of `H` (row stride `r`) from row
    /// `first` into `logits`, a `rows × d_pad` block.
    fn logits(&self, hidden: &[f32], first: usize, r: usize, logits: &mut [f32]) {
        let rows = logits.len() / self.d_pad;
        let h_c = TileA { data: hidden, offset: first * r, row_stride: r, col_stride: 1 };
        let b_t = TileB { data: &self.b_t, offset: 0, row_stride: self.d_pad };
        tile_gemm(
            logits,
            self.d_pad,
            h_c,
            b_t,
            GemmDims { m: rows, n: self.d_pad, k: self.rank },
            1.0,
            Store::Overwrite,
        );
    }
}

/// `U + a` for the rows of `zu` (row stride `k`, `U` from column `d_out`): the modulators'
/// hidden pre-activations, `rows × r`.
fn hidden_inputs(p: &FusedGateParams, zu: &[f32], k: usize, d_out: usize) -> Vec<f32> {
    let biases = [p.channel.a_bias, p.scalar.a_bias].concat();
    let mut pre = Vec::with_capacity(zu.len() / k * biases.len());
    for row in zu.chunks_exact(k) {
        pre.extend(row[d_out..].iter().zip(&biases).map(|(&u, &a)| u + a));
    }
    pre
}

/// Forward: writes the GEMM output `zu[N×K] = x·C` (kept by the caller for the backward)
/// and `out[N×d_out] = Ẑ`, and returns the rest of what the backward needs. The initial
/// contents of `zu` and `out` do not matter.
///
/// Runs as independent blocks of [`BLOCK_ROWS`] rows ([`forward_block`]), so `ZU` is
/// written once and gated while in cache instead of being read back from memory.
pub fn fused_gate_forward(
    dims: &FusedGateDims,
    x: &[f32],
    p: &FusedGateParams,
    zu: &mut [f32],
    out: &mut [f32],
) -> FusedGateSaved {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, .. } = *dims;
    assert_eq!(out.len(), rows * d_out, "fused_gate_forward: out is not N × d_out");
    let k = dims.width();
    assert_eq!(zu.len(), rows * k, "fused_gate_forward: zu is not N × K");
    let c = concatenated_weight(p);
    let gate = ChannelGate::new(&p.channel, d_out);
    let blocks: Vec<ForwardBlock> = zu
        .par_chunks_mut(BLOCK_ROWS * k)
        .zip(out.par_chunks_mut(BLOCK_ROWS * d_out))
        .enumerate()
        .map(|(b, (zu_rows, out_rows))| {
            let x_rows = rows_of(x, b * BLOCK_ROWS * d_in, d_in);
            forward_block(dims, p, &gate, &c, x_rows, zu_rows, out_rows)
        })
        .collect();
    saved_of(blocks)
}

/// The gate pass alone from a given `zu[N×K]` (Z and U in [`fused_gate_forward`]'s layout):
/// writes `out[N×d_out] = Ẑ` and returns what the backward needs, as [`fused_gate_forward`]
/// does after its product. The CPU twin of the GPU's gate launch, which reads the product
/// saved in bf16: a reference that gates the same rounded `ZU`.
pub fn fused_gate_from_zu(dims: &FusedGateDims, p: &FusedGateParams, zu: &[f32], out: &mut [f32]) -> FusedGateSaved {
    let FusedGateDims { rows, d_out, .. } = *dims;
    let k = dims.width();
    assert_eq!(out.len(), rows * d_out, "fused_gate_from_zu: out is not N × d_out");
    assert_eq!(zu.len(), rows * k, "fused_gate_from_zu: zu is not N × K");
    let gate = ChannelGate::new(&p.channel, d_out);
    let blocks: Vec<ForwardBlock> = zu
        .par_chunks(BLOCK_ROWS * k)
        .zip(out.par_chunks_mut(BLOCK_ROWS * d_out))
        .map(|(zu_rows, out_rows)| gate_block(dims, p, &gate, zu_rows, out_rows))
        .collect();
    saved_of(blocks)
}

/// The blocks' shares of [`FusedGateSaved`], in row order.
fn saved_of(blocks: Vec<ForwardBlock>) -> FusedGateSaved {
    let (mut hidden, mut gate_scalar, mut logit_scalar) = (Vec::new(), Vec::new(), Vec::new());
    for block in blocks {
        hidden.extend(block.hidden);
        gate_scalar.extend(block.gate_scalar);
        logit_scalar.extend(block.logit_scalar);
    }
    FusedGateSaved { hidden, gate_scalar, logit_scalar }
}

/// One block's share of [`FusedGateSaved`]: its rows of `H`, `γ_s` and the scalar logit.
struct ForwardBlock {
    hidden: Vec<f32>,
    gate_scalar: Vec<f32>,
    logit_scalar: Vec<f32>,
}

/// The forward for the rows of `out` (starting at `x_rows`): `ZU = x·C` on this thread, then
/// the gate ([`gate_block`]).
fn forward_block(
    dims: &FusedGateDims,
    p: &FusedGateParams,
    gate: &ChannelGate,
    c: &[f32],
    x_rows: MatRef,
    zu: &mut [f32],
    out: &mut [f32],
) -> ForwardBlock {
    let (d_in, k) = (dims.d_in, dims.width());
    let rows = out.len() / dims.d_out;
    matmul_serial(zu, 0, x_rows, columns_of(c, 0, d_in), GemmDims { m: rows, n: k, k: d_in }, Store::Overwrite);
    gate_block(dims, p, gate, zu, out)
}

/// The gate for the rows of `out` from their `zu`: `H = φ(U + a)`, the scalar gate per row,
/// and `Ẑ = γ_c ⊙ γ_s ⊙ Z` into `out`.
fn gate_block(
    dims: &FusedGateDims,
    p: &FusedGateParams,
    gate: &ChannelGate,
    zu: &[f32],
    out: &mut [f32],
) -> ForwardBlock {
    let FusedGateDims { d_out, rank_channel: rc, .. } = *dims;
    let (k, r) = (dims.width(), rc + dims.rank_scalar);
    let rows = out.len() / d_out;
    let mut hidden = vec![0.0; rows * r];
    unary_forward(p.phi, &hidden_inputs(p, zu, k, d_out), &mut hidden);
    let logit_scalar: Vec<f32> =
        (0..rows).map(|i| dot(p.scalar.b_weight, &hidden[i * r + rc..(i + 1) * r]) + p.scalar.b_bias[0]).collect();
    let gate_scalar: Vec<f32> = logit_scalar.iter().map(|&l| calibrated_sigmoid(p.scalar.alpha, l)).collect();
    with_scratch(rows * gate.d_pad, |logits| {
        gate.logits(&hidden, 0, r, logits);
        for (i, (y, l)) in out.chunks_exact_mut(d_out).zip(logits.chunks_exact(gate.d_pad)).enumerate() {
            gate_row_forward(l, &gate.bias, gate.alpha, 2.0 * gate_scalar[i], &zu[i * k..i * k + d_out], y);
        }
    });
    ForwardBlock { hidden, gate_scalar, logit_scalar }
}

/// One row block's share of the backward's sums over rows.
struct BlockSums {
    /// `dB_c` transposed, `[r_c, d_pad]`.
    db_t: Vec<f32>,
    /// `db_c`, `[d_pad]`.
    db_channel: Vec<f32>,
    /// `[da_c | da_s]`, `[r]`.
    da: Vec<f32>,
    /// `dB_s`, `[r_s]`.
    db_weight_scalar: Vec<f32>,
    db_scalar: f64,
    dalpha_channel: f64,
    dalpha_scalar: f64,
}

impl BlockSums {
    fn zeros(dims: &FusedGateDims, d_pad: usize) -> Self {
        Self {
            db_t: vec![0.0; dims.rank_channel * d_pad],
            db_channel: vec![0.0; d_pad],
            da: vec![0.0; dims.rank_channel + dims.rank_scalar],
            db_weight_scalar: vec![0.0; dims.rank_scalar],
            db_scalar: 0.0,
            dalpha_channel: 0.0,
            dalpha_scalar: 0.0,
        }
    }

    /// Writes the block sums, added in order, into the gradient buffers.
    fn write_into(blocks: &[BlockSums], dims: &FusedGateDims, d_pad: usize, grads: &mut FusedGateGrads) {
        let (d_out, rc) = (dims.d_out, dims.rank_channel);
        for sum in [
            &mut *grads.channel.b_weight,
            &mut *grads.channel.b_bias,
            &mut *grads.channel.a_bias,
            &mut *grads.scalar.a_bias,
            &mut *grads.scalar.b_weight,
        ] {
            sum.fill(0.0);
        }
        let (mut db_scalar, mut dalpha_c, mut dalpha_s) = (0.0f64, 0.0f64, 0.0f64);
        for s in blocks {
            for (j, db_row) in grads.channel.b_weight.chunks_exact_mut(rc.max(1)).take(d_out).enumerate() {
                db_row.iter_mut().enumerate().for_each(|(t, d)| *d += s.db_t[t * d_pad + j]);
            }
            add_assign(grads.channel.b_bias, &s.db_channel[..d_out]);
            add_assign(grads.channel.a_bias, &s.da[..rc]);
            add_assign(grads.scalar.a_bias, &s.da[rc..]);
            add_assign(grads.scalar.b_weight, &s.db_weight_scalar);
            db_scalar += s.db_scalar;
            dalpha_c += s.dalpha_channel;
            dalpha_s += s.dalpha_scalar;
        }
        grads.scalar.b_bias[0] = db_scalar as f32;
        *grads.channel.alpha = dalpha_c as f32;
        *grads.scalar.alpha = dalpha_s as f32;
    }
}

fn add_assign(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}

/// Everything the backward's row pass reads.
struct RowPass<'a> {
    dims: FusedGateDims,
    p: &'a FusedGateParams<'a>,
    zu: &'a [f32],
    saved: &'a FusedGateSaved,
    dout: &'a [f32],
    gate: ChannelGate,
    /// `[W; A_c; A_s]`, `K × d_in`.
    weights: Vec<f32>,
}

impl RowPass<'_> {
    /// Writes the rows `first..` of `dZU = [dZ | dU_c | dU_s]` into `dzu`, writes their
    /// `dZU·[W; A_c; A_s]` into `dx` (the same rows of the input gradient) and returns the
    /// block's share of the sums over rows.
    fn block(&self, first: usize, dzu: &mut [f32], dx: &mut [f32]) -> BlockSums {
        let rows = dzu.len() / self.dims.width();
        with_scratch(rows * self.gate.d_pad, |dl| self.block_with_logits(first, dzu, dx, dl))
    }

    /// [`RowPass::block`] with a scratch buffer for the block's channel logits (`rows × d_pad`).
    fn block_with_logits(&self, first: usize, dzu: &mut [f32], dx: &mut [f32], dl: &mut [f32]) -> BlockSums {
        let FusedGateDims { d_out, rank_channel: rc, .. } = self.dims;
        let (k, r, d_pad) = (self.dims.width(), rc + self.dims.rank_scalar, self.gate.d_pad);
        let rows = dzu.len() / k;
        let mut sums = BlockSums::zeros(&self.dims, d_pad);
        // The channel logits, overwritten row by row with their gradient dL_c.
        self.gate.logits(&self.saved.hidden, first, r, dl);
        let mut dgate_s = vec![0.0; rows];
        for (i, (dzu_row, dl_row)) in dzu.chunks_exact_mut(k).zip(dl.chunks_exact_mut(d_pad)).enumerate() {
            dgate_s[i] = self.channel_row(first + i, &mut dzu_row[..d_out], dl_row, &mut sums);
        }
        // dH_c = dL_c·B_c, dB_c += dL_cᵀ·H_c (kept transposed).
        let mut dh = vec![0.0; rows * r];
        let dl_rows = TileA { data: dl, offset: 0, row_stride: d_pad, col_stride: 1 };
        let b_c = TileB { data: &self.gate.b_padded, offset: 0, row_stride: rc };
        tile_gemm(&mut dh, r, dl_rows, b_c, GemmDims { m: rows, n: rc, k: d_pad }, 1.0, Store::Overwrite);
        let h_c_t = TileA { data: &self.saved.hidden, offset: first * r, row_stride: 1, col_stride: r };
        let dl_b = TileB { data: dl, offset: 0, row_stride: d_pad };
        tile_gemm(&mut sums.db_t, d_pad, h_c_t, dl_b, GemmDims { m: rc, n: d_pad, k: rows }, 1.0, Store::Accumulate);
        for (i, &dg) in dgate_s.iter().enumerate() {
            let n = first + i;
            let h_s = &self.saved.hidden[n * r + rc..(n + 1) * r];
            self.scalar_row(n, h_s, dg, &mut dh[i * r + rc..(i + 1) * r], &mut sums);
        }
        // dU = dH ⊙ φ'(U + a), into dZU's summary columns; da = Σ dU.
        let zu = &self.zu[first * k..(first + rows) * k];
        let pre = hidden_inputs(self.p, zu, k, d_out);
        let mut du = vec![0.0; rows * r];
        unary_backward(self.p.phi, &pre, &self.saved.hidden[first * r..(first + rows) * r], &dh, &mut du);
        for (i, dzu_row) in dzu.chunks_exact_mut(k).enumerate() {
            let du_row = &du[i * r..(i + 1) * r];
            dzu_row[d_out..].copy_from_slice(du_row);
            add_assign(&mut sums.da, du_row);
        }
        let d_in = self.dims.d_in;
        matmul_serial(
            dx,
            0,
            rows_of(dzu, 0, k),
            rows_of(&self.weights, 0, d_in),
            GemmDims { m: rows, n: d_in, k },
            Store::Overwrite,
        );
        sums
    }

    /// The channel gate's backward for row `n`: writes `dZ`, turns the row's logits `dl`
    /// (without bias) into their gradient `dL_c`, adds this row's `db_c` and `dα_c` terms to
    /// `sums` and returns `dγ_s`.
    ///
    /// With `γ = 2σ(α·l)`: `d/dZ = γ_c·γ_s`, `d/dγ_c = dẐ·Z·γ_s`, `d/dγ_s = Σ_j dẐ·Z·γ_c`,
    /// `d/dl = α·γ(1 − γ/2)·d/dγ` and `d/dα = l·γ(1 − γ/2)·d/dγ`.
    fn channel_row(&self, n: usize, dz: &mut [f32], dl: &mut [f32], sums: &mut BlockSums) -> f32 {
        let d_out = self.dims.d_out;
        let (z, dy) = (&self.zu[n * self.dims.width()..][..d_out], &self.dout[n * d_out..(n + 1) * d_out]);
        let gate_s = self.saved.gate_scalar[n];
        let (dgate_s, dalpha) =
            gate_row_backward(dl, &self.gate.bias, self.gate.alpha, gate_s, dy, z, dz, &mut sums.db_channel);
        sums.dalpha_channel += dalpha as f64;
        dgate_s
    }

    /// The scalar gate's backward for row `n` from `dγ_s`: writes `dH_s = dl_s·B_s` and adds
    /// this row's `dB_s`, `db_s` and `dα_s` terms to `sums`.
    fn scalar_row(&self, n: usize, h_s: &[f32], dgate_s: f32, dh_s: &mut [f32], sums: &mut BlockSums) {
        let s = &self.p.scalar;
        let gate = self.saved.gate_scalar[n];
        // d/dl 2σ(αl) = α·γ(1 − γ/2), d/dα 2σ(αl) = l·γ(1 − γ/2)
        let slope = dgate_s * gate * (1.0 - 0.5 * gate);
        let dlogit = slope * s.alpha;
        sums.dalpha_scalar += (slope * self.saved.logit_scalar[n]) as f64;
        sums.db_scalar += dlogit as f64;
        for ((d, &b), (acc, &h)) in dh_s.iter_mut().zip(s.b_weight).zip(sums.db_weight_scalar.iter_mut().zip(h_s)) {
            *d = dlogit * b;
            *acc += dlogit * h;
        }
    }
}

/// Backward of [`fused_gate_forward`] from its `zu` and saved state and the output gradient
/// `dout`; `dzu` (`N × K`, any contents) is scratch space for `dZU`.
///
/// One parallel pass over row blocks gives `dZU = [dZ | dU_c | dU_s]`, each block's share of
/// the sums over rows (`dB`, `db`, `da`, `dα`), recomputing the channel gate from `H_c`, and
/// the block's rows of `dx = dZU·[W; A_c; A_s]`; one GEMM then gives
/// `[dW; dA_c; dA_s] = dZUᵀ·x`.
#[allow(clippy::too_many_arguments)]
pub fn fused_gate_backward(
    dims: &FusedGateDims,
    x: &[f32],
    p: &FusedGateParams,
    zu: &[f32],
    saved: &FusedGateSaved,
    dout: &[f32],
    dzu: &mut [f32],
    grads: &mut FusedGateGrads,
) {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, .. } = *dims;
    let k = dims.width();
    assert!(
        zu.len() == rows * k && dzu.len() == rows * k && dout.len() == rows * d_out,
        "fused_gate_backward: zu, dzu or dout has the wrong length"
    );
    let gate = ChannelGate::new(&p.channel, d_out);
    let pass = RowPass { dims: *dims, p, zu, saved, dout, gate, weights: concatenated_weight(p) };
    let sums: Vec<BlockSums> = dzu
        .par_chunks_mut(BLOCK_ROWS * k)
        .zip(grads.x.par_chunks_mut(BLOCK_ROWS * d_in))
        .enumerate()
        .map(|(b, (dzu_rows, dx_rows))| pass.block(b * BLOCK_ROWS, dzu_rows, dx_rows))
        .collect();
    BlockSums::write_into(&sums, dims, pass.gate.d_pad, grads);

    // The weight gradients are the row blocks of one GEMM dZUᵀ·x over all rows.
    let mut dc = vec![0.0; k * d_in];
    matmul(
        &mut dc,
        0,
        columns_of(dzu, 0, k),
        rows_of(x, 0, d_in),
        GemmDims { m: k, n: d_in, k: rows },
        Store::Overwrite,
    );
    let (dw, da) = dc.split_at(d_out * d_in);
    let (da_c, da_s) = da.split_at(rc * d_in);
    for (dst, src) in
        [(&mut *grads.weight, dw), (&mut *grads.channel.a_weight, da_c), (&mut *grads.scalar.a_weight, da_s)]
    {
        dst.copy_from_slice(src);
    }
}

/// Naive reference of the forward (no GEMM, no concatenation), for tests.
pub fn fused_gate_forward_reference(dims: &FusedGateDims, x: &[f32], p: &FusedGateParams) -> Vec<f32> {
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    let project = |w: &[f32], xr: &[f32], n: usize| -> Vec<f32> {
        (0..n).map(|o| dot(&w[o * d_in..(o + 1) * d_in], xr)).collect()
    };
    let gate = |g: &GateParams, xr: &[f32], r: usize, m: usize| -> Vec<f32> {
        let u = project(g.a_weight, xr, r);
        let h: Vec<f32> = u.iter().zip(g.a_bias).map(|(&u, &a)| unary_reference(p.phi, u + a)).collect();
        (0..m).map(|j| calibrated_sigmoid(g.alpha, dot(&g.b_weight[j * r..(j + 1) * r], &h) + g.b_bias[j])).collect()
    };
    let mut out = Vec::with_capacity(rows * d_out);
    for xr in x.chunks(d_in) {
        let z = project(p.weight, xr, d_out);
        let (gc, gs) = (gate(&p.channel, xr, rc, d_out), gate(&p.scalar, xr, rs, 1));
        out.extend(z.iter().zip(&gc).map(|(z, g)| z * g * gs[0]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 13.0).collect()
    }

    #[test]
    fn forward_matches_reference_for_every_phi() {
        let dims = FusedGateDims { rows: 300, d_in: 19, d_out: 13, rank_channel: 4, rank_scalar: 3 };
        let (d_in, d_out, rc, rs) = (dims.d_in, dims.d_out, dims.rank_channel, dims.rank_scalar);
        let x = values(dims.rows * d_in, 1);
        let w = values(d_out * d_in, 2);
        let (ac, bc, ab_c, bb_c) = (values(rc * d_in, 3), values(d_out * rc, 4), values(rc, 5), values(d_out, 6));
        let (as_, bs, ab_s, bb_s) = (values(rs * d_in, 7), values(rs, 8), values(rs, 9), values(1, 10));
        for phi in [Unary::Sigmoid, Unary::Silu, Unary::Relu] {
            let p = FusedGateParams {
                weight: &w,
                channel: GateParams { a_weight: &ac, a_bias: &ab_c, b_weight: &bc, b_bias: &bb_c, alpha: 1.3 },
                scalar: GateParams { a_weight: &as_, a_bias: &ab_s, b_weight: &bs, b_bias: &bb_s, alpha: 0.7 },
                phi,
            };
            let (mut zu, mut out) = (vec![0.0; dims.rows * dims.width()], vec![0.0; dims.rows * d_out]);
            fused_gate_forward(&dims, &x, &p, &mut zu, &mut out);
            let expected = fused_gate_forward_reference(&dims, &x, &p);
            for (a, b) in out.iter().zip(&expected) {
                assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{phi:?}: {a} vs {b}");
            }
            // The gate alone from the forward's ZU: the same output and saved state, bit for bit.
            let mut again = vec![f32::NAN; out.len()];
            let saved = fused_gate_from_zu(&dims, &p, &zu, &mut again);
            let forward_saved = fused_gate_forward(&dims, &x, &p, &mut zu, &mut out);
            assert_eq!(again, out, "{phi:?}: the gate from ZU differs from the forward's");
            assert_eq!(saved.hidden, forward_saved.hidden, "{phi:?}: H differs");
            assert_eq!(saved.gate_scalar, forward_saved.gate_scalar, "{phi:?}: γ_s differs");
            assert_eq!(saved.logit_scalar, forward_saved.logit_scalar, "{phi:?}: the scalar logit differs");
        }
    }
}
