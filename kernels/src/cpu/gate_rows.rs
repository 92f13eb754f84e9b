//! The elementwise row passes of the fused gated projection ([`super::fused_gate`]): the
//! channel gate `γ_c = σ̃_α(l + b_c) = 2σ(α·(l + b_c))` applied to one row of `Z`, and its
//! backward. Here `l` is the row's channel logits `H_c·B_cᵀ` (without the bias), padded with
//! zeros to `d_pad` lanes, a multiple of 8; `Z`, `dẐ` and `dZ` rows have `d_out` lanes.
//!
//! Each pass is one exponential per element, about half of the gate's cost, so on a CPU with
//! AVX-512F both run on sixteen lanes ([`avx512`]); elsewhere on `f32x8`.
//!
//! PyTorch equivalent: `z * 2 * torch.sigmoid(alpha * (l + b)) * gamma_s` and its autograd.

use wide::f32x8;

use super::simd::{load, sigmoid8, store, LANES};

/// `y = σ(α·(l + b)) · scale · z` for one row, with `scale = 2γ_s` (the calibrated
/// sigmoid's factor 2 times the row's scalar gate).
pub fn gate_row_forward(logits: &[f32], bias: &[f32], alpha: f32, scale: f32, z: &[f32], y: &mut [f32]) {
    check(logits, bias, z, y);
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F; the lengths were checked above.
        return unsafe { avx512::forward(logits, bias, alpha, scale, z, y) };
    }
    forward_portable(logits, bias, alpha, scale, z, y);
}

/// The backward of one row of [`gate_row_forward`] with `γ_c = 2σ(α·(l + b))`:
/// writes `dZ = dẐ·γ_c·γ_s` into `dz`, turns `dl` (the row's logits on entry) into
/// `dL_c = α·γ_c(1 − γ_c/2)·dẐ·Z·γ_s` (zero in the padding lanes), adds `dL_c` into
/// `db_channel` (`d_pad` lanes) and returns this row's `(dγ_s, dα_c)` terms:
/// `Σ_j dẐ·Z·γ_c` and `Σ_j (l + b)·γ_c(1 − γ_c/2)·dẐ·Z·γ_s`.
#[allow(clippy::too_many_arguments)]
pub fn gate_row_backward(
    dl: &mut [f32],
    bias: &[f32],
    alpha: f32,
    gate_s: f32,
    dy: &[f32],
    z: &[f32],
    dz: &mut [f32],
    db_channel: &mut [f32],
) -> (f32, f32) {
    check(dl, bias, z, dz);
    assert!(dy.len() == z.len() && db_channel.len() == dl.len(), "gate_row_backward: dy or db has the wrong length");
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F; the lengths were checked above.
        return unsafe { avx512::backward(dl, bias, alpha, gate_s, dy, z, dz, db_channel) };
    }
    backward_portable(dl, bias, alpha, gate_s, dy, z, dz, db_channel)
}

/// Logits and bias: `d_pad` lanes, a multiple of 8 and ≥ `d_out`; rows of `Z`: `d_out`.
fn check(logits: &[f32], bias: &[f32], z: &[f32], out: &[f32]) {
    let (d_pad, d_out) = (logits.len(), z.len());
    assert!(
        bias.len() == d_pad && d_pad.is_multiple_of(LANES) && d_pad >= d_out && out.len() == d_out,
        "gate rows: logits and bias must be padded to a multiple of 8 lanes covering the row"
    );
}

/// [`gate_row_forward`] on 8-lane vectors.
fn forward_portable(logits: &[f32], bias: &[f32], alpha: f32, scale: f32, z: &[f32], y: &mut [f32]) {
    let (alpha, scale) = (f32x8::splat(alpha), f32x8::splat(scale));
    for j in (0..z.len()).step_by(LANES) {
        let g = sigmoid8(alpha * (load(&logits[j..]) + load(&bias[j..])));
        store_lanes(g * scale * load_lanes(z, j), y, j);
    }
}

/// [`gate_row_backward`] on 8-lane vectors.
#[allow(clippy::too_many_arguments)]
fn backward_portable(
    dl: &mut [f32],
    bias: &[f32],
    alpha: f32,
    gate_s: f32,
    dy: &[f32],
    z: &[f32],
    dz: &mut [f32],
    db_channel: &mut [f32],
) -> (f32, f32) {
    let (gate_s, alpha, half) = (f32x8::splat(gate_s), f32x8::splat(alpha), f32x8::splat(0.5));
    let (mut dgate_s, mut dalpha) = (f32x8::ZERO, f32x8::ZERO);
    for j in (0..dl.len()).step_by(LANES) {
        let logit = load(&dl[j..]) + load(&bias[j..]);
        let gate = sigmoid8(alpha * logit) * 2.0;
        // Zero past d_out, so the padding lanes get a zero gradient.
        let (g, zj) = (load_lanes(dy, j), load_lanes(z, j));
        store_lanes(g * gate * gate_s, dz, j);
        let gz = g * zj;
        dgate_s = gz.mul_add(gate, dgate_s);
        let slope = gate * (f32x8::ONE - half * gate) * (gz * gate_s);
        dalpha = slope.mul_add(logit, dalpha);
        let grad = slope * alpha;
        store(grad, &mut dl[j..]);
        store(load(&db_channel[j..]) + grad, &mut db_channel[j..]);
    }
    (dgate_s.reduce_add(), dalpha.reduce_add())
}

/// Lanes `j..j + 8` of `src`, zero past its end.
#[inline(always)]
fn load_lanes(src: &[f32], j: usize) -> f32x8 {
    if j + LANES <= src.len() {
        load(&src[j..])
    } else {
        let mut lanes = [0.0; LANES];
        let n = src.len().saturating_sub(j);
        lanes[..n].copy_from_slice(&src[j..j + n]);
        f32x8::from(lanes)
    }
}

/// Stores the lanes of `v` that fall inside `dst` at `j..j + 8`.
#[inline(always)]
fn store_lanes(v: f32x8, dst: &mut [f32], j: usize) {
    if j + LANES <= dst.len() {
        store(v, &mut dst[j..]);
    } else {
        let n = dst.len() - j;
        dst[j..].copy_from_slice(&v.as_array_ref()[..n]);
    }
}

/// Both passes on sixteen lanes; the lanes past `d_out` (or `d_pad`) run under masks.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps,
        _mm512_reduce_add_ps, _mm512_set1_ps, _mm512_setzero_ps,
    };

    use super::super::simd16::{first_lanes, sigmoid16, LANES};

    /// As `super::forward_portable`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; the lengths must pass `super::check`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn forward(logits: &[f32], bias: &[f32], alpha: f32, scale: f32, z: &[f32], y: &mut [f32]) {
        let (alpha, scale) = (_mm512_set1_ps(alpha), _mm512_set1_ps(scale));
        for j in (0..z.len()).step_by(LANES) {
            let lanes = first_lanes(z.len() - j);
            let l = _mm512_maskz_loadu_ps(lanes, logits.as_ptr().add(j));
            let b = _mm512_maskz_loadu_ps(lanes, bias.as_ptr().add(j));
            let g = sigmoid16(_mm512_mul_ps(alpha, _mm512_add_ps(l, b)));
            let zj = _mm512_maskz_loadu_ps(lanes, z.as_ptr().add(j));
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(j), lanes, _mm512_mul_ps(_mm512_mul_ps(g, scale), zj));
        }
    }

    /// As `super::backward_portable`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; the lengths must pass the checks of
    /// `super::gate_row_backward`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn backward(
        dl: &mut [f32],
        bias: &[f32],
        alpha: f32,
        gate_s: f32,
        dy: &[f32],
        z: &[f32],
        dz: &mut [f32],
        db_channel: &mut [f32],
    ) -> (f32, f32) {
        let (gate_s, alpha) = (_mm512_set1_ps(gate_s), _mm512_set1_ps(alpha));
        let (one, half, two) = (_mm512_set1_ps(1.0), _mm512_set1_ps(0.5), _mm512_set1_ps(2.0));
        let (mut dgate_s, mut dalpha) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for j in (0..dl.len()).step_by(LANES) {
            let (padded, row) = (first_lanes(dl.len() - j), first_lanes(z.len().saturating_sub(j)));
            let logit = _mm512_add_ps(
                _mm512_maskz_loadu_ps(padded, dl.as_ptr().add(j)),
                _mm512_maskz_loadu_ps(padded, bias.as_ptr().add(j)),
            );
            let gate = _mm512_mul_ps(sigmoid16(_mm512_mul_ps(alpha, logit)), two);
            // Zero past d_out, so the padding lanes get a zero gradient.
            let g = _mm512_maskz_loadu_ps(row, dy.as_ptr().add(j));
            let zj = _mm512_maskz_loadu_ps(row, z.as_ptr().add(j));
            _mm512_mask_storeu_ps(dz.as_mut_ptr().add(j), row, _mm512_mul_ps(_mm512_mul_ps(g, gate), gate_s));
            let gz = _mm512_mul_ps(g, zj);
            dgate_s = _mm512_fmadd_ps(gz, gate, dgate_s);
            // γ(1 − γ/2)·dẐ·Z·γ_s
            let slope =
                _mm512_mul_ps(_mm512_mul_ps(gate, _mm512_fnmadd_ps(half, gate, one)), _mm512_mul_ps(gz, gate_s));
            dalpha = _mm512_fmadd_ps(slope, logit, dalpha);
            let grad = _mm512_mul_ps(slope, alpha);
            _mm512_mask_storeu_ps(dl.as_mut_ptr().add(j), padded, grad);
            let db = _mm512_add_ps(_mm512_maskz_loadu_ps(padded, db_channel.as_ptr().add(j)), grad);
            _mm512_mask_storeu_ps(db_channel.as_mut_ptr().add(j), padded, db);
        }
        (_mm512_reduce_add_ps(dgate_s), _mm512_reduce_add_ps(dalpha))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, close, Tolerance};

    /// A row of `d_out` lanes padded to `d_pad`: (logits, bias, dy, z), logits and bias zero
    /// in the padding, as the fused projection builds them.
    fn row(d_out: usize, seed: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let d_pad = d_out.next_multiple_of(LANES);
        let wave = |scale: f32, shift: f32| -> Vec<f32> {
            let mut v: Vec<f32> = (0..d_out).map(|j| ((j as f32 + shift) * seed).sin() * scale).collect();
            v.resize(d_pad, 0.0);
            v
        };
        let (dy, z) = (wave(1.0, 0.3), wave(2.0, 0.7));
        (wave(6.0, 0.0), wave(0.5, 1.1), dy[..d_out].to_vec(), z[..d_out].to_vec())
    }

    /// f64 forward and backward of one row: (y, dz, dl, dγ_s, dα).
    fn reference(
        l: &[f32],
        b: &[f32],
        alpha: f32,
        gate_s: f32,
        dy: &[f32],
        z: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, f64, f64) {
        let (alpha, gate_s) = (alpha as f64, gate_s as f64);
        let (mut y, mut dz, mut dl) = (Vec::new(), Vec::new(), vec![0.0; l.len()]);
        let (mut dgate_s, mut dalpha) = (0.0, 0.0);
        for j in 0..z.len() {
            let logit = l[j] as f64 + b[j] as f64;
            let gate = 2.0 / (1.0 + (-alpha * logit).exp());
            let (g, zj) = (dy[j] as f64, z[j] as f64);
            y.push(gate * gate_s * zj);
            dz.push(g * gate * gate_s);
            dgate_s += g * zj * gate;
            let slope = gate * (1.0 - gate / 2.0) * g * zj * gate_s;
            dalpha += slope * logit;
            dl[j] = slope * alpha;
        }
        (y, dz, dl, dgate_s, dalpha)
    }

    #[test]
    fn rows_match_f64_reference() {
        for d_out in [1, 5, 8, 13, 16, 24, 31, 128, 344] {
            let (l, b, dy, z) = row(d_out, 0.37);
            let (alpha, gate_s) = (1.3, 0.8);
            let (want_y, want_dz, want_dl, want_dgate_s, want_dalpha) = reference(&l, &b, alpha, gate_s, &dy, &z);
            let tol = Tolerance::uniform(1e-5);
            let mut y = vec![f32::NAN; d_out];
            gate_row_forward(&l, &b, alpha, 2.0 * gate_s, &z, &mut y);
            assert_close(&format!("forward, d_out = {d_out}"), &y, &want_y, tol);
            let (mut dl, mut dz, mut db) = (l.clone(), vec![f32::NAN; d_out], vec![1.0; l.len()]);
            let (dgate_s, dalpha) = gate_row_backward(&mut dl, &b, alpha, gate_s, &dy, &z, &mut dz, &mut db);
            assert_close(&format!("dz, d_out = {d_out}"), &dz, &want_dz, tol);
            assert_close(&format!("dl, d_out = {d_out}"), &dl, &want_dl, tol);
            let db_added: Vec<f32> = db.iter().map(|g| g - 1.0).collect();
            assert_close(&format!("db, d_out = {d_out}"), &db_added, &want_dl, tol);
            assert!(
                close(dgate_s.into(), want_dgate_s, tol) && close(dalpha.into(), want_dalpha, Tolerance::uniform(1e-4))
            );
        }
    }

    #[test]
    fn avx512_rows_match_portable() {
        #[cfg(target_arch = "x86_64")]
        {
            if !crate::cpu::avx512_available() {
                eprintln!("skipping gate_rows::avx512_rows_match_portable: this CPU has no AVX-512F");
                return;
            }
            for d_out in [3, 8, 17, 40, 128] {
                let (l, b, dy, z) = row(d_out, 0.91);
                let tol = Tolerance::uniform(2e-6);
                let (mut fast, mut portable) = (vec![0.0; d_out], vec![0.0; d_out]);
                // SAFETY: the CPU has AVX-512F (checked above); the row lengths are consistent.
                unsafe { avx512::forward(&l, &b, 0.7, 1.6, &z, &mut fast) };
                forward_portable(&l, &b, 0.7, 1.6, &z, &mut portable);
                assert_close(&format!("forward, d_out = {d_out}"), &fast, &portable, tol);
                let (mut dl_fast, mut dz_fast, mut db_fast) = (l.clone(), vec![0.0; d_out], vec![0.5; l.len()]);
                let (mut dl_portable, mut dz_portable, mut db_portable) =
                    (l.clone(), vec![0.0; d_out], vec![0.5; l.len()]);
                // SAFETY: as above.
                let sums_fast =
                    unsafe { avx512::backward(&mut dl_fast, &b, 0.7, 0.9, &dy, &z, &mut dz_fast, &mut db_fast) };
                let sums_portable =
                    backward_portable(&mut dl_portable, &b, 0.7, 0.9, &dy, &z, &mut dz_portable, &mut db_portable);
                assert_close("dl", &dl_fast, &dl_portable, tol);
                assert_close("dz", &dz_fast, &dz_portable, tol);
                assert_close("db", &db_fast, &db_portable, tol);
                // The row sums add their terms in another order (16 lanes, not 8).
                let sums = [sums_fast.0, sums_fast.1];
                assert_close(
                    &format!("row sums, d_out = {d_out}"),
                    &sums,
                    &[sums_portable.0, sums_portable.1],
                    Tolerance::uniform(1e-4),
                );
            }
        }
    }
}
