//! A model too large for this machine is an error before it is built: an allocation that
//! cannot succeed aborts the process ("memory allocation failed", SIGABRT) rather than
//! returning an error, so `--d-model 1000000` or `train-image --base-width 1000000` must be
//! caught by arithmetic first (and so must a batch whose activations cannot fit). The estimates are lower bounds (the largest terms of each
//! model's parameter count), compared with the machine's memory and swap: a refused model
//! could never have trained here, and every model that fits is let through.

use anyhow::{ensure, Result};
use models::llama::LlamaConfig;

/// Bytes per parameter while training with Adam: the weight, its gradient and two moments.
pub const ADAM_BYTES_PER_PARAMETER: f64 = 16.0;
/// Bytes per parameter while training with SGD and momentum: weight, gradient, momentum.
pub const SGD_BYTES_PER_PARAMETER: f64 = 12.0;

/// A lower bound on a LLaMA's parameters: embeddings and LM head, the attention and MLP
/// matrices, and one `d_model`-wide matrix per projection for each modulator size.
pub fn llama_parameters(config: &LlamaConfig) -> f64 {
    let (v, c, f, l) =
        (config.vocab_size as f64, config.d_model as f64, config.ffn_hidden as f64, config.n_layers as f64);
    let modulator_widths = [config.rank, config.comt_hidden, config.laurel_rank, config.d_basis, config.d_ctx]
        .iter()
        .sum::<usize>() as f64;
    2.0 * v * c + l * (4.0 * c * c + 3.0 * c * f) + l * 7.0 * c * modulator_widths + v * config.per_token_rank as f64
}

/// A lower bound on a ResNet's parameters for a first stage `base_width` channels wide (the
/// narrowest, ResNet-18, holds about 2,700 × width² weights).
pub fn resnet_parameters(base_width: usize) -> f64 {
    1000.0 * (base_width as f64).powi(2)
}

/// A lower bound on the activations one LLaMA micro-batch of `tokens` keeps for its backward
/// pass, in values: the logits and their softmax and gradient (3 × vocabulary per token) and
/// a few `d_model`-wide values per token and layer.
pub fn llama_activations(config: &LlamaConfig, tokens: usize) -> f64 {
    let per_token = 3.0 * config.vocab_size as f64 + 4.0 * (config.d_model * config.n_layers) as f64;
    tokens as f64 * per_token
}

/// Errors, naming `what`, when `parameters` at `bytes_per_parameter` plus `activations`
/// (4-byte values) exceed this machine's memory and swap (unknown memory lets all through).
pub fn check_fits(what: &str, parameters: f64, bytes_per_parameter: f64, activations: f64) -> Result<()> {
    let Some(available) = machine_memory_bytes() else { return Ok(()) };
    let needed = parameters * bytes_per_parameter + activations * 4.0;
    ensure!(
        needed <= available as f64,
        "{what} needs at least {:.1} GB to train ({:.3e} parameters, {:.3e} activation values), more than this \
         machine's {:.1} GB of memory and swap: choose smaller sizes",
        needed / 1e9,
        parameters,
        activations,
        available as f64 / 1e9
    );
    Ok(())
}

/// MemTotal + SwapTotal from `/proc/meminfo`, in bytes; `None` where it cannot be read.
fn machine_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        info.lines().find_map(|line| line.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse().ok())
    };
    Some((kib("MemTotal:")? + kib("SwapTotal:").unwrap_or(0)) * 1024)
}
