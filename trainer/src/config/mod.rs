//! The training run's configuration: defaults, a JSON config file, and command-line
//! overrides, validated before anything runs.

pub mod choices;

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use models::llama::LlamaConfig;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tensor::Device;

pub use choices::{OptimizerKind, Sampling, ScheduleKind};

use crate::data::DataFormat;

/// Everything a training run needs besides the model's own config. Serialised into every
/// checkpoint, so `--resume` continues with exactly the same settings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Model preset (`llama-tiny`, `llama-small`, `llama-60m`, ...).
    pub model: String,
    /// Modulator variant or baseline (`transponder`, `pre-ln`, `ccl`, `per-token`, ...).
    pub variant: String,
    /// Model width override; 0 keeps the preset's. The FFN width scales with it and the heads
    /// stay (`LlamaConfig::with_d_model`): the dense Base-64 / Base-512 of CCL Table 2.
    pub d_model: usize,
    /// CCL basis size k (`ccl` only; 64).
    pub d_basis: usize,
    /// CCL context width d_ctx (`ccl` only; 64).
    pub d_ctx: usize,
    /// CCL context mode, `token` or `causal-mean` (`ccl` only).
    pub ccl_mode: String,
    /// CCL ablation: `none`, `static`, `no-out-gate` or `no-basis-gate` (`ccl` only).
    pub ccl_ablation: String,
    /// Transponder modulator rank r (8; SPEC §1's ablation grid is 2, 4, 8, 16, 32).
    pub rank: usize,
    /// Which projections carry modulators: `all`, `attn`, `mlp`, `only-first`, `only-last`,
    /// `only-qk` or `no-up-gate` (SPEC §1; projection-level variants take any, path-level
    /// ones `all`, `attn` or `mlp`, the rest only `all`).
    pub coverage: String,
    /// Post-LN residuals `Norm(x + F(x))` for the variants that combine with them (Table 3's
    /// "Transponder w. Post-LN").
    pub post_ln: bool,
    /// Modulator nonlinearity φ: `sigmoid`, `silu` or `relu`. (A frozen α is the `fixed-alpha`
    /// variant, so `LlamaConfig::fixed_alpha` needs no field here.)
    pub phi: String,
    /// Plain-text corpus tokenized on first use when no token files are given; unset (`null`)
    /// is the built-in tinyshakespeare, compiled into the binary.
    pub text: Option<PathBuf>,
    /// Token files (llm.c or nanoGPT format); when unset they are prepared from `text`.
    pub train_data: Option<PathBuf>,
    /// The validation token file beside `train_data` (unset: no validation); without token
    /// files both are prepared from `text`.
    pub val_data: Option<PathBuf>,
    /// How the token files are read: detected (`auto`), `llmc` only, or `nanogpt` raw.
    pub data_format: DataFormat,
    /// Tokenizer used to prepare `text` (`byte` or `gpt2`).
    pub tokenizer: String,
    /// Sequences per micro-batch (on each rank, when data parallel).
    pub batch_size: usize,
    /// Tokens per sequence (the context window T).
    pub seq_len: usize,
    /// Micro-batches whose gradients are summed before each optimizer step (on each rank).
    pub grad_accum: usize,
    /// Sequences per optimizer step over every rank, `world_size × batch_size × grad_accum`
    /// (`--global-batch`); 0 until [`TrainConfig::for_world`] derives it. When given,
    /// `grad_accum` follows from it and the world size.
    pub global_batch: usize,
    /// Data-parallel ranks (processes) the run trains on: set from the launcher's
    /// environment (`WORLD_SIZE`), never a flag.
    pub world_size: usize,
    /// Seconds one collective (the gradient all-reduce) may take before every rank stops
    /// (`--collective-timeout`): a dead or hung rank must not leave the others waiting forever.
    pub collective_timeout: u64,
    /// Seconds the ranks wait for each other to join at start-up (`--rendezvous-timeout`).
    pub rendezvous_timeout: u64,
    /// Optimizer steps of the whole run (a resumed run continues up to this count).
    pub steps: usize,
    /// Peak learning rate (the schedule scales it).
    pub lr: f32,
    /// `adamw`, `adam` or `sgd`.
    pub optimizer: OptimizerKind,
    /// Weight decay λ: decoupled for AdamW (`θ ← θ − lr·λ·θ`), added to the gradient for Adam
    /// and SGD.
    pub weight_decay: f32,
    /// Adam's second-moment decay β₂ (β₁ is 0.9).
    pub beta2: f32,
    /// SGD momentum (0.9). With momentum 0 and weight decay 0, the per-token tables
    /// (`per-token`, `token-scale`) are updated row-sparsely, which is exact.
    pub momentum: f32,
    /// Row-sparse ("lazy") updates of the per-token tables for Adam/AdamW and SGD with
    /// momentum or decay: rows of tokens absent from the batch, and their optimizer state,
    /// stay frozen. An approximation of the dense update (see `nn::optim::SparseRows`).
    pub lazy_tables: bool,
    /// `cosine` (linear warmup + cosine), `noam`, `constant`, `linear`, `onecycle`.
    pub schedule: ScheduleKind,
    /// Warmup steps of the schedule (linear warmup to `lr` for `cosine`).
    pub warmup: usize,
    /// Global gradient-norm clip (0 disables).
    pub grad_clip: f32,
    /// `random` (seeded windows) or `sequential`.
    pub sampling: Sampling,
    /// Steps between validation passes (0: only at the end).
    pub eval_every: usize,
    /// Validation batches per pass.
    pub eval_batches: usize,
    /// Steps between checkpoints (0: only at the end).
    pub save_every: usize,
    /// Steps between training-loss lines of `metrics.jsonl` and the console.
    pub log_every: usize,
    /// Seeds the initialisation and the batch order.
    pub seed: u64,
    /// Where the checkpoint, config and metrics are written.
    pub out_dir: PathBuf,
    /// bf16 inputs to the GPU's matrix products (f32 accumulation, master weights and
    /// optimizer state); needs a CUDA `device`.
    pub bf16: bool,
    /// Where the run computes (`--device`). Not part of the saved config: a run may resume
    /// on another device, and results do not depend on it beyond rounding.
    #[serde(skip, default = "crate::device::cpu")]
    pub device: Device,
    /// Replay each step as a CUDA graph after capturing it once (`--cuda-graph`; single-GPU
    /// runs with Adam/AdamW). Not part of the saved config either: it changes how the steps
    /// are queued, not what they compute (the losses are the eager run's, bit for bit).
    #[serde(skip)]
    pub cuda_graph: bool,
}

impl Default for TrainConfig {
    /// The built-in default: llama-tiny + Transponder on tinyshakespeare, byte-level,
    /// sized to finish in a few minutes on two CPU cores.
    fn default() -> Self {
        let model = LlamaConfig::default();
        TrainConfig {
            model: "llama-tiny".into(),
            variant: "transponder".into(),
            d_model: 0,
            d_basis: 64,
            d_ctx: 64,
            ccl_mode: "token".into(),
            ccl_ablation: "none".into(),
            rank: model.rank,
            coverage: model.coverage,
            post_ln: model.post_ln,
            phi: model.phi,
            text: None,
            train_data: None,
            val_data: None,
            data_format: DataFormat::Auto,
            tokenizer: "byte".into(),
            batch_size: 16,
            seq_len: 128,
            grad_accum: 1,
            global_batch: 0,
            world_size: 1,
            collective_timeout: 600,
            rendezvous_timeout: 300,
            steps: 300,
            lr: 3e-3,
            optimizer: OptimizerKind::AdamW,
            weight_decay: 0.01,
            beta2: 0.95,
            momentum: 0.9,
            lazy_tables: false,
            schedule: ScheduleKind::Cosine,
            warmup: 30,
            grad_clip: 1.0,
            sampling: Sampling::Random,
            eval_every: 100,
            eval_batches: 8,
            save_every: 100,
            log_every: 10,
            seed: 1337,
            out_dir: PathBuf::from("runs/default"),
            bf16: false,
            device: Device::Cpu,
            cuda_graph: false,
        }
    }
}

/// `base` with the keys of the JSON config file at `path` laid over it. Errors name the file
/// and, for a value of the wrong type or an unknown key, the key.
pub fn overlay_config_file<T: Serialize + DeserializeOwned>(base: &T, path: &Path) -> Result<T> {
    let text = std::fs::read(path).with_context(|| format!("reading config {}", path.display()))?;
    let keys: serde_json::Map<String, Value> = serde_json::from_slice(&text)
        .with_context(|| format!("parsing config {} (a JSON object of settings)", path.display()))?;
    let base = serde_json::to_value(base).context("serialising the base config")?;
    let with = |keys: &mut dyn Iterator<Item = (&String, &Value)>| {
        let mut merged = base.clone();
        if let Some(fields) = merged.as_object_mut() {
            fields.extend(keys.map(|(k, v)| (k.clone(), v.clone())));
        }
        serde_json::from_value::<T>(merged)
    };
    with(&mut keys.iter()).map_err(|error| {
        // serde's message names the expected type, not the field: find the key that fails alone.
        match keys.iter().find(|&entry| with(&mut std::iter::once(entry)).is_err()) {
            Some((key, _)) => anyhow!("parsing config {}: key `{key}`: {error}", path.display()),
            None => anyhow!("parsing config {}: {error}", path.display()),
        }
    })
}

/// Most tokens one optimizer step may take (2^32): far beyond any batch that fits in memory,
/// small enough that no count derived from it overflows.
pub const MAX_TOKENS_PER_STEP: usize = 1 << 32;

impl TrainConfig {
    /// Reads a JSON config file (unknown keys are errors, missing keys take defaults).
    pub fn from_file(path: &Path) -> Result<TrainConfig> {
        TrainConfig::default().overlaid_with_file(path)
    }

    /// `self` with the keys the JSON config file at `path` names replaced by the file's
    /// values; keys it does not name keep `self`'s. Unknown keys and wrong types are errors
    /// naming the file and the key.
    pub fn overlaid_with_file(&self, path: &Path) -> Result<TrainConfig> {
        let mut config = overlay_config_file(self, path)?;
        config.device = self.device;
        Ok(config)
    }

    /// Checks that the data flags (or config keys) name one source: token files
    /// (`train_data`, optionally `val_data`) or a text (`text`, or the built-in corpus).
    pub fn check_data_source(&self) -> Result<()> {
        if self.text.is_some() && self.train_data.is_some() {
            bail!("--text and --train-data (config keys `text`, `train_data`) both name the training data: give one");
        }
        if self.val_data.is_some() && self.train_data.is_none() {
            bail!(
                "--val-data (config key `val_data`) needs --train-data: a --text corpus (or the built-in one) \
                 holds out its own validation split"
            );
        }
        Ok(())
    }

    /// This config on `world_size` ranks: with `global_batch` set, `grad_accum` becomes
    /// `global_batch / (world_size × batch_size)` (an error when that does not divide);
    /// else `global_batch` becomes `world_size × batch_size × grad_accum`.
    pub fn for_world(&self, world_size: usize) -> Result<TrainConfig> {
        let mut config = self.clone();
        config.world_size = world_size;
        let per_micro_batch = world_size.saturating_mul(self.batch_size);
        if self.global_batch == 0 {
            config.global_batch = per_micro_batch.saturating_mul(self.grad_accum);
        } else {
            if per_micro_batch == 0 || !self.global_batch.is_multiple_of(per_micro_batch) {
                bail!(
                    "global batch {} is not a multiple of world size {world_size} × batch size {} = {per_micro_batch} \
                     sequences per micro-batch: change --global-batch or --batch-size",
                    self.global_batch,
                    self.batch_size
                );
            }
            config.grad_accum = self.global_batch / per_micro_batch;
        }
        Ok(config)
    }

    /// Checks every field that could otherwise fail late, naming the field and the valid values.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in [
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
            ("grad_accum", self.grad_accum),
            ("steps", self.steps),
            ("log_every", self.log_every),
            ("eval_batches", self.eval_batches),
            ("world_size", self.world_size),
            ("collective_timeout", self.collective_timeout as usize),
            ("rendezvous_timeout", self.rendezvous_timeout as usize),
        ] {
            if value == 0 {
                bail!("{name} must be at least 1");
            }
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("lr must be a positive number, got {}", self.lr);
        }
        if !(0.0..1.0).contains(&self.momentum) {
            bail!("momentum must be in [0, 1), got {}", self.momentum);
        }
        if self.grad_clip < 0.0 || !self.grad_clip.is_finite() {
            bail!("grad_clip must be ≥ 0 (0 disables), got {}", self.grad_clip);
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            bail!("weight_decay must be ≥ 0, got {}", self.weight_decay);
        }
        if !(0.0..1.0).contains(&self.beta2) {
            bail!("beta2 must be in [0, 1), got {}", self.beta2);
        }
        let tokens_per_step = self.batch_size.checked_mul(self.seq_len).and_then(|n| n.checked_mul(self.grad_accum));
        if tokens_per_step.is_none_or(|n| n > MAX_TOKENS_PER_STEP) {
            bail!(
                "batch_size × seq_len × grad_accum = {} × {} × {} exceeds {MAX_TOKENS_PER_STEP} tokens per step",
                self.batch_size,
                self.seq_len,
                self.grad_accum
            );
        }
        // A global batch the world size and batch size cannot make is an error naming both.
        self.for_world(self.world_size)?;
        crate::device::check_bf16(self.device, self.bf16)?;
        if self.cuda_graph {
            self.check_cuda_graph()?;
        }
        if self.lazy_tables && self.device != Device::Cpu {
            bail!("lazy_tables (row-sparse table updates) runs on the CPU only; drop it for --device cuda");
        }
        Ok(())
    }

    /// Errors unless a run with `--cuda-graph` can capture its step: a GPU in a build with the
    /// `cuda` feature, one process, and Adam/AdamW (whose update reads its per-step constants
    /// and its guard on the device).
    fn check_cuda_graph(&self) -> Result<()> {
        if !cfg!(feature = "cuda") {
            bail!("--cuda-graph needs a build with --features cuda");
        }
        if !matches!(self.device, Device::Cuda(_)) {
            bail!("--cuda-graph replays the step on a GPU: add --device cuda");
        }
        if self.world_size > 1 {
            bail!("--cuda-graph runs on one GPU: data parallel (world size {}) is not captured", self.world_size);
        }
        if self.optimizer == OptimizerKind::Sgd {
            bail!("--cuda-graph needs --optimizer adam or adamw (SGD reads its step guard on the host)");
        }
        Ok(())
    }

    /// The learning-rate schedule this config names, with its warmup and total steps.
    pub fn schedule(&self) -> nn::optim::Schedule {
        use nn::optim::Schedule;
        match self.schedule {
            ScheduleKind::Cosine => Schedule::WarmupCosine { warmup: self.warmup, total: self.steps, min_ratio: 0.1 },
            ScheduleKind::Noam => Schedule::Noam { warmup: self.warmup },
            ScheduleKind::Constant => Schedule::Constant,
            ScheduleKind::Linear => Schedule::LinearDecay { total: self.steps, end_ratio: 0.01 },
            ScheduleKind::OneCycle => Schedule::OneCycle { total: self.steps, pct_start: 0.3 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        assert!(TrainConfig::default().validate().is_ok());
        let bad = TrainConfig { steps: 0, ..TrainConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("steps"));
        let bad = TrainConfig { lr: f32::NAN, ..TrainConfig::default() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn modulator_fields_default_to_the_model_config_and_pass_through() {
        let (model, c) = (LlamaConfig::default(), TrainConfig::default());
        assert_eq!((c.rank, &c.coverage, c.post_ln, &c.phi), (model.rank, &model.coverage, model.post_ln, &model.phi));
        // A config.json written before these fields existed still loads.
        let old: TrainConfig = serde_json::from_str(r#"{"variant": "pre-ln", "steps": 5}"#).unwrap();
        assert_eq!((old.rank, old.coverage.as_str()), (8, "all"));
        let set = TrainConfig { rank: 4, coverage: "attn".into(), post_ln: true, phi: "silu".into(), ..c };
        let m = crate::train::model_config(&set, 256).unwrap();
        assert_eq!((m.rank, m.coverage.as_str(), m.post_ln, m.phi.as_str()), (4, "attn", true, "silu"));
    }

    #[test]
    fn the_global_batch_fixes_grad_accum_for_every_world_size() {
        let fixed = TrainConfig { batch_size: 2, global_batch: 8, ..TrainConfig::default() };
        for (world, accum) in [(1, 4), (2, 2), (4, 1)] {
            let config = fixed.for_world(world).unwrap();
            assert_eq!((config.grad_accum, config.world_size), (accum, world));
            config.validate().unwrap();
        }
        let msg = fixed.for_world(3).unwrap_err().to_string();
        assert!(msg.contains("not a multiple of world size 3 × batch size 2"), "{msg}");
        let derived = TrainConfig { batch_size: 2, grad_accum: 3, ..TrainConfig::default() };
        assert_eq!(derived.for_world(2).unwrap().global_batch, 12);
    }

    #[test]
    fn unknown_keys_in_a_file_are_errors() {
        let dir = std::env::temp_dir().join(format!("transponder-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.json");
        std::fs::write(&path, r#"{"steps": 5, "stepz": 3}"#).unwrap();
        let msg = format!("{:#}", TrainConfig::from_file(&path).unwrap_err());
        assert!(msg.contains("stepz"), "{msg}");
        std::fs::write(&path, r#"{"steps": 5}"#).unwrap();
        assert_eq!(TrainConfig::from_file(&path).unwrap().steps, 5);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
