//! One run of a comparison (one row, one seed) in its own directory, resumable:
//!
//! - `result.json` present: the run is finished and skipped (its settings must match);
//! - a checkpoint but no result: the run is resumed (`resume = true`, settings must match);
//! - otherwise it starts from scratch (stale metrics from a run killed before its first
//!   checkpoint are removed first).
//!
//! A run whose loss turns NaN/inf is recorded as diverged (the papers report such runs as
//! exploded perplexities) rather than stopping the grid; any other error stops it.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use models::llama::Llama;
use models::resnet::ResNet;
use nn::Module;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::TrainConfig;
use crate::dir_lock::DirLock;
use crate::run_dir::remove_if_present;
use crate::safetensors_io::atomic_write;
use crate::tokenizer::Tokenizer;
use crate::train::{model_config, train, Diverged, CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE};
use crate::train_image::{train_image, ImageTrainConfig, GRAD_NORMS_FILE};

/// The file a finished run leaves in its directory.
pub const RESULT_FILE: &str = "result.json";

/// The full training config of one run.
#[derive(Clone, Debug)]
pub enum RunConfig {
    /// A LLaMA language model (`train`).
    Language(TrainConfig),
    /// A ResNet image classifier (`train-image`).
    Image(ImageTrainConfig),
}

/// One run to do: a grid row at one seed.
#[derive(Clone, Debug)]
pub struct PlannedRun {
    /// The grid row's label (the run directory's parent).
    pub row: String,
    /// The run's seed (its directory is `seed<seed>`).
    pub seed: u64,
    /// The full config: the grid's base with the row's overrides and this seed.
    pub config: RunConfig,
}

/// What a finished run recorded in `result.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RunResult {
    /// The grid row's label.
    pub row: String,
    /// The run's seed.
    pub seed: u64,
    /// Final validation loss (language) or evaluation loss (image); `None` if diverged.
    pub val_loss: Option<f64>,
    /// `exp(val_loss)` (language runs).
    pub val_ppl: Option<f64>,
    /// Final top-1 evaluation accuracy in percent (image runs).
    pub accuracy: Option<f64>,
    /// Scalar parameters of the model.
    pub parameters: usize,
    /// Tokens/s (language) or images/s (image), periodic evaluation included; over the whole
    /// run from its metrics when it was resumed; `None` when the run diverged.
    pub throughput: Option<f64>,
    /// Wall seconds of the invocation that finished the run.
    pub seconds: f64,
    /// Steps the run was configured for.
    pub steps: usize,
    /// The 1-based step whose loss was NaN/inf, when the run diverged.
    pub diverged_at_step: Option<usize>,
    /// The run's full training config, checked against later invocations.
    pub config: Value,
}

/// What happened to a run in this invocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStatus {
    /// Finished earlier: `result.json` was read.
    Skipped,
    /// Continued from its checkpoint.
    Resumed,
    /// Trained from scratch.
    Started,
}

impl RunConfig {
    /// The run directory.
    pub fn out_dir(&self) -> &Path {
        match self {
            RunConfig::Language(c) => &c.out_dir,
            RunConfig::Image(c) => &c.out_dir,
        }
    }

    /// The config as JSON (as in the run's `config.json`).
    pub fn to_json(&self) -> Result<Value> {
        Ok(match self {
            // As the run records it: with its global batch derived.
            RunConfig::Language(c) => serde_json::to_value(c.for_world(c.world_size)?)?,
            RunConfig::Image(c) => serde_json::to_value(c)?,
        })
    }

    /// Parses `value` as the same kind of config as `self` (missing keys take defaults).
    fn parse_like(&self, value: Value) -> Result<RunConfig> {
        Ok(match self {
            RunConfig::Language(_) => RunConfig::Language(serde_json::from_value(value)?),
            RunConfig::Image(_) => RunConfig::Image(serde_json::from_value(value)?),
        })
    }

    /// Checks the config (names, sizes, the model it builds) without training.
    pub fn validate(&self) -> Result<()> {
        match self {
            RunConfig::Language(c) => {
                c.validate()?;
                model_config(c, Tokenizer::from_name(&c.tokenizer)?.vocab_size())?;
            }
            RunConfig::Image(c) => c.validate()?,
        }
        Ok(())
    }

    /// Scalar parameters of the model this config builds.
    pub fn parameters(&self) -> Result<usize> {
        Ok(match self {
            RunConfig::Language(c) => {
                let vocab = Tokenizer::from_name(&c.tokenizer)?.vocab_size();
                Llama::new(&model_config(c, vocab)?, c.seed)?.num_parameters()
            }
            RunConfig::Image(c) => {
                let (train_set, _) = c.datasets()?;
                ResNet::new(&c.model_config(train_set.channels(), train_set.num_classes())?, c.seed)?.num_parameters()
            }
        })
    }
}

/// Errors unless `stored` (read from `origin`) holds the same settings as `current`, naming
/// the fields that differ. Only saved settings count: the device is not one, so a run
/// finished or checkpointed on one device is reused or resumed on another; and paths are
/// compared as the files they name, so `--out-dir out`, `./out/` and its absolute path are
/// one tree.
fn check_same_config(current: &RunConfig, stored: Value, origin: &Path) -> Result<()> {
    let stored = current.parse_like(stored).with_context(|| format!("parsing the config in {}", origin.display()))?;
    let (old, new) = (resolved_paths(stored.to_json()?), resolved_paths(current.to_json()?));
    if old == new {
        return Ok(());
    }
    let (old, new) = (old.as_object().cloned().unwrap_or_default(), new.as_object().cloned().unwrap_or_default());
    let changed: Vec<String> = new
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {} -> {v}", old.get(k).cloned().unwrap_or(Value::Null)))
        .collect();
    bail!(
        "{} was written with different settings ({}); delete its run directory or choose another --out-dir",
        origin.display(),
        changed.join(", ")
    )
}

/// Fields of a run's config that hold paths.
const PATH_FIELDS: [&str; 5] = ["out_dir", "text", "train_data", "val_data", "data_dir"];

/// `config` with each path field that names an existing file or directory made canonical.
fn resolved_paths(mut config: Value) -> Value {
    for field in PATH_FIELDS {
        if let Some(value) = config.get_mut(field) {
            if let Some(canonical) = value.as_str().and_then(|p| std::fs::canonicalize(p).ok()) {
                *value = Value::String(canonical.display().to_string());
            }
        }
    }
    config
}

/// Reads a finished run's `result.json`.
pub fn read_result(path: &Path) -> Result<RunResult> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The last value of `key` logged in a metrics file (for a resumed run that had nothing left
/// to train), rounded to the `f32` the training loop logged, so it equals the report's value.
fn last_logged(metrics: &Path, key: &str) -> Option<f64> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let value = text.lines().rev().find_map(|line| serde_json::from_str::<Value>(line).ok()?.get(key)?.as_f64())?;
    Some(f64::from(value as f32))
}

/// A positive, finite throughput, else `None`.
fn measured(rate: f64) -> Option<f64> {
    (rate.is_finite() && rate > 0.0).then_some(rate)
}

/// The throughput of a whole run from its metrics file, before and after an interruption:
/// the harmonic mean of the logged per-window rates (`tokens_per_second`, images/s on the
/// image path), which is total items over total time for windows of equal steps.
fn logged_throughput(metrics: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let rates: Vec<f64> = text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok()?.get("tokens_per_second")?.as_f64())
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    measured(rates.len() as f64 / rates.iter().map(|r| 1.0 / r).sum::<f64>())
}

/// The throughput a run reports: the finishing invocation's own for a run trained in one
/// go; for a resumed run (whose invocation saw only the tail), the whole run's from its metrics.
fn throughput(resume: bool, reported: f64, metrics: &Path) -> Option<f64> {
    if resume {
        logged_throughput(metrics).or_else(|| measured(reported))
    } else {
        measured(reported)
    }
}

/// Trains (or resumes) the run and returns what it measured.
fn train_run(run: &PlannedRun, resume: bool, parameters: usize) -> Result<RunResult> {
    let started = Instant::now();
    let dir = run.config.out_dir().to_path_buf();
    let mut result = RunResult {
        row: run.row.clone(),
        seed: run.seed,
        val_loss: None,
        val_ppl: None,
        accuracy: None,
        parameters,
        throughput: None,
        seconds: 0.0,
        steps: 0,
        diverged_at_step: None,
        config: run.config.to_json()?,
    };
    let outcome = match &run.config {
        RunConfig::Language(c) => {
            result.steps = c.steps;
            train(c, resume).map(|report| {
                result.val_loss =
                    report.final_val_loss.map(f64::from).or_else(|| last_logged(&dir.join(METRICS_FILE), "val_loss"));
                result.val_ppl = result.val_loss.map(f64::exp);
                result.throughput = throughput(resume, report.tokens_per_second, &dir.join(METRICS_FILE));
            })
        }
        RunConfig::Image(c) => train_image(c, resume).map(|report| {
            result.steps = report.steps;
            let accuracy = Some(f64::from(report.final_accuracy())).filter(|a| a.is_finite());
            let accuracy = accuracy.or_else(|| last_logged(&dir.join(METRICS_FILE), "val_accuracy"));
            result.accuracy = accuracy.map(|a| 100.0 * a);
            result.val_loss = Some(f64::from(report.final_eval_loss))
                .filter(|l| l.is_finite())
                .or_else(|| last_logged(&dir.join(METRICS_FILE), "val_loss"));
            result.throughput = throughput(resume, report.images_per_second, &dir.join(METRICS_FILE));
        }),
    };
    if let Err(error) = outcome {
        let Some(diverged) = error.downcast_ref::<Diverged>() else {
            return Err(error)
                .with_context(|| format!("training row `{}` seed {} in {}", run.row, run.seed, dir.display()));
        };
        crate::say!("{} seed {}: diverged ({diverged}); recorded as diverged", run.row, run.seed);
        result.diverged_at_step = Some(diverged.step);
    }
    result.seconds = started.elapsed().as_secs_f64();
    Ok(result)
}

/// Runs, resumes or skips one planned run; writes its `result.json` when it finishes.
pub fn execute(run: &PlannedRun) -> Result<(RunResult, RunStatus)> {
    let dir = run.config.out_dir();
    let _lock = DirLock::acquire(dir)?;
    let result_path = dir.join(RESULT_FILE);
    if result_path.exists() {
        let result = read_result(&result_path)?;
        check_same_config(&run.config, result.config.clone(), &result_path)?;
        return Ok((result, RunStatus::Skipped));
    }
    let parameters = run.config.parameters().with_context(|| format!("building row `{}`'s model", run.row))?;
    let resume = dir.join(CHECKPOINT_FILE).exists();
    if resume {
        let config_path = dir.join(CONFIG_FILE);
        let text =
            std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
        let stored: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", config_path.display()))?;
        check_same_config(&run.config, stored, &config_path)?;
    } else {
        for stale in [METRICS_FILE, GRAD_NORMS_FILE] {
            remove_if_present(&dir.join(stale))?;
        }
    }
    let result = train_run(run, resume, parameters)?;
    let json = serde_json::to_string_pretty(&result)?;
    atomic_write(&result_path, json.as_bytes())?;
    Ok((result, if resume { RunStatus::Resumed } else { RunStatus::Started }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensor::Device;

    fn image_config(device: Device) -> RunConfig {
        RunConfig::Image(ImageTrainConfig { device, ..ImageTrainConfig::default() })
    }

    #[test]
    fn a_run_saved_on_one_device_matches_the_same_settings_on_another() {
        let saved = image_config(Device::Cpu).to_json().unwrap();
        check_same_config(&image_config(Device::Cuda(0)), saved, Path::new("result.json")).unwrap();
    }

    #[test]
    fn a_changed_setting_is_named() {
        let saved = image_config(Device::Cpu).to_json().unwrap();
        let current = RunConfig::Image(ImageTrainConfig { epochs: 7, ..ImageTrainConfig::default() });
        let error = check_same_config(&current, saved, Path::new("result.json")).unwrap_err().to_string();
        assert!(error.contains("epochs: ") && error.contains(" -> 7"), "{error}");
    }
}
