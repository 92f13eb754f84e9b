//! The one comparison: every element of an analytic gradient (or any computed vector)
//! against its reference, reporting the worst element ([`compare`]); [`close`] is the same
//! bound for computed values, where special values must come out as the reference's.

use crate::{gradient, Dtype, Tolerance};

/// The element furthest from its reference, in tolerances.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Worst {
    /// Flat index of the element.
    pub index: usize,
    /// The computed value (the analytic gradient).
    pub got: f64,
    /// The reference (the numeric gradient).
    pub want: f64,
    /// `|got − want| / (atol + rtol·|want|)`: above 1 fails.
    pub ratio: f64,
}

/// A comparison that failed: which vector, and its worst element.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// What was compared (`"d/dx of gelu"`, a parameter name, ...).
    pub what: String,
    /// The worst element (ratio above 1), or the length mismatch as index = len.
    pub worst: Worst,
    /// The tolerance it was held to.
    pub tolerance: Tolerance,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Worst { index, got, want, ratio } = self.worst;
        write!(
            f,
            "{}: element {index}: got {got:.6e}, want {want:.6e}, off by {:.3e} = {ratio:.2}× the tolerance \
             (atol {:.0e}, rtol {:.0e})",
            self.what,
            (got - want).abs(),
            self.tolerance.atol,
            self.tolerance.rtol
        )
    }
}

impl std::error::Error for Mismatch {}

/// Compares `got` with `want` elementwise; `Ok` holds the worst element when every
/// element is within `tolerance`. Lengths must agree (a mismatch fails with index = the
/// shorter length and NaN values).
pub fn compare(
    what: &str,
    got: impl IntoIterator<Item = f64>,
    want: impl IntoIterator<Item = f64>,
    tolerance: Tolerance,
) -> Result<Worst, Mismatch> {
    let (got, want): (Vec<f64>, Vec<f64>) = (got.into_iter().collect(), want.into_iter().collect());
    let fail = |worst| Err(Mismatch { what: what.to_string(), worst, tolerance });
    if got.len() != want.len() {
        let index = got.len().min(want.len());
        return fail(Worst { index, got: f64::NAN, want: f64::NAN, ratio: f64::INFINITY });
    }
    let mut worst = Worst { index: 0, got: 0.0, want: 0.0, ratio: 0.0 };
    for (index, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let ratio = tolerance.ratio(g, w);
        if ratio > worst.ratio || index == 0 {
            worst = Worst { index, got: g, want: w, ratio };
        }
    }
    if worst.ratio > 1.0 {
        return fail(worst);
    }
    Ok(worst)
}

/// [`compare`] that panics with the mismatch's message (for tests); returns the worst element.
pub fn assert_within(
    what: &str,
    got: impl IntoIterator<Item = f64>,
    want: impl IntoIterator<Item = f64>,
    tolerance: Tolerance,
) -> Worst {
    compare(what, got, want, tolerance).unwrap_or_else(|mismatch| panic!("{mismatch}"))
}

/// Whether a computed value matches its reference: `|got − want| ≤ atol + rtol·|want|`,
/// where equal values match (so an infinite reference needs the same infinity) and NaN
/// matches NaN (a forward must propagate it). The one comparison of values in the tests;
/// gradients go through [`compare`], where a NaN never passes.
pub fn close(got: f64, want: f64, tolerance: Tolerance) -> bool {
    got == want
        || (got.is_nan() && want.is_nan())
        || (want.is_finite() && (got - want).abs() <= tolerance.atol + tolerance.rtol * want.abs())
}

/// Panics naming the first element of `got` that is not [`close`] to `want` (and when the
/// lengths differ). Either side may be f32 or f64.
pub fn assert_close<G, W>(what: &str, got: &[G], want: &[W], tolerance: Tolerance)
where
    G: Copy + Into<f64>,
    W: Copy + Into<f64>,
{
    assert_eq!(got.len(), want.len(), "{what}: {} values, want {}", got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.into(), w.into());
        assert!(
            close(g, w, tolerance),
            "{what}: element {i}: got {g}, want {w} (atol {:e}, rtol {:e})",
            tolerance.atol,
            tolerance.rtol
        );
    }
}

/// A kernel's analytic gradient against the toolkit's differences of `loss` (an f64
/// oracle) at `point`, held to the [`Dtype::F64`] gradient tolerance; panics with the worst
/// element.
pub fn check_gradient(what: &str, analytic: &[f32], point: &[f64], loss: impl FnMut(&[f64]) -> f64) {
    let numeric = gradient(point, Dtype::F64, loss);
    assert_within(what, analytic.iter().map(|&d| f64::from(d)), numeric, Dtype::F64.table().gradient);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_worst_element() {
        let tol = Tolerance { atol: 1e-3, rtol: 0.0 };
        assert_eq!(compare("v", [1.0, 2.0], [1.0, 2.0005], tol).unwrap().index, 1);
        let err = compare("v", [1.0, 2.0, 3.0], [1.0, 2.01, 3.1], tol).unwrap_err();
        assert_eq!(err.worst.index, 2);
        assert!(err.to_string().contains("v: element 2"), "{err}");
        assert!(compare("v", [f64::NAN], [1.0], tol).is_err());
        assert!(compare("v", [1.0], [1.0, 2.0], tol).is_err());
    }

    #[test]
    fn close_matches_special_values_only_exactly() {
        let tol = Tolerance::uniform(1e-3);
        assert!(close(1.0005, 1.0, tol) && !close(1.01, 1.0, tol));
        assert!(close(f64::NAN, f64::NAN, tol) && !close(f64::NAN, 1.0, tol) && !close(1.0, f64::NAN, tol));
        assert!(close(f64::INFINITY, f64::INFINITY, tol) && !close(1e300, f64::INFINITY, tol));
        assert!(!close(f64::NEG_INFINITY, f64::INFINITY, tol) && !close(f64::INFINITY, 1.0, tol));
    }
}
