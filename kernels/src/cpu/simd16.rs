//! Math on sixteen lanes with AVX-512F: `e^x` ([`exp16`]), the logistic sigmoid
//! ([`sigmoid16`]) and the lane mask of a row's last partial vector ([`first_lanes`]). The
//! softmax rows of flash attention, SwiGLU and the Transponder gates use them on CPUs that
//! have AVX-512, where the exponentials cost about as much as the memory traffic or the
//! tile products around them. Twice the width of [`super::simd::exp8`] and no per-lane
//! fallback: out-of-range lanes are clamped instead.
//!
//! Method (Cephes `expf`): x = n·ln 2 + r with n = round(x / ln 2) and |r| ≤ ln 2 / 2, e^r
//! by a degree-6 polynomial, then `vscalefps` multiplies by 2^n, which also rounds results
//! that under- or overflow to 0, subnormals or +∞ correctly.
//!
//! PyTorch equivalent: `torch.exp` and `torch.sigmoid` (their vectorised CPU kernels use the
//! same reduction).

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_abs_ps, _mm512_add_ps, _mm512_cmp_ps_mask, _mm512_fmadd_ps, _mm512_fnmadd_ps,
    _mm512_mask_mul_ps, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_rcp14_ps, _mm512_roundscale_ps,
    _mm512_scalef_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_sub_ps, _CMP_LT_OQ, _MM_FROUND_NO_EXC,
    _MM_FROUND_TO_NEAREST_INT,
};

/// Lanes per vector.
pub const LANES: usize = 16;

/// The mask of lanes `0..n` (all sixteen when n ≥ 16): a row's last partial vector is loaded
/// and stored under it, so rows of any length run without a scalar tail.
pub fn first_lanes(n: usize) -> __mmask16 {
    if n >= LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// `e^x` per lane, within about 1 ulp of `f32::exp`: −∞ gives 0, +∞ gives +∞, NaN stays NaN.
///
/// # Safety
/// The CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp16(x: __m512) -> __m512 {
    // Below −104 the result rounds to 0, above 89 to +∞; clamping keeps n·ln 2 exact and r
    // finite. `max`/`min` return their second operand when one is NaN, so NaN passes through.
    let x = _mm512_min_ps(_mm512_set1_ps(89.0), _mm512_max_ps(_mm512_set1_ps(-104.0), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    // r = x − n·ln 2 in two steps (ln 2 = 0.693359375 − 2.12194440e-4; the first part has 9
    // significant bits, so n times it is exact).
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    // e^r ≈ 1 + r + r²·p(r), Horner from the highest degree.
    let mut p = _mm512_set1_ps(1.987_569_2e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let e_r = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(e_r, n)
}

/// `σ(x) = 1 / (1 + e^-x)` per lane, through `e = e^-|x|` ≤ 1 so it never overflows:
/// `1 / (1 + e)` for x ≥ 0 and `e / (1 + e)` below, within about 2 ulp. NaN stays NaN.
///
/// # Safety
/// The CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn sigmoid16(x: __m512) -> __m512 {
    let one = _mm512_set1_ps(1.0);
    let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    // 1 / d for d = 1 + e ∈ [1, 2]: the 14-bit reciprocal estimate and one Newton step
    // r ← r·(2 − d·r), which squares its relative error to below f32's 2^-24 (a division
    // costs several times as much on sixteen lanes).
    let d = _mm512_add_ps(one, e);
    let r = _mm512_rcp14_ps(d);
    let s = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0)));
    let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
    _mm512_mask_mul_ps(s, negative, e, s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_storeu_ps};

    #[test]
    fn matches_std_exp() {
        if !crate::cpu::avx512_available() {
            eprintln!("skipping simd16::matches_std_exp: this CPU has no AVX-512F");
            return;
        }
        let mut inputs: Vec<f32> = (-2200..=1000).map(|i| i as f32 * 0.0913).collect();
        inputs.extend([f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, -87.5, -103.9, 88.7, 88.73]);
        inputs.resize(inputs.len().next_multiple_of(16), 0.5);
        for chunk in inputs.chunks(16) {
            let mut got = [0.0f32; 16];
            // SAFETY: the CPU has AVX-512F (checked above); both buffers hold 16 floats.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (&x, &e) in chunk.iter().zip(&got) {
                let want = x.exp();
                let ok = if want.is_finite() && want > f32::MIN_POSITIVE {
                    ((e - want) / want).abs() < 3e-7
                } else {
                    (e - want).abs() <= f32::MIN_POSITIVE || e == want
                };
                assert!(ok, "exp({x}) = {e}, want {want}");
            }
        }
        let mut nan = [0.0f32; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(nan.as_mut_ptr(), exp16(_mm512_set1_ps(f32::NAN))) };
        assert!(nan.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn sigmoid_matches_f64() {
        if !crate::cpu::avx512_available() {
            eprintln!("skipping simd16::sigmoid_matches_f64: this CPU has no AVX-512F");
            return;
        }
        let mut inputs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0611).collect();
        inputs.extend([f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, -104.0, 89.0, 1e-8, -1e-8]);
        inputs.resize(inputs.len().next_multiple_of(16), 0.25);
        for chunk in inputs.chunks(16) {
            let mut got = [0.0f32; 16];
            // SAFETY: the CPU has AVX-512F (checked above); both buffers hold 16 floats.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), sigmoid16(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (&x, &s) in chunk.iter().zip(&got) {
                let want = 1.0 / (1.0 + (-(x as f64)).exp());
                // Relative to the value, except where it is subnormal or below f32's range.
                let tolerance = 3e-7 * want + f32::MIN_POSITIVE as f64;
                assert!((s as f64 - want).abs() <= tolerance, "sigmoid({x}) = {s}, want {want}");
            }
        }
        let mut nan = [0.0f32; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(nan.as_mut_ptr(), sigmoid16(_mm512_set1_ps(f32::NAN))) };
        assert!(nan.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn first_lanes_counts_lanes() {
        assert_eq!((first_lanes(0), first_lanes(3), first_lanes(16), first_lanes(40)), (0, 0b111, u16::MAX, u16::MAX));
    }
}
