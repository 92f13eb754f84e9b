//! SwiGLU gating, the elementwise half of LLaMA's FFN (Shazeer 2020, "GLU Variants Improve
//! Transformer", FFN_SwiGLU with β = 1), fused into one pass forward and one backward:
//!
//! ```text
//! y  = silu(g) ⊙ u = g·σ(g)·u,                 σ(g) = 1 / (1 + e^-g)
//! dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))        (d/dg g·σ(g) = σ(g) + g·σ(g)·(1 − σ(g)))
//! du = dy ⊙ g·σ(g)
//! ```
//!
//! PyTorch equivalent: `F.silu(g) * u` (Hugging Face `LlamaMLP`'s `act_fn(gate_proj(x)) *
//! up_proj(x)`), which runs two kernels and keeps `silu(g)` for the product's backward. Here
//! the forward reads `g` and `u` once and writes `y`; the backward recomputes σ(g) from `g`,
//! so it needs only the inputs, never `y` or `silu(g)`. All buffers are `N` elements (any
//! shape, flattened); the backward writes its gradients (`dg = ...`, `du = ...`; the crate's
//! contract, see `lib.rs`), so fresh buffers need no zero-filling: two fewer passes over the
//! FFN's widest tensors.
//!
//! σ goes through `e^-|g|` ≤ 1 ([`sigmoid8`]), so a large `|g|` saturates to 0 or 1: no
//! overflow, no NaN. Scalar references ([`swiglu_reference`],
//! [`swiglu_derivative_reference`]) also compute the tail of each SIMD loop. On a CPU with
//! AVX-512F both passes run on sixteen lanes instead ([`avx512`], through
//! `simd16::sigmoid16`), with the last partial vector under a lane mask.

use wide::f32x8;

use super::parallel;
use super::simd::{load, sigmoid8, store, LANES};
use super::unary::{unary_reference, Unary};

/// Cost of one element in the units of [`parallel::should_parallelise`]: one exponential,
/// like the transcendental unary ops.
const WORK_PER_ELEMENT: usize = 8;

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn swiglu_forward(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    assert!(gate.len() == n && up.len() == n, "swiglu_forward: gate, up and out differ in length");
    parallel::for_each_chunk_mut(out, WORK_PER_ELEMENT, |start, out| {
        let end = start + out.len();
        forward_chunk(&gate[start..end], &up[start..end], out);
    });
}

/// SwiGLU of the two halves of each row of `gate_up: [rows, 2·cols]` (gate in the first `cols`
/// columns, up in the rest: one product of the packed gate and up weights) into
/// `out: [rows, cols]`.
pub fn swiglu_halves_forward(gate_up: &[f32], cols: usize, out: &mut [f32]) {
    assert!(
        cols > 0 && out.len().is_multiple_of(cols) && gate_up.len() == 2 * out.len(),
        "swiglu_halves_forward: gate_up must be [rows, 2·{cols}] for out [rows, {cols}]"
    );
    parallel::for_each_row_block_mut(out, cols, cols * WORK_PER_ELEMENT, |first_row, block| {
        for (r, out) in block.chunks_mut(cols).enumerate() {
            let (gate, up) = gate_up[(first_row + r) * 2 * cols..][..2 * cols].split_at(cols);
            forward_chunk(gate, up, out);
        }
    });
}

/// The forward on one chunk, on sixteen lanes where the CPU has them.
fn forward_chunk(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F; the three chunks have the same length.
        return unsafe { avx512::forward(gate, up, out) };
    }
    forward_portable(gate, up, out);
}

/// The forward on one chunk with 8-lane vectors, for CPUs without AVX-512.
fn forward_portable(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let simd_end = out.len() - out.len() % LANES;
    for i in (0..simd_end).step_by(LANES) {
        let g = load(&gate[i..]);
        store(g * sigmoid8(g) * load(&up[i..]), &mut out[i..]);
    }
    for i in simd_end..out.len() {
        out[i] = swiglu_reference(gate[i], up[i]);
    }
}

/// `dgate = dout · up · silu'(gate)` and `dup = dout · silu(gate)`, recomputing σ(gate).
pub fn swiglu_backward(gate: &[f32], up: &[f32], dout: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let n = dgate.len();
    assert!(
        gate.len() == n && up.len() == n && dout.len() == n && dup.len() == n,
        "swiglu_backward: gate, up, dout, dgate and dup differ in length"
    );
    parallel::for_each_chunk2_mut(dgate, dup, WORK_PER_ELEMENT, |start, dgate, dup| {
        let end = start + dgate.len();
        backward_chunk(&gate[start..end], &up[start..end], &dout[start..end], dgate, dup);
    });
}

/// The backward of [`swiglu_halves_forward`]: `d_gate_up: [rows, 2·cols]` (the gate's
/// gradient in the first `cols` columns of each row, up's in the rest) for `dout: [rows, cols]`.
pub fn swiglu_halves_backward(gate_up: &[f32], dout: &[f32], cols: usize, d_gate_up: &mut [f32]) {
    assert!(
        cols > 0
            && dout.len().is_multiple_of(cols)
            && gate_up.len() == 2 * dout.len()
            && d_gate_up.len() == gate_up.len(),
        "swiglu_halves_backward: gate_up and d_gate_up must be [rows, 2·{cols}] for dout [rows, {cols}]"
    );
    parallel::for_each_row_block_mut(d_gate_up, 2 * cols, 2 * cols * WORK_PER_ELEMENT, |first_row, block| {
        for (r, d_row) in block.chunks_mut(2 * cols).enumerate() {
            let row = first_row + r;
            let (gate, up) = gate_up[row * 2 * cols..][..2 * cols].split_at(cols);
            let (dgate, dup) = d_row.split_at_mut(cols);
            backward_chunk(gate, up, &dout[row * cols..][..cols], dgate, dup);
        }
    });
}

/// The backward on one chunk, on sixteen lanes where the CPU has them.
fn backward_chunk(gate: &[f32], up: &[f32], dout: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F; the five chunks have the same length.
        return unsafe { avx512::backward(gate, up, dout, dgate, dup) };
    }
    backward_portable(gate, up, dout, dgate, dup);
}

/// The backward on one chunk with 8-lane vectors, for CPUs without AVX-512.
fn backward_portable(gate: &[f32], up: &[f32], dout: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let simd_end = dgate.len() - dgate.len() % LANES;
    for i in (0..simd_end).step_by(LANES) {
        let (g, dy) = (load(&gate[i..]), load(&dout[i..]));
        let s = sigmoid8(g);
        // d/dg silu(g) = σ(g)·(1 + g·(1 − σ(g)))
        let dsilu = s * (f32x8::ONE + g * (f32x8::ONE - s));
        store(dy * load(&up[i..]) * dsilu, &mut dgate[i..]);
        store(dy * (g * s), &mut dup[i..]);
    }
    for i in simd_end..dgate.len() {
        let (dy_dg, dy_du) = swiglu_derivative_reference(gate[i], up[i]);
        dgate[i] = dout[i] * dy_dg;
        dup[i] = dout[i] * dy_du;
    }
}

/// The two passes on sixteen lanes, the last partial vector under a lane mask.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        _mm512_fmadd_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_sub_ps,
    };

    use super::super::simd16::{first_lanes, sigmoid16, LANES};

    /// As `super::forward_portable`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `gate`, `up` and `out` must have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn forward(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for c in (0..out.len()).step_by(LANES) {
            let lanes = first_lanes(out.len() - c);
            let g = _mm512_maskz_loadu_ps(lanes, gate.as_ptr().add(c));
            let u = _mm512_maskz_loadu_ps(lanes, up.as_ptr().add(c));
            let y = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid16(g)), u);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), lanes, y);
        }
    }

    /// As `super::backward_portable`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; all five slices must have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn backward(gate: &[f32], up: &[f32], dout: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
        let one = _mm512_set1_ps(1.0);
        for c in (0..dgate.len()).step_by(LANES) {
            let lanes = first_lanes(dgate.len() - c);
            let g = _mm512_maskz_loadu_ps(lanes, gate.as_ptr().add(c));
            let dy = _mm512_maskz_loadu_ps(lanes, dout.as_ptr().add(c));
            let u = _mm512_maskz_loadu_ps(lanes, up.as_ptr().add(c));
            let s = sigmoid16(g);
            // d/dg silu(g) = σ(g)·(1 + g·(1 − σ(g)))
            let dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
            let dg = _mm512_mul_ps(_mm512_mul_ps(dy, u), dsilu);
            let du = _mm512_mul_ps(dy, _mm512_mul_ps(g, s));
            _mm512_mask_storeu_ps(dgate.as_mut_ptr().add(c), lanes, dg);
            _mm512_mask_storeu_ps(dup.as_mut_ptr().add(c), lanes, du);
        }
    }
}

/// Scalar reference `silu(g) · u`.
pub fn swiglu_reference(g: f32, u: f32) -> f32 {
    g * unary_reference(Unary::Sigmoid, g) * u
}

/// Scalar reference of the partial derivatives `(∂y/∂g, ∂y/∂u)` of `y = silu(g) · u`.
pub fn swiglu_derivative_reference(g: f32, u: f32) -> (f32, f32) {
    let s = unary_reference(Unary::Sigmoid, g);
    // d/dg = u·σ(g)·(1 + g·(1 − σ(g))),  d/du = g·σ(g)
    (u * (s * (1.0 + g * (1.0 - s))), g * s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, assert_within, close, gradient, oracle, Dtype, Tolerance};
    use proptest::prelude::*;

    /// `(y, ∂y/∂g, ∂y/∂u)` in f64.
    fn f64_reference(g: f32, u: f32) -> (f64, f64, f64) {
        let (g, u) = (g as f64, u as f64);
        let s = 1.0 / (1.0 + (-g).exp());
        (g * s * u, u * s * (1.0 + g * (1.0 - s)), g * s)
    }

    /// Runs forward, then backward with `dout` into gradients that start at 0.5 (accumulating)
    /// and into NaN-filled ones (overwriting), and checks all of them against
    /// [`f64_reference`].
    fn check_against_f64(gate: &[f32], up: &[f32], dout: &[f32]) {
        let n = gate.len();
        let mut y = vec![0.0; n];
        swiglu_forward(gate, up, &mut y);
        // Stale (NaN) gradient buffers: the backward must overwrite every element.
        let (mut dgate, mut dup) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        swiglu_backward(gate, up, dout, &mut dgate, &mut dup);
        for i in 0..n {
            let (want_y, dy_dg, dy_du) = f64_reference(gate[i], up[i]);
            let dy = dout[i] as f64;
            let (g, u) = (gate[i], up[i]);
            assert!(
                close(y[i].into(), want_y, Tolerance::uniform(2e-6)),
                "n = {n}: swiglu({g}, {u}) = {}, want {want_y}",
                y[i]
            );
            let want_dg = dy * dy_dg;
            assert!(
                close(dgate[i].into(), want_dg, Tolerance::uniform(1e-5)),
                "n = {n}: dgate({g}, {u}) = {}, want {want_dg}",
                dgate[i]
            );
            let want_du = dy * dy_du;
            assert!(
                close(dup[i].into(), want_du, Tolerance::uniform(1e-5)),
                "n = {n}: dup({g}, {u}) = {}, want {want_du}",
                dup[i]
            );
        }
    }

    fn values(len: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|i| (((i * 37 + seed * 11) % 1000) as f32 * 0.002 - 1.0) * scale).collect()
    }

    proptest! {
        #[test]
        fn simd_and_tail_match_f64(
            gate in prop::collection::vec(-12.0f32..12.0, 1..100),
            seed in 0usize..1000,
        ) {
            // Lengths 1..100: SIMD body only, tail only, and both.
            let up = values(gate.len(), seed, 3.0);
            let dout = values(gate.len(), seed + 1, 2.0);
            check_against_f64(&gate, &up, &dout);
        }
    }

    #[test]
    fn lengths_around_the_simd_width() {
        for n in [1, 7, 8, 9, 15, 16, 17, 23] {
            check_against_f64(&values(n, 1, 8.0), &values(n, 2, 3.0), &values(n, 3, 2.0));
        }
    }

    #[test]
    fn large_gates_saturate_without_nan() {
        // 9 elements: eight in the SIMD body, the last in the scalar tail.
        let gate = [100.0, -100.0, 90.0, -90.0, 1e4, -1e4, 0.0, -0.0, -100.0];
        let up = [2.0, -3.0, 0.5, 4.0, -1.0, 1.0, 7.0, 1.0, 2.0];
        let dout = [1.5, -0.5, 2.0, 1.0, 1.0, -2.0, 1.0, 3.0, -1.0];
        check_against_f64(&gate, &up, &dout);
        let mut y = [0.0; 9];
        swiglu_forward(&gate, &up, &mut y);
        let (mut dgate, mut dup) = ([0.0; 9], [0.0; 9]);
        swiglu_backward(&gate, &up, &dout, &mut dgate, &mut dup);
        assert!(y.iter().chain(&dgate).chain(&dup).all(|v| v.is_finite()), "{y:?} {dgate:?} {dup:?}");
        // silu(g) → g as g → ∞ and → 0 as g → −∞; the same for the slopes.
        assert_eq!((y[0], dgate[0], dup[0]), (200.0, 3.0, 150.0));
        assert!([y[1], dgate[1], dup[1]].iter().all(|v| v.abs() < 1e-30), "{y:?} {dgate:?} {dup:?}");
    }

    #[test]
    fn large_inputs_run_in_parallel_and_match() {
        let n = 100_003;
        check_against_f64(&values(n, 4, 6.0), &values(n, 5, 2.0), &values(n, 6, 1.0));
    }

    #[test]
    fn backward_matches_finite_differences() {
        // 61 points: the SIMD body and the scalar tail, against the toolkit's differences.
        let gate: Vec<f32> = (-30..=30).map(|i| i as f32 * 0.25 + 0.013).collect();
        let up: Vec<f32> = (-30..=30).map(|i| 1.5 - i as f32 * 0.05).collect();
        let (mut dgate, mut dup) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
        swiglu_backward(&gate, &up, &vec![1.0; gate.len()], &mut dgate, &mut dup);
        // The loss Σ swiglu(g, u) (dout = 1 everywhere) from the toolkit's f64 oracle.
        let (g64, u64) = (oracle::widen(&gate), oracle::widen(&up));
        let tol = Dtype::F64.table().gradient;
        let numeric = gradient(&g64, Dtype::F64, |g| oracle::swiglu(g, &u64).iter().sum());
        assert_within("d swiglu / d gate", oracle::widen(&dgate), numeric, tol);
        let numeric = gradient(&u64, Dtype::F64, |u| oracle::swiglu(&g64, u).iter().sum());
        assert_within("d swiglu / d up", oracle::widen(&dup), numeric, tol);
    }

    #[test]
    fn avx512_passes_match_portable() {
        #[cfg(target_arch = "x86_64")]
        {
            if !crate::cpu::avx512_available() {
                eprintln!("skipping swiglu::avx512_passes_match_portable: this CPU has no AVX-512F");
                return;
            }
            for n in [0, 1, 7, 15, 16, 17, 33, 100] {
                let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
                let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
                let dout: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.02).collect();
                let tol = Tolerance::uniform(2e-6);
                let (mut fast, mut portable) = (vec![0.0; n], vec![0.0; n]);
                // SAFETY: the CPU has AVX-512F (checked above); all slices have length n.
                unsafe { avx512::forward(&gate, &up, &mut fast) };
                forward_portable(&gate, &up, &mut portable);
                assert_close(&format!("forward, n = {n}"), &fast, &portable, tol);
                let (mut dg_fast, mut du_fast) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                let (mut dg_portable, mut du_portable) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                // SAFETY: as above.
                unsafe { avx512::backward(&gate, &up, &dout, &mut dg_fast, &mut du_fast) };
                backward_portable(&gate, &up, &dout, &mut dg_portable, &mut du_portable);
                assert_close(&format!("dgate, n = {n}"), &dg_fast, &dg_portable, tol);
                assert_close(&format!("dup, n = {n}"), &du_fast, &du_portable, tol);
            }
        }
    }
}
