//! Training metrics as JSON Lines: one object per logged step, appended and flushed so a
//! crashed run keeps everything it logged.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

/// One logged step. Optional fields are omitted when not measured at that step.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    pub tokens_per_second: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_perplexity: Option<f32>,
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
