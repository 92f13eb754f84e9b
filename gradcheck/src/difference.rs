//! The one finite-difference helper: central differences with Richardson extrapolation
//! (Ridders' method, Numerical Recipes §5.7).
//!
//! `D(h) = (f(x+h) − f(x−h)) / 2h` has error `c₂h² + c₄h⁴ + …` plus rounding noise of
//! order `ε·|f|/h`. Halving `h` and combining, `(4ʲ·D_{i,j−1} − D_{i−1,j−1}) / (4ʲ − 1)`,
//! cancels one more even power per column. Each new entry's error is estimated from its
//! distance to its two parents; the entry with the smallest estimate wins, and the walk
//! stops once that estimate is below the caller's target or the diagonal starts to
//! diverge (noise has overtaken truncation). A walk that ends far above the target for
//! reasons rounding does not explain started too coarse: it is run again from a smaller step.

use crate::Dtype;

/// Step sizes at most in one walk (`h₀ … h₀/2⁵`, 12 function evaluations).
const LEVELS: usize = 6;

/// Walks from a smaller first step after the first, at most (see [`derivative_with_noise`]).
const RESTARTS: usize = 2;

/// A numeric derivative and the estimates of its own error.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// The derivative.
    pub value: f64,
    /// The extrapolation table's disagreement around `value` (truncation, mostly).
    pub error: f64,
    /// A bound on the part of `value` that is the forward's rounding: the evaluations'
    /// noise bounds carried through the differences and the extrapolation (0 for exact
    /// forwards).
    pub noise: f64,
}

/// `d f / d t` at `t = x`, where `f` is a forward evaluated in `dtype`: every probe point
/// is rounded to `dtype` first and the slope divides by the step actually taken, so the
/// rounding of `x ± h` does not bias it. The first step is the table's, relative to
/// `max(1, |x|)` (smaller ones follow where that one is too coarse: see
/// [`derivative_with_noise`]); a walk stops early once the error estimate is a tenth of the
/// table's absolute gradient tolerance. `f` is taken as exact (no noise bound).
pub fn derivative(x: f64, dtype: Dtype, mut f: impl FnMut(f64) -> f64) -> Estimate {
    derivative_with_noise(x, dtype, |t| (f(t), 0.0))
}

/// [`derivative`] of a forward that also returns a bound on its own rounding error at each
/// point (`(value, noise)`), so the estimate can say how much of it may be noise.
///
/// The first walk starts from the table's step. Where `f` bends on a shorter scale than that
/// step (a norm of a nearly vanishing vector, a parameter near a steep region), the table is
/// not yet in its asymptotic regime when its diagonal stops improving, and the walk ends on an
/// estimate whose error is truncation, far above the target and above what rounding explains.
/// Then the walk runs again from a step 8× smaller (twice at most), and the estimate with the
/// smaller error and noise wins.
pub fn derivative_with_noise(x: f64, dtype: Dtype, mut f: impl FnMut(f64) -> (f64, f64)) -> Estimate {
    let table = dtype.table();
    let mut h = table.step * x.abs().max(1.0);
    let mut best = ridders_walk(x, h, dtype, &mut f);
    for _ in 0..RESTARTS {
        if best.error <= table.gradient.atol + 4.0 * best.noise {
            break;
        }
        h /= 8.0;
        let retry = ridders_walk(x, h, dtype, &mut f);
        if retry.error + retry.noise < best.error + best.noise {
            best = retry;
        }
    }
    best
}

/// One Ridders walk from the first step `h`: halving it up to [`LEVELS`] times, the entry
/// of the extrapolation table with the smallest error and noise.
fn ridders_walk(x: f64, mut h: f64, dtype: Dtype, f: &mut impl FnMut(f64) -> (f64, f64)) -> Estimate {
    let target = dtype.table().gradient.atol / 10.0;
    // One central difference and the bound on its rounding part.
    let mut central = |h: f64| {
        let (up, down) = (dtype.round(x + h), dtype.round(x - h));
        let ((f_up, noise_up), (f_down, noise_down)) = (f(up), f(down));
        ((f_up - f_down) / (up - down), (noise_up + noise_down) / (up - down))
    };
    let mut previous = vec![central(h)];
    let mut best = Estimate { value: previous[0].0, error: f64::INFINITY, noise: previous[0].1 };
    for _ in 1..LEVELS {
        h /= 2.0;
        let mut row = vec![central(h)];
        let mut factor = 1.0;
        for j in 1..=previous.len() {
            factor *= 4.0;
            let ((finer, finer_noise), (coarser, coarser_noise)) = (row[j - 1], previous[j - 1]);
            let value = (factor * finer - coarser) / (factor - 1.0);
            let noise = (factor * finer_noise + coarser_noise) / (factor - 1.0);
            let error = (value - finer).abs().max((value - coarser).abs());
            if error + noise <= best.error + best.noise {
                best = Estimate { value, error, noise };
            }
            row.push((value, noise));
        }
        let diverging = (row[row.len() - 1].0 - previous[previous.len() - 1].0).abs() >= 2.0 * best.error;
        if best.error <= target || diverging {
            break;
        }
        previous = row;
    }
    best
}

/// The numeric gradient of `loss` at `point`: [`derivative`] along each coordinate, the
/// others held fixed.
pub fn gradient(point: &[f64], dtype: Dtype, mut loss: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut probe = point.to_vec();
    (0..point.len())
        .map(|i| {
            let estimate = derivative(point[i], dtype, |t| {
                probe[i] = t;
                loss(&probe)
            });
            probe[i] = point[i];
            estimate.value
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extrapolation_is_exact_to_rounding_for_smooth_functions() {
        for x in [-3.0, -0.4, 0.0, 0.7, 5.0] {
            let e = derivative(x, Dtype::F64, f64::sin);
            assert!((e.value - x.cos()).abs() < 1e-9, "sin'({x}) = {}", e.value);
            assert!(e.error < Dtype::F64.table().gradient.atol, "{e:?}");
        }
        // A steep function: the first step is far too large, extrapolation recovers.
        let e = derivative(0.2, Dtype::F64, |t| (30.0 * t).exp());
        assert!((e.value / (30.0 * 6f64.exp()) - 1.0).abs() < 1e-8, "{e:?}");
    }

    #[test]
    fn a_function_bending_inside_the_first_step_is_walked_again_from_a_finer_one() {
        // The normalised value of a scalar that vanishes one first step (1e-2) away from x,
        // as an RMSNorm of a nearly vanishing row: the first walk alone ends on truncation.
        let (x, zero, eps) = (0.5, 0.49, 0.002);
        let f = |t: f64| (t - zero) / ((t - zero).powi(2) + eps * eps).sqrt();
        let exact = eps * eps / ((x - zero).powi(2) + eps * eps).powf(1.5);
        let first = ridders_walk(x, Dtype::F32.table().step * x.max(1.0), Dtype::F32, &mut |t| (f(t), 0.0));
        assert!((first.value - exact).abs() > 0.1, "{first:?}");
        let e = derivative(x, Dtype::F32, f);
        assert!((e.value - exact).abs() < 1e-4, "{e:?} against {exact}");
    }

    #[test]
    fn f32_forwards_get_their_noise_not_a_bias() {
        // x = 1/3 is not representable: the steps actually taken differ from ±h.
        let x = 1.0 / 3.0;
        let e = derivative(x, Dtype::F32, |t| ((t as f32).powi(3)) as f64);
        assert!((e.value - 3.0 * x * x).abs() < 2e-5, "{e:?}");
    }

    #[test]
    fn gradient_probes_each_coordinate() {
        let g = gradient(&[1.0, 2.0, -1.0], Dtype::F64, |p| p[0] * p[1] + p[2] * p[2] * p[2]);
        for (got, want) in g.iter().zip([2.0, 1.0, 3.0]) {
            assert!((got - want).abs() < 1e-9, "{g:?}");
        }
    }
}
