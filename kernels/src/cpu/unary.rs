//! Elementwise unary ops `y = f(x)` and their backward `dx = dy · f'(x)`.
//!
//! PyTorch equivalents: `torch.neg`, `exp`, `log`, `sqrt`, `rsqrt`, `abs`, `sigmoid`, `tanh`,
//! `relu`, `F.silu`, `F.gelu` (exact erf form, `approximate='none'`), `F.gelu(approximate=
//! 'tanh')`, `torch.pow(x, p)` and `torch.square`.
//!
//! The backward receives both `x` and the saved output `y = f(x)`, so exp, sigmoid, tanh,
//! sqrt and rsqrt reuse `y` instead of recomputing the transcendental. The backward writes its
//! gradient (`dx = ...`; the crate's contract, see `lib.rs`).
//!
//! Every op has a scalar reference ([`unary_reference`], [`unary_derivative_reference`]) that
//! also handles the tail of each SIMD loop, and an `f32x8` body built on the shared 8-lane
//! helpers of [`super::simd`].

use std::f64::consts as f64c;

use wide::{f32x8, CmpGe, CmpGt, CmpLt};

use super::parallel;
use super::simd::{exp8, load, per_lane, sigmoid8, store, LANES};

/// An elementwise function with a known derivative.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unary {
    /// `−x`.
    Neg,
    /// `e^x`.
    Exp,
    /// `ln x`.
    Log,
    /// `√x`.
    Sqrt,
    /// `1/√x`.
    Rsqrt,
    /// `|x|`.
    Abs,
    /// `σ(x) = 1/(1 + e^−x)`.
    Sigmoid,
    /// `tanh x`.
    Tanh,
    /// `max(x, 0)`.
    Relu,
    /// `x·σ(x)`.
    Silu,
    /// `x·Φ(x)`, the exact (erf) GELU.
    Gelu,
    /// GELU's tanh approximation, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
    GeluTanh,
    /// `x^p` for the exponent `p`.
    Powf(f32),
    /// `x²`.
    Square,
}

impl Unary {
    /// Every op once, in declaration order (`Powf` with the exponent 2.5, neither an integer
    /// nor a half), for the tests that must cover each op. The unit tests map each variant to
    /// its position here by a match without a wildcard, so adding a variant stops at that
    /// match until it is given a position in this list.
    pub const ALL: [Unary; 14] = [
        Unary::Neg,
        Unary::Exp,
        Unary::Log,
        Unary::Sqrt,
        Unary::Rsqrt,
        Unary::Abs,
        Unary::Sigmoid,
        Unary::Tanh,
        Unary::Relu,
        Unary::Silu,
        Unary::Gelu,
        Unary::GeluTanh,
        Unary::Powf(2.5),
        Unary::Square,
    ];
}

/// `y[i] = f(x[i])`.
pub fn unary_forward(op: Unary, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "unary_forward: x and y differ in length");
    match op {
        Unary::Neg => map(op, x, y, |v| -v),
        Unary::Exp => map(op, x, y, exp8),
        Unary::Log => map(op, x, y, ln8),
        Unary::Sqrt => map(op, x, y, f32x8::sqrt),
        Unary::Rsqrt => map(op, x, y, |v| f32x8::ONE / v.sqrt()),
        Unary::Abs => map(op, x, y, f32x8::abs),
        Unary::Sigmoid => map(op, x, y, sigmoid8),
        Unary::Tanh => map(op, x, y, tanh8),
        Unary::Relu => map(op, x, y, |v| v.cmp_lt(f32x8::ZERO).blend(f32x8::ZERO, v)),
        Unary::Silu => map(op, x, y, |v| v * sigmoid8(v)),
        Unary::Gelu => map(op, x, y, |v| v * normal_cdf8(v)),
        Unary::GeluTanh => map(op, x, y, gelu_tanh8),
        Unary::Powf(p) => map(op, x, y, move |v| per_lane(v, |a| a.powf(p))),
        Unary::Square => map(op, x, y, |v| v * v),
    }
}

/// dx = dy · f'(x); y = f(x) is passed so exp/sigmoid/tanh/sqrt/rsqrt can reuse it.
pub fn unary_backward(op: Unary, x: &[f32], y: &[f32], dy: &[f32], dx: &mut [f32]) {
    let n = dx.len();
    assert!(x.len() == n && y.len() == n && dy.len() == n, "unary_backward: x, y, dy and dx differ in length");
    // d/dx f(x) = the second closure argument of each arm, evaluated at (x, y).
    match op {
        Unary::Neg => map_grad(op, x, y, dy, dx, |_, _| -f32x8::ONE),
        Unary::Exp => map_grad(op, x, y, dy, dx, |_, y| y),
        Unary::Log => map_grad(op, x, y, dy, dx, |x, _| f32x8::ONE / x),
        Unary::Sqrt => map_grad(op, x, y, dy, dx, |_, y| f32x8::HALF / y),
        Unary::Rsqrt => map_grad(op, x, y, dy, dx, |_, y| y * y * y * -0.5),
        Unary::Abs => map_grad(op, x, y, dy, dx, sign8),
        Unary::Sigmoid => map_grad(op, x, y, dy, dx, |_, y| y * (f32x8::ONE - y)),
        Unary::Tanh => map_grad(op, x, y, dy, dx, |_, y| f32x8::ONE - y * y),
        Unary::Relu => map_grad(op, x, y, dy, dx, |x, _| x.cmp_gt(f32x8::ZERO).blend(f32x8::ONE, f32x8::ZERO)),
        Unary::Silu => map_grad(op, x, y, dy, dx, |x, _| silu_derivative8(x)),
        Unary::Gelu => map_grad(op, x, y, dy, dx, |x, _| gelu_derivative8(x)),
        Unary::GeluTanh => map_grad(op, x, y, dy, dx, |x, _| gelu_tanh_derivative8(x)),
        Unary::Powf(p) => map_grad(op, x, y, dy, dx, move |x, _| per_lane(x, |a| power_derivative(a, p))),
        Unary::Square => map_grad(op, x, y, dy, dx, |x, _| x + x),
    }
}

/// Scalar reference `f(x)`; also computes the tail of every SIMD loop.
pub fn unary_reference(op: Unary, x: f32) -> f32 {
    match op {
        Unary::Neg => -x,
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Sqrt => x.sqrt(),
        Unary::Rsqrt => 1.0 / x.sqrt(),
        Unary::Abs => x.abs(),
        Unary::Sigmoid => sigmoid(x),
        Unary::Tanh => x.tanh(),
        Unary::Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        Unary::Silu => x * sigmoid(x),
        Unary::Gelu => x * normal_cdf(x),
        Unary::GeluTanh => gelu_tanh(x),
        Unary::Powf(p) => x.powf(p),
        Unary::Square => x * x,
    }
}

/// Scalar reference `f'(x)`, given `y = f(x)`.
pub fn unary_derivative_reference(op: Unary, x: f32, y: f32) -> f32 {
    match op {
        Unary::Neg => -1.0,
        Unary::Exp => y,
        Unary::Log => 1.0 / x,
        Unary::Sqrt => 0.5 / y,
        Unary::Rsqrt => -0.5 * y * y * y,
        // Relu'(0) = Abs'(0) = 0, as in PyTorch.
        Unary::Abs => sign(x),
        Unary::Relu => f32::from(u8::from(x > 0.0)),
        Unary::Sigmoid => y * (1.0 - y),
        Unary::Tanh => 1.0 - y * y,
        Unary::Silu => silu_derivative(x),
        Unary::Gelu => gelu_derivative(x),
        Unary::GeluTanh => gelu_tanh_derivative(x),
        Unary::Powf(p) => power_derivative(x, p),
        Unary::Square => 2.0 * x,
    }
}

/// Relative cost of one element, in the units of [`parallel::should_parallelise`].
fn work_per_element(op: Unary) -> usize {
    match op {
        Unary::Neg | Unary::Abs | Unary::Relu | Unary::Square => 1,
        Unary::Sqrt | Unary::Rsqrt => 2,
        _ => 8,
    }
}

fn map<F>(op: Unary, x: &[f32], y: &mut [f32], f8: F)
where
    F: Fn(f32x8) -> f32x8 + Sync + Send,
{
    parallel::for_each_chunk_mut(y, work_per_element(op), |start, y| {
        let x = &x[start..start + y.len()];
        let mut xs = x.chunks_exact(LANES);
        let mut ys = y.chunks_exact_mut(LANES);
        for (xc, yc) in (&mut xs).zip(&mut ys) {
            store(f8(load(xc)), yc);
        }
        for (&xv, yv) in xs.remainder().iter().zip(ys.into_remainder()) {
            *yv = unary_reference(op, xv);
        }
    });
}

fn map_grad<F>(op: Unary, x: &[f32], y: &[f32], dy: &[f32], dx: &mut [f32], df8: F)
where
    F: Fn(f32x8, f32x8) -> f32x8 + Sync + Send,
{
    parallel::for_each_chunk_mut(dx, work_per_element(op), |start, dx| {
        let end = start + dx.len();
        let (x, y, dy) = (&x[start..end], &y[start..end], &dy[start..end]);
        let simd_end = dx.len() - dx.len() % LANES;
        for i in (0..simd_end).step_by(LANES) {
            store(load(&dy[i..]) * df8(load(&x[i..]), load(&y[i..])), &mut dx[i..]);
        }
        for i in simd_end..dx.len() {
            dx[i] = dy[i] * unary_derivative_reference(op, x[i], y[i]);
        }
    });
}

/// Natural log per lane; zero, negative, subnormal, infinite and NaN lanes use `f32::ln`
/// because `f32x8::ln` maps 0 to +inf.
fn ln8(x: f32x8) -> f32x8 {
    let normal = x.cmp_ge(f32x8::splat(f32::MIN_POSITIVE)) & x.cmp_lt(f32x8::splat(f32::INFINITY));
    if normal.all() {
        x.ln()
    } else {
        per_lane(x, f32::ln)
    }
}

/// Horner evaluation of `coeffs` (highest degree first) at `z`.
fn horner(z: f32, coeffs: &[f32]) -> f32 {
    coeffs.iter().fold(0.0, |acc, &c| acc * z + c)
}

fn horner8(z: f32x8, coeffs: &[f32]) -> f32x8 {
    coeffs.iter().fold(f32x8::ZERO, |acc, &c| acc.mul_add(z, f32x8::splat(c)))
}

fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

fn sign8(x: f32x8, _y: f32x8) -> f32x8 {
    let positive = x.cmp_gt(f32x8::ZERO).blend(f32x8::ONE, f32x8::ZERO);
    x.cmp_lt(f32x8::ZERO).blend(-f32x8::ONE, positive)
}

fn power_derivative(x: f32, p: f32) -> f32 {
    // PyTorch masks p == 0 so that 0 · x^-1 at x = 0 gives 0, not NaN.
    if p == 0.0 {
        0.0
    } else {
        p * x.powf(p - 1.0)
    }
}

// ---------------------------------------------------------------------------------------
// Sigmoid and SiLU. σ(x) = 1 / (1 + e^-x), evaluated through e^-|x| ≤ 1 so it never overflows.

fn sigmoid(x: f32) -> f32 {
    let e = (-x.abs()).exp();
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 {
        s
    } else {
        e * s
    }
}

// d/dx x·σ(x) = σ(x)·(1 + x·(1 − σ(x)))
fn silu_derivative(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

fn silu_derivative8(x: f32x8) -> f32x8 {
    let s = sigmoid8(x);
    s * (f32x8::ONE + x * (f32x8::ONE - s))
}

// ---------------------------------------------------------------------------------------
// Tanh: an odd polynomial near 0 (where (1 − e)/(1 + e) would cancel), the exponential form
// beyond. Coefficients: Chebyshev fit (mpmath.chebyfit) of (tanh(x)/x − 1)/x² on
// x ∈ [0, 0.625], max error 4e-8; about 1 ulp overall.

const TANH_POLY_LIMIT: f32 = 0.625;
const TANH_POLY: [f32; 5] = [-0.006096714, 0.02099718, -0.053850908, 0.1333277, -0.33333328];

fn tanh8(x: f32x8) -> f32x8 {
    let a = x.abs();
    let z = a * a;
    let near_zero = a + a * z * horner8(z, &TANH_POLY);
    let e = exp8(a * -2.0);
    let far = (f32x8::ONE - e) / (f32x8::ONE + e);
    a.cmp_lt(f32x8::splat(TANH_POLY_LIMIT)).blend(near_zero, far).copysign(x)
}

// ---------------------------------------------------------------------------------------
// GELU, exact form: x·Φ(x) with Φ(x) = ½·erfc(−x/√2).
//
// erfc is evaluated in two pieces, both fitted with mpmath.chebyfit:
//   |t| < 1:  erf(t) = t + t·P(t²)              (P fit error 1e-9)
//   |t| ≥ 1:  erfc(|t|) = e^(−t²)·u·Q(u), u = 1/|t|   (Q relative fit error 5e-7, u ∈ [0, 1])
// The absolute error of erf/erfc in f32 is ≤ 7e-8 (about 1 ulp near erf = 1), and going
// through erfc keeps the tail Φ(x → −∞) accurate in relative terms (≤ 1e-6 + t²·2⁻²³,
// the rounding of t² inside the exponential), unlike 1 + erf.

const ERF_NEAR_ZERO: [f32; 7] = [
    7.875875e-05,
    -0.00080168643,
    0.0051890872,
    -0.026854211,
    0.11283595,
    -0.37612626,
    // erf(t)/t → 2/√π as t → 0; the leading 1 is added exactly outside the polynomial.
    (f64c::FRAC_2_SQRT_PI - 1.0) as f32,
];
const ERFC_TAIL: [f32; 10] = [
    0.034714855,
    -0.09433835,
    -0.06737972,
    0.5892819,
    -0.98207027,
    0.7057813,
    -0.043787166,
    -0.27870715,
    -0.00010175893,
    // ≈ 1/√π, the limit of erfc(t)·e^(t²)·t as t → ∞ (the fitted value, which is better).
    0.5641901,
];
const FRAC_1_SQRT_2: f32 = f64c::FRAC_1_SQRT_2 as f32;
/// 1/√(2π), the peak of the standard normal density.
const FRAC_1_SQRT_2PI: f32 = (f64c::FRAC_2_SQRT_PI * f64c::FRAC_1_SQRT_2 / 2.0) as f32;

/// Complementary error function, absolute error ≤ 1e-7.
fn erfc(t: f32) -> f32 {
    let a = t.abs();
    if a < 1.0 {
        return 1.0 - (t + t * horner(t * t, &ERF_NEAR_ZERO));
    }
    let u = 1.0 / a;
    let tail = (-a * a).exp() * u * horner(u, &ERFC_TAIL);
    if t > 0.0 {
        tail
    } else {
        2.0 - tail
    }
}

fn erfc8(t: f32x8) -> f32x8 {
    let a = t.abs();
    let z = t * t;
    let near_zero = f32x8::ONE - (t + t * horner8(z, &ERF_NEAR_ZERO));
    let u = f32x8::ONE / a;
    let tail = exp8(-z) * u * horner8(u, &ERFC_TAIL);
    let far = t.cmp_gt(f32x8::ZERO).blend(tail, f32x8::splat(2.0) - tail);
    a.cmp_lt(f32x8::ONE).blend(near_zero, far)
}

/// Φ(x), the standard normal CDF.
fn normal_cdf(x: f32) -> f32 {
    0.5 * erfc(-x * FRAC_1_SQRT_2)
}

fn normal_cdf8(x: f32x8) -> f32x8 {
    f32x8::HALF * erfc8(x * -FRAC_1_SQRT_2)
}

// d/dx x·Φ(x) = Φ(x) + x·φ(x),  φ(x) = e^(−x²/2) / √(2π)
fn gelu_derivative(x: f32) -> f32 {
    normal_cdf(x) + x * (-0.5 * x * x).exp() * FRAC_1_SQRT_2PI
}

fn gelu_derivative8(x: f32x8) -> f32x8 {
    normal_cdf8(x) + x * exp8(x * x * -0.5) * FRAC_1_SQRT_2PI
}

// ---------------------------------------------------------------------------------------
// GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. in §2):
// ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

const SQRT_2_OVER_PI: f32 = (f64c::FRAC_2_SQRT_PI * f64c::FRAC_1_SQRT_2) as f32;
/// The cubic coefficient of the paper's fit.
const GELU_TANH_CUBIC: f32 = 0.044_715;

fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

fn gelu_tanh8(x: f32x8) -> f32x8 {
    let u = (x + x * x * x * GELU_TANH_CUBIC) * SQRT_2_OVER_PI;
    f32x8::HALF * x * (f32x8::ONE + tanh8(u))
}

// d/dx = ½(1 + t) + ½·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²),  t = tanh(u)
fn gelu_tanh_derivative(x: f32) -> f32 {
    let t = (SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x)).tanh();
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

fn gelu_tanh_derivative8(x: f32x8) -> f32x8 {
    let x2 = x * x;
    let t = tanh8((x + x * x2 * GELU_TANH_CUBIC) * SQRT_2_OVER_PI);
    let du = (f32x8::ONE + x2 * (3.0 * GELU_TANH_CUBIC)) * SQRT_2_OVER_PI;
    f32x8::HALF * (f32x8::ONE + t) + f32x8::HALF * x * (f32x8::ONE - t * t) * du
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_within, close, compare, derivative, oracle, Dtype, Tolerance};
    use proptest::prelude::*;

    /// Ops defined only for positive inputs get |x| + 0.1.
    fn domain(op: Unary, x: f32) -> f32 {
        match op {
            Unary::Log | Unary::Sqrt | Unary::Rsqrt | Unary::Powf(_) => x.abs() + 0.1,
            _ => x,
        }
    }

    /// f(x) in f64 from the toolkit's oracles, for finite differences.
    fn f64_reference(op: Unary, x: f64) -> f64 {
        match op {
            Unary::Neg => -x,
            Unary::Exp => x.exp(),
            Unary::Log => x.ln(),
            Unary::Sqrt => x.sqrt(),
            Unary::Rsqrt => 1.0 / x.sqrt(),
            Unary::Abs => x.abs(),
            Unary::Sigmoid => oracle::sigmoid(x),
            Unary::Tanh => x.tanh(),
            Unary::Relu => x.max(0.0),
            Unary::Silu => oracle::silu(x),
            Unary::Gelu => oracle::gelu(x),
            Unary::GeluTanh => oracle::gelu_tanh(x),
            Unary::Powf(p) => x.powf(p as f64),
            Unary::Square => x * x,
        }
    }

    /// The slope of `op` from `unary_backward` (dy = 1) and from the toolkit's finite
    /// differences of the f64 oracle `reference`, at 61 points across the SIMD width.
    fn slopes(op: Unary, reference: impl Fn(f64) -> f64) -> (Vec<f64>, Vec<f64>) {
        let x: Vec<f32> = (-30..=30).map(|i| domain(op, i as f32 * 0.15 + 0.013)).collect();
        let y: Vec<f32> = x.iter().map(|&v| unary_reference(op, v)).collect();
        let mut dx = vec![0.0; x.len()];
        unary_backward(op, &x, &y, &vec![1.0; x.len()], &mut dx);
        let numeric = x.iter().map(|&v| derivative(v as f64, Dtype::F64, &reference).value).collect();
        (oracle::widen(&dx), numeric)
    }

    /// The position of `op` in [`Unary::ALL`], by a match without a wildcard: a new variant
    /// does not compile until it is given the next position here, which is where `ALL` must
    /// list it.
    fn position(op: Unary) -> usize {
        match op {
            Unary::Neg => 0,
            Unary::Exp => 1,
            Unary::Log => 2,
            Unary::Sqrt => 3,
            Unary::Rsqrt => 4,
            Unary::Abs => 5,
            Unary::Sigmoid => 6,
            Unary::Tanh => 7,
            Unary::Relu => 8,
            Unary::Silu => 9,
            Unary::Gelu => 10,
            Unary::GeluTanh => 11,
            Unary::Powf(_) => 12,
            Unary::Square => 13,
        }
    }

    #[test]
    fn all_lists_every_op_once() {
        let positions: Vec<usize> = Unary::ALL.iter().map(|&op| position(op)).collect();
        assert_eq!(positions, (0..Unary::ALL.len()).collect::<Vec<_>>());
    }

    #[test]
    fn erfc_matches_f64() {
        for i in -6000..=6000 {
            let t = i as f32 * 1e-3;
            let exact = oracle::erfc(t as f64);
            let got = erfc(t) as f64;
            // 1e-7 absolute, or about 1 ulp where erfc approaches 2.
            let absolute = 1e-7 * exact.max(1.0);
            assert!((got - exact).abs() < absolute, "erfc({t}) = {got}, want {exact}");
            // Beyond 1 the error is relative: e^(−t²) inherits the rounding of t².
            let relative = 1e-6 + 1.2e-7 * (t * t) as f64;
            assert!(t <= 1.0 || (got / exact - 1.0).abs() < relative, "erfc({t}) tail");
            let simd = erfc8(f32x8::splat(t)).to_array()[0] as f64;
            assert!((simd - exact).abs() < absolute, "erfc8({t}) = {simd}, want {exact}");
            assert!(t <= 1.0 || (simd / exact - 1.0).abs() < relative, "erfc8({t}) tail");
        }
        assert!(erfc(f32::NAN).is_nan() && erfc8(f32x8::splat(f32::NAN)).to_array()[0].is_nan());
        assert_eq!(erfc(f32::INFINITY), 0.0);
        assert_eq!(erfc(f32::NEG_INFINITY), 2.0);
    }

    #[test]
    fn scalar_reference_matches_f64() {
        for op in Unary::ALL {
            for i in -400..=400 {
                let x = domain(op, i as f32 * 0.02);
                let want = f64_reference(op, x as f64) as f32;
                let got = unary_reference(op, x);
                assert!(close(got.into(), want.into(), Tolerance::uniform(2e-6)), "{op:?}({x}) = {got}, want {want}");
            }
        }
    }

    #[test]
    fn special_values() {
        let x = [0.0, -0.0, 100.0, -100.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40];
        for op in Unary::ALL {
            let mut y = [0.0; 8];
            unary_forward(op, &x, &mut y);
            for (&xv, &yv) in x.iter().zip(&y) {
                let want = unary_reference(op, xv);
                assert!(close(yv.into(), want.into(), Tolerance::uniform(1e-6)), "{op:?}({xv}) = {yv}, want {want}");
            }
        }
    }

    proptest! {
        #[test]
        fn simd_matches_reference(
            values in prop::collection::vec(-12.0f32..12.0, 1..100),
            seed in 0usize..Unary::ALL.len(),
        ) {
            let op = Unary::ALL[seed];
            let x: Vec<f32> = values.iter().map(|&v| domain(op, v)).collect();
            let mut y = vec![0.0; x.len()];
            unary_forward(op, &x, &mut y);
            for (&xv, &yv) in x.iter().zip(&y) {
                let want = unary_reference(op, xv);
                prop_assert!(close(yv.into(), want.into(), Tolerance::uniform(2e-6)), "{:?}({}) = {}, want {}", op, xv, yv, want);
            }
            let dy: Vec<f32> = (0..x.len()).map(|i| (i % 5) as f32 - 2.0).collect();
            // Stale (NaN) contents: the backward overwrites every element.
            let mut dx = vec![f32::NAN; x.len()];
            unary_backward(op, &x, &y, &dy, &mut dx);
            for i in 0..x.len() {
                let want = dy[i] * unary_derivative_reference(op, x[i], y[i]);
                prop_assert!(close(dx[i].into(), want.into(), Tolerance::uniform(1e-5)), "{:?}'({}) = {}, want {}", op, x[i], dx[i], want);
            }
        }
    }

    #[test]
    fn large_inputs_run_in_parallel_and_match() {
        let x: Vec<f32> = (0..100_003).map(|i| ((i * 37) % 1000) as f32 * 0.01 - 5.0).collect();
        for op in [Unary::Gelu, Unary::Silu, Unary::Tanh] {
            let mut y = vec![0.0; x.len()];
            unary_forward(op, &x, &mut y);
            assert!(x.iter().zip(&y).all(|(&a, &b)| close(
                b.into(),
                unary_reference(op, a).into(),
                Tolerance::uniform(2e-6)
            )));
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for op in Unary::ALL {
            let (analytic, numeric) = slopes(op, |x| f64_reference(op, x));
            assert_within(&format!("{op:?}'"), analytic, numeric, Dtype::F64.table().gradient);
        }
        // The kinks: derivative 0 at exactly 0.
        for op in [Unary::Relu, Unary::Abs] {
            let mut dx = [0.0];
            unary_backward(op, &[0.0], &[0.0], &[1.0], &mut dx);
            assert_eq!(dx[0], 0.0);
        }
    }

    /// Mutation: the bug of an erf GELU whose backward is the tanh approximation's slope
    /// (worst slope error 8.7e-4 near |x| = 2). The same check must reject it.
    #[test]
    fn check_rejects_tanh_slope_for_erf_gelu() {
        let (wrong, numeric) = slopes(Unary::GeluTanh, oracle::gelu);
        let mismatch = compare("GELU' from the tanh rule", wrong, numeric, Dtype::F64.table().gradient)
            .expect_err("the check passed a tanh-approximation backward for the erf GELU");
        eprintln!("rejected as it should be: {mismatch}");
    }
}
