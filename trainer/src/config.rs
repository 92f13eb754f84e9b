//! The training run's configuration: defaults, a JSON config file, and command-line
//! overrides, validated before anything runs.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use models::llama::LlamaConfig;
use serde::{Deserialize, Serialize};
use tensor::Device;

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
    /// Plain-text corpus tokenized on first use when no token files are given.
    pub text: PathBuf,
    /// Token files (llm.c or nanoGPT format); when unset they are prepared from `text`.
    pub train_data: Option<PathBuf>,
    pub val_data: Option<PathBuf>,
    /// Tokenizer used to prepare `text` (`byte` or `gpt2`).
    pub tokenizer: String,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Micro-batches whose gradients are summed before each optimizer step.
    pub grad_accum: usize,
    pub steps: usize,
    pub lr: f32,
    /// `adamw`, `adam` or `sgd`.
    pub optimizer: String,
    pub weight_decay: f32,
    pub beta2: f32,
    /// SGD momentum (0.9). With momentum 0 and weight decay 0, the per-token tables
    /// (`per-token`, `token-scale`) are updated row-sparsely, which is exact.
    pub momentum: f32,
    /// Row-sparse ("lazy") updates of the per-token tables for Adam/AdamW and SGD with
    /// momentum or decay: rows of tokens absent from the batch, and their optimizer state,
    /// stay frozen. An approximation of the dense update (see `nn::optim::SparseRows`).
    pub lazy_tables: bool,
    /// `cosine` (linear warmup + cosine), `noam`, `constant`, `linear`, `onecycle`.
    pub schedule: String,
    pub warmup: usize,
    /// Global gradient-norm clip (0 disables).
    pub grad_clip: f32,
    /// `random` (seeded windows) or `sequential`.
    pub sampling: String,
    pub eval_every: usize,
    pub eval_batches: usize,
    pub save_every: usize,
    pub log_every: usize,
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
            text: PathBuf::from("data/tinyshakespeare.txt"),
            train_data: None,
            val_data: None,
            tokenizer: "byte".into(),
            batch_size: 16,
            seq_len: 128,
            grad_accum: 1,
            steps: 300,
            lr: 3e-3,
            optimizer: "adamw".into(),
            weight_decay: 0.01,
            beta2: 0.95,
            momentum: 0.9,
            lazy_tables: false,
            schedule: "cosine".into(),
            warmup: 30,
            grad_clip: 1.0,
            sampling: "random".into(),
            eval_every: 100,
            eval_batches: 8,
            save_every: 100,
            log_every: 10,
            seed: 1337,
            out_dir: PathBuf::from("runs/default"),
            bf16: false,
            device: Device::Cpu,
        }
    }
}

/// Valid names, listed in errors.
pub const OPTIMIZERS: &[&str] = &["adamw", "adam", "sgd"];
pub const SCHEDULES: &[&str] = &["cosine", "noam", "constant", "linear", "onecycle"];
pub const SAMPLINGS: &[&str] = &["random", "sequential"];

impl TrainConfig {
    /// Reads a JSON config file (unknown keys are errors, missing keys take defaults).
    pub fn from_file(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }

    /// Checks every field that could otherwise fail late, naming the field and the valid values.
    pub fn validate(&self) -> Result<()> {
        let one_of = |field: &str, value: &str, valid: &[&str]| -> Result<()> {
            if valid.contains(&value) {
                Ok(())
            } else {
                bail!("unknown {field} '{value}'; valid: {}", valid.join(", "))
            }
        };
        one_of("optimizer", &self.optimizer, OPTIMIZERS)?;
        one_of("schedule", &self.schedule, SCHEDULES)?;
        one_of("sampling", &self.sampling, SAMPLINGS)?;
        for (name, value) in [
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
            ("grad_accum", self.grad_accum),
            ("steps", self.steps),
            ("log_every", self.log_every),
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
        crate::device::check_bf16(self.device, self.bf16)?;
        if self.lazy_tables && self.device != Device::Cpu {
            bail!("lazy_tables (row-sparse table updates) runs on the CPU only; drop it for --device cuda");
        }
        Ok(())
    }

    /// The learning-rate schedule this config names.
    pub fn schedule(&self) -> nn::optim::Schedule {
        use nn::optim::Schedule;
        match self.schedule.as_str() {
            "noam" => Schedule::Noam { warmup: self.warmup },
            "constant" => Schedule::Constant,
            "linear" => Schedule::LinearDecay { total: self.steps, end_ratio: 0.01 },
            "onecycle" => Schedule::OneCycle { total: self.steps, pct_start: 0.3 },
            _ => Schedule::WarmupCosine { warmup: self.warmup, total: self.steps, min_ratio: 0.1 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        assert!(TrainConfig::default().validate().is_ok());
        let bad = TrainConfig { optimizer: "lion".into(), ..TrainConfig::default() };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("lion") && msg.contains("adamw"), "{msg}");
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
