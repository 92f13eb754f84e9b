//! Training metrics as JSON Lines: one object per logged step, appended and flushed so a
//! crashed run keeps everything it logged. A resumed run first drops the rows logged after
//! its checkpoint ([`MetricsWriter::resume_at`]), so every step appears once.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::safetensors_io::atomic_write;

/// One logged step. Optional fields are omitted when not measured at that step.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StepMetrics {
    /// Optimizer steps completed (from 1).
    pub step: usize,
    /// The training loss of this step (mean cross-entropy over its tokens or images).
    pub loss: f32,
    /// The learning rate the schedule gave this step.
    pub lr: f32,
    /// Global L2 norm of the gradient, before clipping.
    pub grad_norm: f32,
    /// Throughput since the previous logged row (images/s for image runs); 0 when not measured.
    pub tokens_per_second: f32,
    /// Mean validation (evaluation) loss, at the steps that measured it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// `exp(val_loss)` (language runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_perplexity: Option<f32>,
    /// Top-1 evaluation accuracy as a fraction in [0, 1] (image runs, at each epoch's end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_accuracy: Option<f32>,
}

/// Appends [`StepMetrics`] rows to a `.jsonl` file.
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Opens `path` for appending (a resumed run continues the same file).
    pub fn open(path: &Path) -> Result<MetricsWriter> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening metrics file {}", path.display()))?;
        Ok(MetricsWriter { path: path.to_path_buf(), out: BufWriter::new(file) })
    }

    /// Starts `path` afresh (a new run in a used directory does not inherit old rows).
    pub fn create(path: &Path) -> Result<MetricsWriter> {
        atomic_write(path, b"")?;
        Self::open(path)
    }

    /// Opens `path` for a run resumed from a checkpoint at `step`: rows of later steps (logged
    /// after that checkpoint by the interrupted run, and about to be logged again) are dropped
    /// first, atomically, so each step appears once. Lines that are not metrics rows are kept,
    /// except an unterminated last line that is none: a row torn by a kill, to which the next
    /// row would otherwise be glued.
    pub fn resume_at(path: &Path, step: usize) -> Result<MetricsWriter> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("reading metrics file {}", path.display())),
        };
        let lines: Vec<&str> = text.lines().collect();
        let torn = (!text.ends_with('\n')).then(|| lines.len().saturating_sub(1));
        let kept: String = lines
            .iter()
            .enumerate()
            .filter(|&(i, line)| match row_step(line) {
                Some(s) => s <= step,
                None => Some(i) != torn,
            })
            .map(|(_, line)| format!("{line}\n"))
            .collect();
        if kept.len() != text.len() {
            atomic_write(path, kept.as_bytes())?;
        }
        Self::open(path)
    }

    /// Writes one row and flushes it.
    pub fn write(&mut self, row: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(row)?;
        writeln!(self.out, "{line}")
            .and_then(|_| self.out.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Where the metrics go.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The `step` of a metrics row, or `None` for a line that is not one.
fn row_step(line: &str) -> Option<usize> {
    let row: serde_json::Value = serde_json::from_str(line).ok()?;
    row.get("step")?.as_u64().and_then(|s| usize::try_from(s).ok())
}
