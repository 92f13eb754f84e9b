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
//! On the CPU the GEMM output `ZU` is one buffer (the caller saves it for backward: it is
//! all the backward needs besides `x` and the parameters); the gate is then computed and
//! applied in one pass over the rows, never materialising γ. PyTorch equivalent of the whole
//! op: `(x @ W.T) * 2*sigmoid(αc*(phi(x @ Ac.T + ac) @ Bc.T + bc)) * 2*sigmoid(αs*(...))`.
//!
//! Backward kernels accumulate into their gradient buffers (`dx += ...`).

use rayon::prelude::*;

use super::matmul::{matmul, MatRef};
use super::parallel;
use super::unary::{unary_derivative_reference, unary_reference, Unary};

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

/// `h = φ(u + a)` and, when asked, `φ'(u + a)`.
fn activate(phi: Unary, u: &[f32], bias: &[f32], h: &mut [f32], dphi: Option<&mut [f32]>) {
    for ((h, &u), &b) in h.iter_mut().zip(u).zip(bias) {
        *h = unary_reference(phi, u + b);
    }
    if let Some(dphi) = dphi {
        for (((d, &u), &b), &h) in dphi.iter_mut().zip(u).zip(bias).zip(h.iter()) {
            *d = unary_derivative_reference(phi, u + b, h);
        }
    }
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

/// Forward: `zu[N×K] = x·[W; A_c; A_s]ᵀ` (saved for backward) and `out[N×d_out] = Ẑ`.
pub fn fused_gate_forward(dims: &FusedGateDims, x: &[f32], p: &FusedGateParams, zu: &mut [f32], out: &mut [f32]) {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    let k = dims.width();
    assert!(zu.len() == rows * k && out.len() == rows * d_out, "fused_gate_forward: zu or out has the wrong length");
    let c = concatenated_weight(p);
    let lhs = MatRef { data: x, offset: 0, row_stride: d_in as isize, col_stride: 1 };
    let rhs = MatRef { data: &c, offset: 0, row_stride: 1, col_stride: d_in as isize };
    matmul(zu, 0, lhs, rhs, rows, k, d_in, false);

    let zu: &[f32] = zu;
    let work_per_row = d_out * (2 * rc + 4) + rs * 2;
    parallel::for_each_row_block_mut(out, d_out, work_per_row, |first, block| {
        let (mut hc, mut hs) = (vec![0.0; rc], vec![0.0; rs]);
        for (i, out_row) in block.chunks_mut(d_out).enumerate() {
            let row = &zu[(first + i) * k..(first + i + 1) * k];
            activate(p.phi, &row[d_out + rc..], p.scalar.a_bias, &mut hs, None);
            let gate_scalar = calibrated_sigmoid(p.scalar.alpha, dot(p.scalar.b_weight, &hs) + p.scalar.b_bias[0]);
            activate(p.phi, &row[d_out..d_out + rc], p.channel.a_bias, &mut hc, None);
            for (j, y) in out_row.iter_mut().enumerate() {
                let logit = dot(&p.channel.b_weight[j * rc..(j + 1) * rc], &hc) + p.channel.b_bias[j];
                *y = calibrated_sigmoid(p.channel.alpha, logit) * gate_scalar * row[j];
            }
        }
    });
}

/// Backward of [`fused_gate_forward`] from the saved `zu` and the output gradient `dout`.
///
/// One pass over rows recomputes `φ`, the logits and both gates from `zu`, writing
/// `dZU = [dZ | dU_c | dU_s]` and per-row terms of the cross-row sums; GEMMs then give
/// `dx += dZU·[W; A_c; A_s]`, `dW += dZᵀ·x`, `dA += dUᵀ·x` and `dB += dLᵀ·H`.
pub fn fused_gate_backward(
    dims: &FusedGateDims,
    x: &[f32],
    p: &FusedGateParams,
    zu: &[f32],
    dout: &[f32],
    grads: &mut FusedGateGrads,
) {
    check_lengths(dims, x, p);
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = *dims;
    let k = dims.width();
    assert!(zu.len() == rows * k && dout.len() == rows * d_out, "fused_gate_backward: zu or dout has the wrong length");
    // aux row: [dL_c (d_out) | H_c (r_c) | H_s (r_s) | dL_s | dα_c term | dα_s term]
    let aux_cols = d_out + rc + rs + 3;
    let mut dzu = vec![0.0; rows * k];
    let mut aux = vec![0.0; rows * aux_cols];
    let work_per_row = d_out * (3 * rc + 8) + rs * 4;
    let block_rows = parallel::rows_per_task(work_per_row);
    let run = |(i, (dzu_block, aux_block)): (usize, (&mut [f32], &mut [f32]))| {
        let rows_in_block = dzu_block.len() / k;
        for r in 0..rows_in_block {
            let n = i * block_rows + r;
            let dzu_row = &mut dzu_block[r * k..(r + 1) * k];
            let aux_row = &mut aux_block[r * aux_cols..(r + 1) * aux_cols];
            backward_row(dims, p, &zu[n * k..(n + 1) * k], &dout[n * d_out..(n + 1) * d_out], dzu_row, aux_row);
        }
    };
    if parallel::should_parallelise(rows.saturating_mul(work_per_row)) {
        dzu.par_chunks_mut(block_rows * k).zip(aux.par_chunks_mut(block_rows * aux_cols)).enumerate().for_each(run);
    } else {
        dzu.chunks_mut(block_rows * k).zip(aux.chunks_mut(block_rows * aux_cols)).enumerate().for_each(run);
    }

    // Cross-row sums. dB_c = dL_cᵀ·H_c and dB_s = dL_sᵀ·H_s are small GEMMs over rows.
    let aux_ref = |offset: usize, transposed: bool| MatRef {
        data: &aux,
        offset,
        row_stride: if transposed { 1 } else { aux_cols as isize },
        col_stride: if transposed { aux_cols as isize } else { 1 },
    };
    matmul(grads.channel.b_weight, 0, aux_ref(0, true), aux_ref(d_out, false), d_out, rc, rows, true);
    let dl_s = d_out + rc + rs;
    matmul(grads.scalar.b_weight, 0, aux_ref(dl_s, true), aux_ref(d_out + rc, false), 1, rs, rows, true);
    add_column_sums(&aux, aux_cols, 0, grads.channel.b_bias);
    add_column_sums(&aux, aux_cols, dl_s, grads.scalar.b_bias);
    add_column_sums(&dzu, k, d_out, grads.channel.a_bias);
    add_column_sums(&dzu, k, d_out + rc, grads.scalar.a_bias);
    let column_total = |col: usize| -> f32 { aux.chunks(aux_cols).map(|row| row[col] as f64).sum::<f64>() as f32 };
    *grads.channel.alpha += column_total(dl_s + 1);
    *grads.scalar.alpha += column_total(dl_s + 2);

    // dx += dZU·[W; A_c; A_s]; then the weight gradients, each a row block of dZUᵀ·x.
    let c = concatenated_weight(p);
    let dzu_ref = MatRef { data: &dzu, offset: 0, row_stride: k as isize, col_stride: 1 };
    let c_ref = MatRef { data: &c, offset: 0, row_stride: d_in as isize, col_stride: 1 };
    matmul(grads.x, 0, dzu_ref, c_ref, rows, d_in, k, true);
    let x_ref = MatRef { data: x, offset: 0, row_stride: d_in as isize, col_stride: 1 };
    let dzu_t = |offset: usize| MatRef { data: &dzu, offset, row_stride: 1, col_stride: k as isize };
    matmul(grads.weight, 0, dzu_t(0), x_ref, d_out, d_in, rows, true);
    matmul(grads.channel.a_weight, 0, dzu_t(d_out), x_ref, rc, d_in, rows, true);
    matmul(grads.scalar.a_weight, 0, dzu_t(d_out + rc), x_ref, rs, d_in, rows, true);
}

/// One row of the backward pass. Writes `dzu_row = [dZ | dU_c | dU_s]` and
/// `aux_row = [dL_c | H_c | H_s | dL_s | dα_c term | dα_s term]`.
fn backward_row(
    dims: &FusedGateDims,
    p: &FusedGateParams,
    row: &[f32],
    dy: &[f32],
    dzu_row: &mut [f32],
    aux_row: &mut [f32],
) {
    let FusedGateDims { d_out, rank_channel: rc, rank_scalar: rs, .. } = *dims;
    let (mut dphi_c, mut dphi_s) = (vec![0.0; rc], vec![0.0; rs]);
    let (dl_c, rest) = aux_row.split_at_mut(d_out);
    let (h_c, rest) = rest.split_at_mut(rc);
    let (h_s, tail) = rest.split_at_mut(rs);
    activate(p.phi, &row[d_out + rc..], p.scalar.a_bias, h_s, Some(&mut dphi_s));
    activate(p.phi, &row[d_out..d_out + rc], p.channel.a_bias, h_c, Some(&mut dphi_c));
    let logit_s = dot(p.scalar.b_weight, h_s) + p.scalar.b_bias[0];
    let gate_s = calibrated_sigmoid(p.scalar.alpha, logit_s);

    let (dz, du) = dzu_row.split_at_mut(d_out);
    let (du_c, du_s) = du.split_at_mut(rc);
    du_c.fill(0.0);
    let (mut dgate_s, mut dalpha_c) = (0.0f32, 0.0f32);
    for j in 0..d_out {
        let b_row = &p.channel.b_weight[j * rc..(j + 1) * rc];
        let logit_c = dot(b_row, h_c) + p.channel.b_bias[j];
        let gate_c = calibrated_sigmoid(p.channel.alpha, logit_c);
        // d/dZ: γ_c·γ_s; d/dγ_c: dẐ·Z·γ_s; d/dγ_s: Σ_j dẐ·Z·γ_c
        dz[j] = dy[j] * gate_c * gate_s;
        let dgate_c = dy[j] * row[j] * gate_s;
        dgate_s += dy[j] * row[j] * gate_c;
        // d/dl 2σ(αl) = α·2σ(1−σ), d/dα 2σ(αl) = l·2σ(1−σ), with 2σ(1−σ) = γ(1 − γ/2)
        let slope = gate_c * (1.0 - 0.5 * gate_c);
        let dlogit = dgate_c * p.channel.alpha * slope;
        dalpha_c += dgate_c * logit_c * slope;
        dl_c[j] = dlogit;
        // d/dh_c = Σ_j dL_j·B_c[j, :]
        for (acc, &b) in du_c.iter_mut().zip(b_row) {
            *acc += dlogit * b;
        }
    }
    // d/du = d/dh ⊙ φ'(u + a)
    for (acc, &d) in du_c.iter_mut().zip(&dphi_c) {
        *acc *= d;
    }
    let slope_s = gate_s * (1.0 - 0.5 * gate_s);
    let dlogit_s = dgate_s * p.scalar.alpha * slope_s;
    for ((acc, &b), &d) in du_s.iter_mut().zip(p.scalar.b_weight).zip(&dphi_s) {
        *acc = dlogit_s * b * d;
    }
    tail[0] = dlogit_s;
    tail[1] = dalpha_c;
    tail[2] = dgate_s * logit_s * slope_s;
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
            let mut zu = vec![0.0; dims.rows * dims.width()];
            let mut out = vec![0.0; dims.rows * d_out];
            fused_gate_forward(&dims, &x, &p, &mut zu, &mut out);
            let expected = fused_gate_forward_reference(&dims, &x, &p);
            for (a, b) in out.iter().zip(&expected) {
                assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{phi:?}: {a} vs {b}");
            }
        }
    }
}
