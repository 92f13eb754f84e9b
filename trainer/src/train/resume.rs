//! What `train --resume` continues with: every setting from the run directory's checkpoint,
//! overridden only by what the command names (a `--config` file's keys, then flags).
//!
//! A changed setting falls in one of three classes ([`on_change`]):
//! - refused (an error): what the checkpoint's tensors or data position belong to — the
//!   model and its modulators (`model`, `variant`, `d_model`, `d_basis`, `d_ctx`, `ccl_mode`,
//!   `ccl_ablation`, `rank`, `coverage`, `post_ln`, `phi`), the vocabulary (`tokenizer`), the
//!   optimizer state (`optimizer`, `lazy_tables`) and the data order (`sampling`, `seed`);
//! - warned (the run goes on, the warning names each change): what makes the rest of the run
//!   differ from the saved run's uninterrupted course — the data (`text`, `train_data`,
//!   `val_data`, `data_format`), the batch (`batch_size`, `grad_accum`, `seq_len`), the
//!   optimisation (`lr`, `schedule`, `warmup`, `weight_decay`, `beta2`, `momentum`,
//!   `grad_clip`), and `steps` when the schedule depends on the total (cosine, linear,
//!   onecycle);
//! - free: `steps` under a constant or noam schedule, and the bookkeeping (`eval_every`,
//!   `eval_batches`, `save_every`, `log_every`, `out_dir`, `bf16`, `collective_timeout`,
//!   `rendezvous_timeout`).
//!
//! The split of the global batch (`world_size` ranks × `batch_size` × `grad_accum`) may change
//! freely while `global_batch` stays: every step still sees the same rows of the one sampled
//! stream (see `data::sampler`), only the order of the gradient sum differs; one line says what
//! changed. A changed `global_batch` is warned about.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::CHECKPOINT_FILE;
use crate::checkpoint;
use crate::config::TrainConfig;

/// How a resumed run treats a setting that differs from the checkpoint's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnChange {
    /// An error: the checkpoint cannot continue under the new value.
    Refuse,
    /// Allowed, with a warning: the run is no longer an exact continuation.
    Warn,
    /// Allowed silently: nothing the run computes depends on it.
    Free,
}

/// The class of a change to `field` (a key of `config.json`) from `saved`'s value; `None`
/// for a name that is no setting.
pub fn on_change(field: &str, saved: &TrainConfig) -> Option<OnChange> {
    Some(match field {
        "model" | "variant" | "d_model" | "d_basis" | "d_ctx" | "ccl_mode" | "ccl_ablation" | "rank" | "coverage"
        | "post_ln" | "phi" | "tokenizer" | "optimizer" | "lazy_tables" | "sampling" | "seed" => OnChange::Refuse,
        "text" | "train_data" | "val_data" | "data_format" | "batch_size" | "grad_accum" | "seq_len" | "lr"
        | "schedule" | "warmup" | "weight_decay" | "beta2" | "momentum" | "grad_clip" | "global_batch" => {
            OnChange::Warn
        }
        "steps" if saved.schedule.depends_on_total() => OnChange::Warn,
        "steps" | "eval_every" | "eval_batches" | "save_every" | "log_every" | "out_dir" | "bf16" | "world_size"
        | "collective_timeout" | "rendezvous_timeout" => OnChange::Free,
        _ => return None,
    })
}

/// Checks `requested` (resolved for its world size, [`TrainConfig::for_world`]) against the
/// config a checkpoint was `saved` with: an error naming every refused change (with both
/// values), else one warning line per change that alters the run. A new split of an unchanged
/// global batch over ranks and micro-batches is one line of its own.
pub fn check_continuation(saved: &TrainConfig, requested: &TrainConfig) -> Result<Vec<String>> {
    // Checkpoints written before data parallel hold no global batch: derive it.
    let saved = saved.for_world(saved.world_size)?;
    let same_global_batch = saved.global_batch == requested.global_batch;
    let is_split = |field: &str| matches!(field, "world_size" | "batch_size" | "grad_accum");
    let mut lines = check_settings(&saved, requested, |field| {
        if same_global_batch && is_split(field) {
            Some(OnChange::Free)
        } else {
            on_change(field, &saved)
        }
    })?;
    let split = |c: &TrainConfig| (c.world_size, c.batch_size, c.grad_accum);
    if same_global_batch && split(&saved) != split(requested) {
        lines.push(format!(
            "resuming on {} rank(s) × batch {} × grad_accum {} (saved: {} × {} × {}): the same global batch of {} \
             sequences, the same rows each step, the gradient summed in another order",
            requested.world_size,
            requested.batch_size,
            requested.grad_accum,
            saved.world_size,
            saved.batch_size,
            saved.grad_accum,
            requested.global_batch
        ));
    }
    Ok(lines)
}

/// [`check_continuation`] for any serialisable config, each field classed by `class` (a
/// field it does not know is warned about): the rule `train-image --resume` shares.
pub fn check_settings<T: serde::Serialize>(
    saved: &T,
    requested: &T,
    class: impl Fn(&str) -> Option<OnChange>,
) -> Result<Vec<String>> {
    let (old, new) = (settings(saved)?, settings(requested)?);
    let (mut refused, mut warnings) = (Vec::new(), Vec::new());
    for (field, old_value) in &old {
        let new_value = new.get(field).unwrap_or(&Value::Null);
        if old_value == new_value {
            continue;
        }
        let change = format!("{field} {} → {}", show(old_value), show(new_value));
        match class(field).unwrap_or(OnChange::Warn) {
            OnChange::Refuse => refused.push(change),
            OnChange::Warn => warnings.push(change),
            OnChange::Free => {}
        }
    }
    if !refused.is_empty() {
        bail!(
            "--resume cannot change {}: the checkpoint's weights, optimizer state or data order belong to \
             the saved values (start a new run in another --out-dir instead)",
            refused.join(", ")
        );
    }
    Ok(warnings
        .into_iter()
        .map(|change| format!("resuming with {change}: not an exact continuation of the saved run"))
        .collect())
}

/// The settings a resumed run starts from, before flags: with `resume`, the checkpoint's config
/// in the run directory (`out_dir`, else the `config_file`'s, else the default), with the keys
/// `config_file` names laid over it; without, the `config_file` over the defaults.
pub fn base_config(config_file: Option<&Path>, out_dir: Option<&Path>, resume: bool) -> Result<TrainConfig> {
    let defaults = TrainConfig::default();
    let requested = match config_file {
        Some(path) => defaults.overlaid_with_file(path)?,
        None => defaults,
    };
    if !resume {
        return Ok(requested);
    }
    let run_dir = out_dir.unwrap_or(&requested.out_dir).to_path_buf();
    let checkpoint_path = run_dir.join(CHECKPOINT_FILE);
    if !checkpoint_path.exists() {
        bail!("--resume: no checkpoint at {} (train without --resume to start this run)", checkpoint_path.display());
    }
    let saved = checkpoint::load_train_config(&checkpoint_path)
        .with_context(|| format!("--resume: reading the run's settings from {}", checkpoint_path.display()))?;
    let mut base = match config_file {
        Some(path) => saved.overlaid_with_file(path)?,
        None => saved,
    };
    base.out_dir = run_dir;
    Ok(base)
}

/// A setting's value as a message shows it: JSON, with the `f32` fields (serialised widened
/// to `f64`) at `f32` precision, so `lr 0.003` does not read `0.003000000026077032`.
fn show(value: &Value) -> String {
    match value.as_f64() {
        Some(wide) if value.is_f64() => format!("{}", wide as f32),
        _ => value.to_string(),
    }
}

/// `config`'s settings by `config.json` key.
fn settings<T: serde::Serialize>(config: &T) -> Result<serde_json::Map<String, Value>> {
    match serde_json::to_value(config).context("serialising a training config")? {
        Value::Object(fields) => Ok(fields),
        _ => bail!("a training config serialises to a JSON object"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_classed_and_shown_at_their_precision() {
        let saved = TrainConfig::default().for_world(1).unwrap();
        let requested = TrainConfig { lr: 1e-3, batch_size: 4, global_batch: 0, log_every: 3, ..saved.clone() }
            .for_world(1)
            .unwrap();
        let warnings = check_continuation(&saved, &requested).unwrap();
        assert_eq!(warnings.len(), 3, "lr, batch_size, global_batch: {warnings:?}");
        assert!(warnings.iter().any(|w| w.contains("lr 0.003 → 0.001")), "{warnings:?}");
        let refused = TrainConfig { tokenizer: "gpt2".into(), rank: 4, ..requested };
        let msg = check_continuation(&saved, &refused).unwrap_err().to_string();
        assert!(msg.contains("tokenizer \"byte\" → \"gpt2\"") && msg.contains("rank 8 → 4"), "{msg}");
        // The total steps matter only to schedules shaped by them.
        let constant = TrainConfig { schedule: crate::config::ScheduleKind::Constant, ..saved };
        let longer = TrainConfig { steps: 600, ..constant.clone() };
        assert!(check_continuation(&constant, &longer).unwrap().is_empty());
    }

    #[test]
    fn a_new_split_of_the_same_global_batch_is_one_line() {
        let saved = TrainConfig { batch_size: 2, ..TrainConfig::default() }.for_world(2).unwrap();
        let on_one = TrainConfig { global_batch: 4, ..saved.clone() }.for_world(1).unwrap();
        assert_eq!(on_one.grad_accum, 2);
        let lines = check_continuation(&saved, &on_one).unwrap();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("1 rank(s) × batch 2 × grad_accum 2 (saved: 2 × 2 × 1)"), "{lines:?}");
        let bigger = TrainConfig { global_batch: 0, grad_accum: 2, ..saved.clone() }.for_world(2).unwrap();
        let lines = check_continuation(&saved, &bigger).unwrap();
        assert!(lines.iter().any(|l| l.contains("global_batch 4 → 8")), "{lines:?}");
    }

    #[test]
    fn every_setting_has_a_resume_rule() {
        let config = TrainConfig::default();
        for field in settings(&config).unwrap().keys() {
            assert!(on_change(field, &config).is_some(), "`{field}` has no rule in on_change");
        }
    }
}
