//! The 8-lane (`f32x8`) building blocks the CPU kernels share: [`load`], [`store`], [`exp8`]
//! and [`sigmoid8`] (the unary ops, softmax, norm, attention, cross-entropy, ...). Sixteen-lane
//! AVX-512 counterparts live in [`super::simd16`] on x86-64.

use wide::{f32x8, CmpGe, CmpLt};

/// Width of an `f32x8` register.
pub const LANES: usize = 8;

/// Loads the first [`LANES`] elements of `chunk`.
#[inline(always)]
pub fn load(chunk: &[f32]) -> f32x8 {
    let mut lanes = [0.0; LANES];
    lanes.copy_from_slice(&chunk[..LANES]);
    f32x8::from(lanes)
}

/// Stores `v` into the first [`LANES`] elements of `chunk`.
#[inline(always)]
pub fn store(v: f32x8, chunk: &mut [f32]) {
    chunk[..LANES].copy_from_slice(v.as_array_ref());
}

/// `f32x8::exp` returns 0 from here up (its overflow guard), so such lanes go scalar.
const EXP_FAST_LIMIT: f32 = 87.0;

/// `e^x` per lane (~1 ulp). Lanes that are NaN or ≥ [`EXP_FAST_LIMIT`] use `f32::exp`, so
/// overflow gives `inf` and NaN propagates; lanes below −87 flush to 0 (true value < 2⁻¹²⁵).
#[inline(always)]
pub fn exp8(x: f32x8) -> f32x8 {
    if x.cmp_lt(f32x8::splat(EXP_FAST_LIMIT)).all() {
        x.exp()
    } else {
        per_lane(x, f32::exp)
    }
}

/// `σ(x)` per lane through `e^-|x|`: saturates to 0 or 1 for large `|x|`, never NaN.
#[inline]
pub fn sigmoid8(x: f32x8) -> f32x8 {
    let e = exp8(-x.abs());
    let s = f32x8::ONE / (f32x8::ONE + e);
    x.cmp_ge(f32x8::ZERO).blend(s, e * s)
}

/// Applies the scalar `f` to each lane of `x` (the fallback for lanes a vector body cannot
/// take).
pub(super) fn per_lane(x: f32x8, f: impl Fn(f32) -> f32) -> f32x8 {
    f32x8::from(x.to_array().map(f))
}
