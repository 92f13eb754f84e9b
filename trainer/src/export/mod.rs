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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use models::llama::{Llama, LlamaConfig, Variant};
use nn::Module;

use crate::safetensors_io::{atomic_write, save_tensors, TensorSlice};

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
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut files = Vec::new();
    let config_path = out_dir.join("config.json");
    atomic_write(&config_path, serde_json::to_string_pretty(&hf_config(config, kind)?)?.as_bytes())?;
    files.push(config_path);
    if kind == ExportKind::Transponder {
        let modeling_path = out_dir.join(MODELING_FILE);
        atomic_write(&modeling_path, MODELING_SOURCE.as_bytes())?;
        files.push(modeling_path);
    }
    let weights_path = out_dir.join("model.safetensors");
    save_weights(model, &weights_path)?;
    files.push(weights_path);
    Ok(Exported { kind, files })
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

/// Every parameter of `model` (downloaded from its device) into one safetensors file.
fn save_weights(model: &Llama, path: &Path) -> Result<()> {
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
    save_tensors(path, &slices, &metadata)
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
