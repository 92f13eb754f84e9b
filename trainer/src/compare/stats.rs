//! The arithmetic of the comparison tables: mean over seeds, standard error of that mean,
//! and the relative change against the baseline row.

/// Arithmetic mean; NaN for no values.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.iter().sum::<f64>() / values.len() as f64
}

/// Standard error of the mean, `s / √n` with `s` the sample standard deviation (n − 1 in
/// the denominator, as the papers' "mean ± standard error" over seeds); `None` for n < 2.
pub fn standard_error(values: &[f64]) -> Option<f64> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let m = mean(values);
    let variance = values.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1) as f64;
    Some((variance / n as f64).sqrt())
}

/// Relative change of `value` against `baseline` in percent: `100 · (value − baseline) / baseline`
/// (negative = lower than the baseline). NaN when the baseline is 0 or not finite.
pub fn delta_percent(value: f64, baseline: f64) -> f64 {
    if baseline == 0.0 || !baseline.is_finite() {
        return f64::NAN;
    }
    100.0 * (value - baseline) / baseline
}

/// Differences of paired measurements (a row minus the baseline at the same seed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    /// Pairs.
    pub n: usize,
    /// Mean difference.
    pub mean: f64,
    /// Standard error of the mean difference; `None` for n < 2.
    pub se: Option<f64>,
    /// Pairs whose difference is below zero.
    pub below_zero: usize,
}

impl Paired {
    /// The mean difference in standard errors (`mean / se`); `None` without an SE or when
    /// the SE is 0.
    pub fn standard_errors(&self) -> Option<f64> {
        self.se.filter(|&se| se > 0.0).map(|se| self.mean / se)
    }
}

/// Mean, standard error and sign count of `differences`. Pairing by seed removes what the
/// two rows share at a seed (its batches and, for equal shapes, its initial weights), so
/// this SE is the one to judge a difference by, not the rows' own SEs.
pub fn paired(differences: &[f64]) -> Paired {
    Paired {
        n: differences.len(),
        mean: mean(differences),
        se: standard_error(differences),
        below_zero: differences.iter().filter(|&&d| d < 0.0).count(),
    }
}
