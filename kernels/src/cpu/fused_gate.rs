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
//! results for the backward ([`FusedGateSaved`]). The rank-r parts run as small
//! GEMMs (`H_c·B_cᵀ`), and the gate is computed and applied in one SIMD pass over rows,
//! never materialising γ. PyTorch equivalent of the whole
//! op: `(x @ W.T) * 2*sigmoid(αc*(phi(x @ Ac.T + ac) @ Bc.T + bc)) * 2*sigmoid(αs*(...))`.
//!
//! Backward kernels accumulate into their gradient buffers (`dx += ...`).

use rayon::prelude::*;
use wide::f32x8;

use super::matmul::{matmul, MatRef};
use super::parallel;
use super::unary::{exp8, load, store, unary_backward, unary_forward, unary_reference, Unary, LANES};

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

/// Gradient buffers of one modulator, accumulated into (`+=`).
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

/// Gradient buffers of the fused projection, accumulated into (`+=`).
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

/// `σ(v)` per lane; `exp8` gives `inf` for very negative `v`, so the result is 0, not NaN.
#[inline(always)]
fn sigmoid8(v: f32x8) -> f32x8 {
    f32x8::ONE / (f32x8::ONE + exp8(-v))
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

/// What the forward keeps for the backward besides `x` and the parameters: the GEMM output
/// `ZU` (`N × K`), `H = φ(U + a)` (`N × (r_c + r_s)`), the scalar gate `γ_s` and its logit
/// per row, and the channel logits without their bias, `H_c·B_cᵀ` (`N × d_out`, one GEMM
/// of inner size r_c). Keeping them costs `N·(K + d_out + r + 2)` floats and spares the
/// backward recomputing the rank-r path.
#[derive(Debug)]
pub struct FusedGateSaved {
    zu: Vec<f32>,
    hidden: Vec<f32>,
    gate_scalar: Vec<f32>,
    logit_scalar: Vec<f32>,
    logits: Vec<f32>,
}

/// `U + a` for every row: the pre-activations of both modulators' hidden units, `N × r`.
fn hidden_inputs(dims: &FusedGateDims, p: &FusedGateParams, zu: &[f32]) -> Vec<f32> {
    let (k, d_out) = (dims.width(), dims.d_out);
    let biases = [p.channel.a_bias, p.scalar.a_bias].concat();
    let mut pre = Vec::with_capacity(dims.rows * biases.len());
    for row in zu.chunks_exact(k) {
        pre.extend(row[d_out..].iter().zip(&biases).map(|(&u, &a)| u + a));
    }
    pre
}

/// `H`, `γ_s`, its logit, and the channel logits from `ZU` (see [`FusedGateSaved`]).
fn modulator_path(dims: &FusedGateDims, p: &FusedGateParams, zu: Vec<f32>) -> FusedGateSaved {
    let FusedGateDims { rows, d_out, rank_channel: rc, .. } = *dims;
    let r = rc + dims.rank_scalar;
    let pre = hidden_inputs(dims, p, &zu);
    let mut hidden = vec![0.0; rows * r];
    unary_forward(p.phi, &pre, &mut hidden);
    let logit_scalar: Vec<f32> =
        hidden.chunks_exact(r).map(|h| dot(p.scalar.b_weight, &h[rc..]) + p.scalar.b_bias[0]).collect();
    let gate_scalar = logit_scalar.iter().map(|&l| calibrated_sigmoid(p.scalar.alpha, l)).collect();
    let mut logits = vec![0.0; rows * d_out];
    matmul(&mut logits, 0, rows_of(&hidden, 0, r), columns_of(p.channel.b_weight, 0, rc), rows, d_out, rc, false);
    FusedGateSaved { zu, hidden, gate_scalar, logit_scalar, logits }
}

/// Forward: writes `out[N×d_out] = Ẑ` and returns what the backward needs.
pub fn fused_gate_forward(dims: &FusedGateDims, x: &[f32], p: &FusedGateParams, out: &mut [f32]) -> FusedGateSaved {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, .. } = *dims;
    let k = dims.width();
    assert_eq!(out.len(), rows * d_out, "fused_gate_forward: out is not N × d_out");
    let c = concatenated_weight(p);
    let mut zu = vec![0.0; rows * k];
    matmul(&mut zu, 0, rows_of(x, 0, d_in), columns_of(&c, 0, d_in), rows, k, d_in, false);
    let s = modulator_path(dims, p, zu);
    let (alpha, bias) = (f32x8::splat(p.channel.alpha), p.channel.b_bias);
    parallel::for_each_row_block_mut(out, d_out, d_out * 8, |first, block| {
        for (i, y) in block.chunks_mut(d_out).enumerate() {
            let n = first + i;
            let (z, logits) = (&s.zu[n * k..n * k + d_out], &s.logits[n * d_out..(n + 1) * d_out]);
            let scale = 2.0 * s.gate_scalar[n];
            let simd = d_out - d_out % LANES;
            for j in (0..simd).step_by(LANES) {
                let gate = sigmoid8(alpha * (load(&logits[j..]) + load(&bias[j..])));
                store(gate * f32x8::splat(scale) * load(&z[j..]), &mut y[j..]);
            }
            for j in simd..d_out {
                y[j] = unary_reference(Unary::Sigmoid, p.channel.alpha * (logits[j] + bias[j])) * scale * z[j];
            }
        }
    });
    s
}

/// One block of the backward row pass: its index, then rows of `dZU`, of the channel
/// logits' gradient and of the per-row terms.
type RowBlock<'a> = (usize, ((&'a mut [f32], &'a mut [f32]), &'a mut [f32]));

/// Backward of [`fused_gate_forward`] from what it saved and the output gradient `dout`.
///
/// One SIMD pass over rows gives
/// `dZ`, the channel logits' gradient `dL_c` and per-row terms of `dγ_s` and `dα_c`; GEMMs
/// then give `dH_c = dL_c·B_c`, `dB_c += dL_cᵀ·H_c`, `dx += dZU·[W; A_c; A_s]`,
/// `dW += dZᵀ·x` and `dA += dUᵀ·x`.
pub fn fused_gate_backward(
    dims: &FusedGateDims,
    x: &[f32],
    p: &FusedGateParams,
    saved: &FusedGateSaved,
    dout: &[f32],
    grads: &mut FusedGateGrads,
) {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    let (k, r) = (dims.width(), rc + rs);
    assert!(
        saved.zu.len() == rows * k && dout.len() == rows * d_out,
        "fused_gate_backward: saved state or dout has the wrong length"
    );
    let FusedGateSaved { zu, hidden, gate_scalar, logit_scalar, logits } = saved;
    let mut dlogits = logits.clone();
    // φ'(U + a), from dφ = 1.
    let pre = hidden_inputs(dims, p, zu);
    let mut dphi = vec![0.0; rows * r];
    unary_backward(p.phi, &pre, hidden, &vec![1.0; rows * r], &mut dphi);
    // dzu rows: [dZ | dU_c | dU_s]; row_terms: [dγ_s, dα_c] per row.
    let mut dzu = vec![0.0; rows * k];
    let mut row_terms = vec![0.0; rows * 2];
    let block_rows = parallel::rows_per_task(d_out * 16);
    let run = |(i, ((dzu_block, dl_block), terms)): RowBlock<'_>| {
        for (r_in_block, ((dzu_row, dl_row), term)) in
            dzu_block.chunks_mut(k).zip(dl_block.chunks_mut(d_out)).zip(terms.chunks_mut(2)).enumerate()
        {
            let n = i * block_rows + r_in_block;
            let z = &zu[n * k..n * k + d_out];
            let dy = &dout[n * d_out..(n + 1) * d_out];
            let (dgate_s, dalpha_c) = channel_backward_row(p, z, dy, gate_scalar[n], dl_row, &mut dzu_row[..d_out]);
            term.copy_from_slice(&[dgate_s, dalpha_c]);
        }
    };
    let chunks = (block_rows * k, block_rows * d_out, block_rows * 2);
    if parallel::should_parallelise(rows.saturating_mul(d_out * 16)) {
        dzu.par_chunks_mut(chunks.0)
            .zip(dlogits.par_chunks_mut(chunks.1))
            .zip(row_terms.par_chunks_mut(chunks.2))
            .enumerate()
            .for_each(run);
    } else {
        dzu.chunks_mut(chunks.0)
            .zip(dlogits.chunks_mut(chunks.1))
            .zip(row_terms.chunks_mut(chunks.2))
            .enumerate()
            .for_each(run);
    }

    // d/dH_c = dL_c·B_c; d/dU = d/dH ⊙ φ'(U + a), written into dZU's summary columns.
    let mut dhidden = vec![0.0; rows * rc];
    matmul(&mut dhidden, 0, rows_of(&dlogits, 0, d_out), rows_of(p.channel.b_weight, 0, rc), rows, rc, d_out, false);
    let (mut dalpha_s, mut dalpha_c) = (0.0f64, 0.0f64);
    let mut dlogit_scalar = vec![0.0; rows];
    for n in 0..rows {
        let (dgate_s, dalpha_c_row) = (row_terms[2 * n], row_terms[2 * n + 1]);
        dalpha_c += dalpha_c_row as f64;
        // d/dl 2σ(αl) = α·γ(1 − γ/2), d/dα 2σ(αl) = l·γ(1 − γ/2)
        let slope = gate_scalar[n] * (1.0 - 0.5 * gate_scalar[n]);
        dlogit_scalar[n] = dgate_s * p.scalar.alpha * slope;
        dalpha_s += (dgate_s * logit_scalar[n] * slope) as f64;
        let du = &mut dzu[n * k + d_out..(n + 1) * k];
        let d = &dphi[n * r..(n + 1) * r];
        for t in 0..rc {
            du[t] = dhidden[n * rc + t] * d[t];
        }
        for t in 0..rs {
            du[rc + t] = dlogit_scalar[n] * p.scalar.b_weight[t] * d[rc + t];
        }
    }
    *grads.channel.alpha += dalpha_c as f32;
    *grads.scalar.alpha += dalpha_s as f32;

    // Cross-row sums: dB = dLᵀ·H, db = Σ dL, da = Σ dU.
    matmul(grads.channel.b_weight, 0, columns_of(&dlogits, 0, d_out), rows_of(hidden, 0, r), d_out, rc, rows, true);
    matmul(grads.scalar.b_weight, 0, columns_of(&dlogit_scalar, 0, 1), rows_of(hidden, rc, r), 1, rs, rows, true);
    add_column_sums(&dlogits, d_out, 0, grads.channel.b_bias);
    grads.scalar.b_bias[0] += dlogit_scalar.iter().map(|&v| v as f64).sum::<f64>() as f32;
    add_column_sums(&dzu, k, d_out, grads.channel.a_bias);
    add_column_sums(&dzu, k, d_out + rc, grads.scalar.a_bias);

    // dx += dZU·[W; A_c; A_s]; the weight gradients are the row blocks of one GEMM dZUᵀ·x.
    let c = concatenated_weight(p);
    matmul(grads.x, 0, rows_of(&dzu, 0, k), rows_of(&c, 0, d_in), rows, d_in, k, true);
    let mut dc = vec![0.0; k * d_in];
    matmul(&mut dc, 0, columns_of(&dzu, 0, k), rows_of(x, 0, d_in), k, d_in, rows, false);
    let (dw, da) = dc.split_at(d_out * d_in);
    let (da_c, da_s) = da.split_at(rc * d_in);
    for (dst, src) in
        [(&mut *grads.weight, dw), (&mut *grads.channel.a_weight, da_c), (&mut *grads.scalar.a_weight, da_s)]
    {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
    }
}

/// One row of the channel gate's backward. On entry `dl` holds the logits without bias
/// (`H_c·B_cᵀ`); on exit `dL_c`. Writes `dz`; returns this row's `dγ_s` and `dα_c` terms.
fn channel_backward_row(
    p: &FusedGateParams,
    z: &[f32],
    dy: &[f32],
    gate_s: f32,
    dl: &mut [f32],
    dz: &mut [f32],
) -> (f32, f32) {
    let (alpha, bias) = (p.channel.alpha, p.channel.b_bias);
    let (alpha8, gate_s8, half) = (f32x8::splat(alpha), f32x8::splat(gate_s), f32x8::splat(0.5));
    let (mut dgate_s8, mut dalpha8) = (f32x8::ZERO, f32x8::ZERO);
    let simd = dl.len() - dl.len() % LANES;
    // d/dZ = γ_c·γ_s; d/dγ_c = dẐ·Z·γ_s; d/dγ_s = Σ_j dẐ·Z·γ_c; then through σ̃ as for γ_s.
    for j in (0..simd).step_by(LANES) {
        let logit = load(&dl[j..]) + load(&bias[j..]);
        let gate = sigmoid8(alpha8 * logit) * 2.0;
        let (g, zj) = (load(&dy[j..]), load(&z[j..]));
        store(g * gate * gate_s8, &mut dz[j..]);
        let dgate = g * zj * gate_s8;
        dgate_s8 += g * zj * gate;
        let slope = gate * (f32x8::ONE - half * gate);
        store(dgate * alpha8 * slope, &mut dl[j..]);
        dalpha8 += dgate * logit * slope;
    }
    let (mut dgate_s, mut dalpha) = (dgate_s8.reduce_add(), dalpha8.reduce_add());
    for j in simd..dl.len() {
        let logit = dl[j] + bias[j];
        let gate = calibrated_sigmoid(alpha, logit);
        dz[j] = dy[j] * gate * gate_s;
        let dgate = dy[j] * z[j] * gate_s;
        dgate_s += dy[j] * z[j] * gate;
        let slope = gate * (1.0 - 0.5 * gate);
        dl[j] = dgate * alpha * slope;
        dalpha += dgate * logit * slope;
    }
    (dgate_s, dalpha)
}

/// `dst[j] += Σ_rows src[row·stride + offset + j]`.
fn add_column_sums(src: &[f32], stride: usize, offset: usize, dst: &mut [f32]) {
    let cols = dst.len();
    for row in src.chunks(stride) {
        for (acc, &v) in dst.iter_mut().zip(&row[offset..offset + cols]) {
            *acc += v;
        }
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
            let mut out = vec![0.0; dims.rows * d_out];
            fused_gate_forward(&dims, &x, &p, &mut out);
            let expected = fused_gate_forward_reference(&dims, &x, &p);
            for (a, b) in out.iter().zip(&expected) {
                assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{phi:?}: {a} vs {b}");
            }
        }
    }
}
