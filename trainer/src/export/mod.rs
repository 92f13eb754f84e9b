//! `transponder export`: a checkpoint as a Hugging Face model directory.
//!
//! - The plain baseline (`pre-ln` without `post_ln`) has exactly `LlamaForCausalLM`'s layout:
//!   `config.json` + `model.safetensors`, loadable with no code of ours.
//! - Every other variant writes the same two files plus `modeling_transponder.py` (a PyTorch
//!   implementation of SPEC §1-5, compiled into this binary), and `config.json` names it in
//!   `auto_map`, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`
//!   loads it. The engine's model config travels as `config.json`'s `transponder` entry.
//!
//! `modeling_transponder.py` implements every variant in [`models::llama::VARIANTS`] with every option
//! (coverage, φ, fixed α, post-ln, CCL modes and ablations, per-token rank); a test keeps the
//! two lists in step, and the Python refuses a variant it does not know, naming it.
//!
//! Weights keep the engine's parameter names (Hugging Face's LLaMA names, extended by each
//! variant's; see `models::llama`), written as f32.
//!
//! The files replace a previous export as a set: all are staged on disk before any is renamed
//! ([`crate::atomic`]), so a full disk or a kill leaves the previous export whole. A directory
//! holding anything but a previous export (a run directory, someone's files) is refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use models::llama::{Llama, LlamaConfig, Variant};
use nn::Module;

use crate::atomic::{commit_all, stage, Staged};
use crate::dir_lock::LOCK_FILE;
use crate::run_dir::remove_if_present;
use crate::safetensors_io::{stage_tensors, TensorSlice};

/// The Hugging Face config of an export.
const CONFIG_FILE: &str = "config.json";
/// The weights of an export.
const WEIGHTS_FILE: &str = "model.safetensors";

/// The PyTorch implementation written beside the weights of a non-baseline export.
pub const MODELING_SOURCE: &str = include_str!("modeling_transponder.py");
/// Its file name (the module `auto_map` refers to).
pub const MODELING_FILE: &str = "modeling_transponder.py";

/// Which Hugging Face class an export loads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportKind {
    /// `LlamaForCausalLM`, no remote code.
    Llama,
    /// `TransponderForCausalLM` from the directory's `modeling_transponder.py`.
    Transponder,
}

/// The files an export wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    /// How it loads.
    pub kind: ExportKind,
    /// Every file written, in order.
    pub files: Vec<PathBuf>,
}

/// Writes `model` (built from `config`) into `out_dir` as described in the module doc.
pub fn export_hf(model: &Llama, config: &LlamaConfig, out_dir: &Path) -> Result<Exported> {
    let variant = config.variant()?;
    let kind = if variant == Variant::PreLn && !config.post_ln { ExportKind::Llama } else { ExportKind::Transponder };
    check_export_target(out_dir)?;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let config_json = serde_json::to_string_pretty(&hf_config(config, kind)?)?;
    let mut staged = vec![stage_bytes(&out_dir.join(CONFIG_FILE), config_json.as_bytes())?];
    if kind == ExportKind::Transponder {
        staged.push(stage_bytes(&out_dir.join(MODELING_FILE), MODELING_SOURCE.as_bytes())?);
    }
    staged.push(stage_weights(model, &out_dir.join(WEIGHTS_FILE))?);
    let mut files = vec![out_dir.join(CONFIG_FILE)];
    if kind == ExportKind::Transponder {
        files.push(out_dir.join(MODELING_FILE));
    }
    files.push(out_dir.join(WEIGHTS_FILE));
    commit_all(staged)?;
    if kind == ExportKind::Llama {
        // A previous non-baseline export's code has no config.json naming it any more.
        remove_if_present(&out_dir.join(MODELING_FILE))?;
    }
    Ok(Exported { kind, files })
}

/// Errors unless `out_dir` is missing, empty or a previous export: only export files (and
/// the directory lock) in it, its `config.json` a Hugging Face one.
fn check_export_target(out_dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out_dir) else { return Ok(()) };
    let refuse = |what: String| {
        anyhow::anyhow!(
            "{} is not empty and not a previous export ({what}): export into a new or empty directory",
            out_dir.display()
        )
    };
    let mut foreign = Vec::new();
    for entry in entries {
        let name = entry.with_context(|| format!("listing {}", out_dir.display()))?.file_name();
        if ![CONFIG_FILE, WEIGHTS_FILE, MODELING_FILE, LOCK_FILE].iter().any(|f| name == *f) {
            foreign.push(name.to_string_lossy().into_owned());
        }
    }
    if !foreign.is_empty() {
        foreign.sort();
        return Err(refuse(format!("it holds {}", foreign.join(", "))));
    }
    let config_path = out_dir.join(CONFIG_FILE);
    if let Ok(text) = std::fs::read_to_string(&config_path) {
        let config: Option<serde_json::Value> = serde_json::from_str(&text).ok();
        if config.is_none_or(|c| c.get("architectures").is_none()) {
            return Err(refuse(format!("its {CONFIG_FILE} is not a Hugging Face config")));
        }
    }
    Ok(())
}

/// `bytes` staged as the new contents of `path`.
fn stage_bytes(path: &Path, bytes: &[u8]) -> Result<Staged> {
    stage(path, |tmp| std::fs::write(tmp, bytes).with_context(|| format!("writing {}", tmp.display())))
}

/// `config.json`: `LlamaConfig`'s fields; for a Transponder export also `auto_map` and the
/// engine's config under `transponder`.
fn hf_config(config: &LlamaConfig, kind: ExportKind) -> Result<serde_json::Value> {
    let mut hf = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float32",
    });
    if kind == ExportKind::Transponder {
        hf["architectures"] = serde_json::json!(["TransponderForCausalLM"]);
        hf["model_type"] = serde_json::json!("transponder");
        hf["auto_map"] = serde_json::json!({
            "AutoConfig": "modeling_transponder.TransponderConfig",
            "AutoModelForCausalLM": "modeling_transponder.TransponderForCausalLM",
        });
        hf["transponder"] = serde_json::to_value(config)?;
    }
    Ok(hf)
}

/// Every parameter of `model` (downloaded from its device), staged as one safetensors file.
fn stage_weights(model: &Llama, path: &Path) -> Result<Staged> {
    let owned: Vec<(String, Vec<usize>, Vec<f32>)> = model
        .named_parameters()
        .into_iter()
        .map(|p| -> Result<(String, Vec<usize>, Vec<f32>)> {
            let v = p.var.value().to_host().with_context(|| format!("downloading '{}'", p.name))?;
            Ok((p.name, v.shape().to_vec(), v.to_vec()))
        })
        .collect::<Result<_>>()?;
    let slices: Vec<TensorSlice> = owned.iter().map(|(name, shape, data)| TensorSlice { name, shape, data }).collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    stage_tensors(path, &slices, &metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_python_file_implements_every_variant() {
        for (_, name) in models::llama::VARIANTS {
            assert!(MODELING_SOURCE.contains(&format!("\"{name}\"")), "{MODELING_FILE} does not name {name}");
        }
    }

    #[test]
    fn a_transponder_config_names_its_code_and_carries_the_engine_config() {
        let config = LlamaConfig { variant: "comt".into(), coverage: "attn".into(), ..LlamaConfig::default() };
        let hf = hf_config(&config, ExportKind::Transponder).unwrap();
        assert_eq!(hf["auto_map"]["AutoModelForCausalLM"], "modeling_transponder.TransponderForCausalLM");
        assert_eq!(hf["transponder"]["variant"], "comt");
        assert_eq!(hf["transponder"]["coverage"], "attn");
        let plain = hf_config(&LlamaConfig::default(), ExportKind::Llama).unwrap();
        assert_eq!(plain["architectures"][0], "LlamaForCausalLM");
        assert!(plain.get("auto_map").is_none());
    }
}
