//! What a run shows and records of its steps: the progress bar, a printed line every
//! `log_every` steps (and at validations and the last step), the matching `metrics.jsonl`
//! rows, throughput over each logging window, and the numbers of the final report.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::step::{QueuedStep, StepOutcome};
use super::TrainReport;
use crate::config::TrainConfig;
use crate::metrics::{MetricsWriter, StepMetrics};

/// The log of one run, from its first step (or the checkpoint's) to its last.
pub(super) struct StepLog {
    progress: ProgressBar,
    /// `None` on the ranks other than 0 of a data-parallel run, which log nothing.
    metrics: Option<MetricsWriter>,
    metrics_path: PathBuf,
    steps: usize,
    log_every: usize,
    tokens_per_step: usize,
    start_step: usize,
    started: Instant,
    /// Start of the current throughput window: when, and after how many steps.
    window: (Instant, usize),
    first_loss: Option<f32>,
    last_loss: f32,
    last_val: Option<f32>,
}

impl StepLog {
    /// Opens the metrics file at `metrics_path` — afresh for a new run; for a run resumed at
    /// `start_step`, without the rows the interrupted run logged after its checkpoint — and
    /// shows the progress bar. Without a path (a data-parallel rank other than 0), it only
    /// keeps the numbers of the report.
    pub fn start(config: &TrainConfig, start_step: usize, metrics_path: Option<&Path>) -> Result<StepLog> {
        let metrics = match metrics_path {
            Some(path) if start_step > 0 => Some(MetricsWriter::resume_at(path, start_step)?),
            Some(path) => Some(MetricsWriter::create(path)?),
            None => None,
        };
        let progress = match metrics_path {
            Some(_) => ProgressBar::new(config.steps as u64).with_position(start_step as u64),
            None => ProgressBar::hidden(),
        };
        progress.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}").context("progress bar template")?,
        );
        Ok(StepLog {
            progress,
            metrics,
            metrics_path: metrics_path.map(Path::to_path_buf).unwrap_or_default(),
            steps: config.steps,
            log_every: config.log_every,
            // Every rank's tokens: the global batch.
            tokens_per_step: config.global_batch * config.seq_len,
            start_step,
            started: Instant::now(),
            window: (Instant::now(), start_step),
            first_loss: None,
            last_loss: f32::NAN,
            last_val: None,
        })
    }

    /// Records `step` (counted from 1) and its `outcome`: a printed line and a metrics row
    /// every `log_every` steps, at the last step and whenever `val_loss` was measured.
    pub fn record(&mut self, step: &QueuedStep, outcome: StepOutcome, val_loss: Option<f32>) -> Result<()> {
        let (done, lr) = (step.done, step.lr);
        let StepOutcome { loss, grad_norm } = outcome;
        self.first_loss.get_or_insert(loss);
        self.last_loss = loss;
        self.last_val = val_loss.or(self.last_val);
        self.progress.inc(1);
        let on_schedule = done.is_multiple_of(self.log_every) || done == self.steps;
        if !(on_schedule || val_loss.is_some()) {
            return Ok(());
        }
        let mut row = StepMetrics {
            step: done,
            loss,
            lr,
            grad_norm,
            val_loss,
            val_perplexity: val_loss.map(f32::exp),
            ..StepMetrics::default()
        };
        if on_schedule {
            row.tokens_per_second = self.close_window(done, step.queued_at);
        }
        let val = val_loss.map(|v| format!(" | val loss {v:.4} (ppl {:.2})", v.exp())).unwrap_or_default();
        let speed =
            if row.tokens_per_second > 0.0 { format!(" | {:.0} tok/s", row.tokens_per_second) } else { String::new() };
        self.progress.suspend(|| {
            crate::say!(
                "step {done:>5}/{} | loss {loss:.4} | lr {lr:.2e} | grad norm {grad_norm:.3}{speed}{val}",
                self.steps
            )
        });
        self.progress.set_message(format!("loss {loss:.4}"));
        match &mut self.metrics {
            Some(metrics) => metrics.write(&row),
            None => Ok(()),
        }
    }

    /// Leaves the progress bar where it stopped (the run ends with an error).
    pub fn abandon(&self) {
        self.progress.abandon();
    }

    /// The report of a run that completed every step.
    pub fn finish(self, checkpoint: PathBuf) -> TrainReport {
        self.progress.finish_and_clear();
        let seconds = self.started.elapsed().as_secs_f64();
        let steps_run = self.steps.saturating_sub(self.start_step);
        TrainReport {
            steps: self.steps,
            steps_run,
            first_loss: self.first_loss.unwrap_or(f32::NAN),
            final_loss: self.last_loss,
            final_val_loss: self.last_val,
            tokens_per_second: (steps_run * self.tokens_per_step) as f64 / seconds.max(1e-9),
            seconds,
            checkpoint,
            metrics: self.metrics_path,
        }
    }

    /// Tokens per second since the window opened until step `done` was queued (`queued_at`);
    /// opens the next window there.
    fn close_window(&mut self, done: usize, queued_at: Instant) -> f32 {
        let (opened, at) = self.window;
        let elapsed = queued_at.saturating_duration_since(opened).as_secs_f64();
        self.window = (queued_at, done);
        ((done - at) * self.tokens_per_step) as f32 / elapsed as f32
    }
}
