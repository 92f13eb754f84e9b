//! Loading a trained model back, text generation with temperature and top-k, and the
//! Hugging Face export.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use autograd::no_grad;
use models::llama::{Llama, LlamaConfig};
use nn::Module;
use tensor::Rng;

use crate::checkpoint;
use crate::safetensors_io::{atomic_write, save_tensors, TensorSlice};

/// A model rebuilt from a checkpoint file, with its config.
pub fn load_model(path: &Path) -> Result<(Llama, LlamaConfig)> {
    let saved = checkpoint::load(path)?;
    let config: LlamaConfig = serde_json::from_str(&saved.model_config).context("checkpoint model config")?;
    let model = Llama::new(&config, 0)?;
    checkpoint::load_weights(&model, &saved.weights)?;
    Ok((model, config))
}

/// Extends `prompt` by `new_tokens` sampled tokens. Each step re-runs the model over the
/// last `seq_len` tokens (no KV cache yet), on the model's device, and samples on the host
/// (only the last position's logits come back) from `softmax(logits / temperature)`
/// restricted to the `top_k` most likely tokens (0 = all), seeded.
pub fn sample(
    model: &Llama,
    config: &LlamaConfig,
    prompt: &[u32],
    new_tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("sampling needs a prompt of at least one token");
    }
    if temperature <= 0.0 || !temperature.is_finite() {
        bail!("temperature must be positive, got {temperature}");
    }
    let mut rng = Rng::new(seed);
    let mut tokens = prompt.to_vec();
    for _ in 0..new_tokens {
        // The context grows by a token per step, so this step's buffer sizes do not recur.
        let _release_pool = tensor::pool::ReleaseOnDrop;
        let context = &tokens[tokens.len().saturating_sub(config.seq_len)..];
        let logits = no_grad(|| model.forward(context, 1, context.len()))?.value();
        let last = logits.narrow(0, context.len() - 1, 1)?.to_host()?.to_vec();
        tokens.push(pick(&last, temperature, top_k, &mut rng));
    }
    Ok(tokens)
}

/// Samples one index from `logits` with temperature and top-k.
fn pick(logits: &[f32], temperature: f32, top_k: usize, rng: &mut Rng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = logits[order[0]];
    let weights: Vec<f64> = order.iter().map(|&i| (((logits[i] - max) / temperature) as f64).exp()).collect();
    let mut target = rng.uniform() as f64 * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        target -= w;
        if target <= 0.0 {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

/// Writes `config.json` + `model.safetensors` in the layout of Hugging Face's
/// `LlamaForCausalLM`. Only the baseline architecture (`pre-ln`) has that layout.
pub fn export_hf(model: &Llama, config: &LlamaConfig, out_dir: &Path) -> Result<()> {
    if config.variant != "pre-ln" {
        bail!("only the pre-ln baseline matches LlamaForCausalLM; this model is '{}'", config.variant);
    }
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let hf = serde_json::json!({
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
    atomic_write(&out_dir.join("config.json"), serde_json::to_string_pretty(&hf)?.as_bytes())?;
    let owned: Vec<(String, Vec<usize>, Vec<f32>)> = model
        .named_parameters()
        .into_iter()
        .map(|p| -> Result<(String, Vec<usize>, Vec<f32>)> {
            let v = p.var.value().to_host()?;
            Ok((p.name, v.shape().to_vec(), v.to_vec()))
        })
        .collect::<Result<_>>()?;
    let slices: Vec<TensorSlice> = owned.iter().map(|(name, shape, data)| TensorSlice { name, shape, data }).collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    save_tensors(&out_dir.join("model.safetensors"), &slices, &metadata)
}
