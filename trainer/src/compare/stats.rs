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
