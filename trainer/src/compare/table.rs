//! The comparison table: one summary per row over its seeds (mean ± standard error of the
//! metric, Δ% and parameter increase against the baseline row, mean throughput), rendered
//! as Markdown (paper style) and CSV, plus the raw per-seed values as CSV.

use super::grids::{Grid, Task};
use super::run::RunResult;
use super::stats::{delta_percent, mean, paired, standard_error};
use crate::analyze::csv_field;

/// One row of the table, summarised over its seeds.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// The row's label.
    pub label: String,
    /// The row's config overrides, `key=value, ...`.
    pub config: String,
    /// Runs of this row (seeds).
    pub runs: usize,
    /// Runs that diverged (NaN/inf loss); they are left out of the mean.
    pub diverged: usize,
    /// Mean over the finished seeds of the metric: validation perplexity (language) or top-1
    /// accuracy in percent (image); NaN when no seed finished.
    pub metric_mean: f64,
    /// Standard error of that mean; `None` for fewer than two finished seeds.
    pub metric_se: Option<f64>,
    /// Relative change of the mean metric against the baseline row's, in percent; `None`
    /// for the baseline row itself.
    pub delta_percent: Option<f64>,
    /// Mean final validation (evaluation) loss.
    pub val_loss_mean: f64,
    /// Trainable parameters of the row's model (the same for every seed).
    pub parameters: usize,
    /// Parameter increase against the baseline row in percent; `None` for the baseline row.
    pub parameter_increase_percent: Option<f64>,
    /// Mean tokens/s (language) or images/s (image) over the runs that measured it.
    pub throughput_mean: f64,
}

/// The metric of a run: perplexity (language) or accuracy in percent (image).
pub fn metric(task: Task, result: &RunResult) -> Option<f64> {
    match task {
        Task::Language => result.val_ppl,
        Task::Image => result.accuracy,
    }
}

/// The metric column's heading.
fn metric_heading(task: Task) -> &'static str {
    match task {
        Task::Language => "val ppl ↓ (mean ± SE)",
        Task::Image => "top-1 accuracy % ↑ (mean ± SE)",
    }
}

/// The throughput column's heading.
fn throughput_heading(task: Task) -> &'static str {
    match task {
        Task::Language => "tokens/s",
        Task::Image => "images/s",
    }
}

/// Summarises `results` row by row in the grid's order.
pub fn summarize(grid: &Grid, results: &[RunResult]) -> Vec<Summary> {
    let mut summaries: Vec<Summary> = grid
        .rows
        .iter()
        .map(|row| {
            let runs: Vec<&RunResult> = results.iter().filter(|r| r.row == row.label).collect();
            let metrics: Vec<f64> = runs.iter().filter_map(|r| metric(grid.task, r)).collect();
            let losses: Vec<f64> = runs.iter().filter_map(|r| r.val_loss).collect();
            let rates: Vec<f64> = runs.iter().filter_map(|r| r.throughput).collect();
            Summary {
                label: row.label.clone(),
                config: row.describe(),
                runs: runs.len(),
                diverged: runs.iter().filter(|r| r.diverged_at_step.is_some()).count(),
                metric_mean: mean(&metrics),
                metric_se: standard_error(&metrics),
                delta_percent: None,
                val_loss_mean: mean(&losses),
                parameters: runs.first().map_or(0, |r| r.parameters),
                parameter_increase_percent: None,
                throughput_mean: mean(&rates),
            }
        })
        .collect();
    if let Some(base) = summaries.get(grid.baseline).cloned() {
        for (i, s) in summaries.iter_mut().enumerate() {
            if i != grid.baseline {
                s.delta_percent = Some(delta_percent(s.metric_mean, base.metric_mean));
                s.parameter_increase_percent = Some(delta_percent(s.parameters as f64, base.parameters as f64));
            }
        }
    }
    summaries
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A signed percentage, or `—` when absent or not finite.
fn percent(value: Option<f64>) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:+.2}%"),
        _ => "—".into(),
    }
}

/// The metric cell: `mean ± SE` (`± —` for one seed), `diverged` when no seed finished, and
/// how many seeds diverged otherwise.
fn metric_cell(s: &Summary) -> String {
    if !s.metric_mean.is_finite() {
        return if s.diverged > 0 { "diverged".into() } else { "—".into() };
    }
    let se = s.metric_se.map_or("—".to_string(), |se| format!("{se:.3}"));
    let diverged =
        if s.diverged > 0 { format!(" ({} of {} seeds diverged)", s.diverged, s.runs) } else { String::new() };
    format!("{:.3} ± {se}{diverged}", s.metric_mean)
}

/// The Markdown document: `preamble`, the table, and each row's config overrides.
pub fn markdown(preamble: &str, task: Task, summaries: &[Summary]) -> String {
    let mut out = String::from(preamble.trim_end());
    out.push_str("\n\n");
    out.push_str(&format!(
        "| row | {} | Δ% | params | params ↑ | {} |\n|---|---:|---:|---:|---:|---:|\n",
        metric_heading(task),
        throughput_heading(task)
    ));
    for s in summaries {
        let rate = if s.throughput_mean.is_finite() { format!("{:.0}", s.throughput_mean) } else { "—".into() };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            s.label,
            metric_cell(s),
            percent(s.delta_percent),
            thousands(s.parameters),
            percent(s.parameter_increase_percent),
            rate
        ));
    }
    out.push_str("\nRows:\n\n");
    for s in summaries {
        out.push_str(&format!("- `{}`: {}\n", s.label, s.config));
    }
    out
}

/// The rows against the baseline paired by seed: for each other row, the seeds where both
/// finished, the mean difference of the metric (row − baseline) ± its standard error, how
/// many standard errors that is, and on how many seeds the row was better (lower
/// perplexity, higher accuracy). Empty when no row has a pair.
pub fn paired_markdown(grid: &Grid, results: &[RunResult]) -> String {
    let baseline = &grid.rows[grid.baseline].label;
    let metric_at = |row: &str, seed: u64| {
        results.iter().find(|r| r.row == row && r.seed == seed).and_then(|r| metric(grid.task, r))
    };
    let (unit, better) = match grid.task {
        Task::Language => ("ppl", "lower"),
        Task::Image => ("points", "higher"),
    };
    let mut lines = Vec::new();
    for row in grid.rows.iter().filter(|r| &r.label != baseline) {
        let differences: Vec<f64> = results
            .iter()
            .filter(|r| r.row == row.label)
            .filter_map(|r| Some(metric(grid.task, r)? - metric_at(baseline, r.seed)?))
            .collect();
        if differences.is_empty() {
            continue;
        }
        let p = paired(&differences);
        let wins = match grid.task {
            Task::Language => p.below_zero,
            Task::Image => differences.iter().filter(|&&d| d > 0.0).count(),
        };
        let se = p.se.map_or("—".into(), |se| format!("{se:.3}"));
        let in_se = p.standard_errors().map_or("—".into(), |k| format!("{k:+.1}"));
        lines.push(format!("| {} | {} | {:+.3} ± {se} | {in_se} | {wins} of {} |", row.label, p.n, p.mean, p.n));
    }
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nPaired by seed against `{baseline}` (row − {baseline} at the same seed, in {unit}):\n\n\
         | row | pairs | Δ (mean ± SE) | Δ / SE | {better} on |\n|---|---:|---:|---:|---:|\n{}\n",
        lines.join("\n")
    )
}

/// `- Wall time: …`: the training time of all runs together (each run's last invocation:
/// a run resumed after an interruption counts only its last part).
pub fn wall_time_line(results: &[RunResult]) -> String {
    let seconds: f64 = results.iter().map(|r| r.seconds).sum();
    let per_run = seconds / results.len().max(1) as f64;
    let total =
        if seconds < 3600.0 { format!("{:.0} min", seconds / 60.0) } else { format!("{:.1} h", seconds / 3600.0) };
    format!(
        "- Wall time: {total} in {} runs ({per_run:.0} s per run; a resumed run counts its last invocation only)",
        results.len()
    )
}

/// A number for CSV: empty when absent or not finite.
fn csv_number(value: Option<f64>) -> String {
    value.filter(|v| v.is_finite()).map(|v| v.to_string()).unwrap_or_default()
}

/// `table.csv`: one line per row with the summary's numbers (full precision).
pub fn table_csv(task: Task, summaries: &[Summary]) -> String {
    let metric = match task {
        Task::Language => "val_ppl",
        Task::Image => "accuracy_percent",
    };
    let mut out = format!(
        "row,config,runs,diverged,{metric}_mean,{metric}_se,delta_percent,val_loss_mean,parameters,\
         parameter_increase_percent,throughput_mean\n"
    );
    for s in summaries {
        let fields = [
            csv_field(&s.label),
            csv_field(&s.config),
            s.runs.to_string(),
            s.diverged.to_string(),
            csv_number(Some(s.metric_mean)),
            csv_number(s.metric_se),
            csv_number(s.delta_percent),
            csv_number(Some(s.val_loss_mean)),
            s.parameters.to_string(),
            csv_number(s.parameter_increase_percent),
            csv_number(Some(s.throughput_mean)),
        ];
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

/// `runs.csv`: the raw per-seed values.
pub fn runs_csv(results: &[RunResult]) -> String {
    let mut out = String::from(
        "row,seed,val_loss,val_ppl,accuracy_percent,parameters,throughput,seconds,steps,diverged_at_step\n",
    );
    for r in results {
        let fields = [
            csv_field(&r.row),
            r.seed.to_string(),
            csv_number(r.val_loss),
            csv_number(r.val_ppl),
            csv_number(r.accuracy),
            r.parameters.to_string(),
            csv_number(r.throughput),
            csv_number(Some(r.seconds)),
            r.steps.to_string(),
            r.diverged_at_step.map(|s| s.to_string()).unwrap_or_default(),
        ];
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}
