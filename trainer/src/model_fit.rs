//! A checkpoint's model config checked against its tensors before a model is built from it.
//! The metadata is untrusted and a model is allocated in full from it, so a crafted
//! `d_model` of 10^9 aborted the process before this check. Every size that shapes a weight
//! must agree with the tensors (the embedding's `[vocab_size, d_model]`, the number of
//! layers, the MLP width) or at least be no larger than the largest tensor dimension (the
//! modulators' ranks and widths), so that the model built is no larger than the file's
//! tensors allow. Names are checked after the build ([`crate::checkpoint::load_weights`]).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{bail, ensure, Result};
use models::llama::LlamaConfig;

use crate::safetensors_io::NamedTensor;

const EMBEDDING: &str = "model.embed_tokens.weight";
const LAYER_PREFIX: &str = "model.layers.";
const FIRST_GATE: &str = "model.layers.0.mlp.gate_proj.weight";

/// Errors, naming the file and the setting, unless `config` (the metadata of the checkpoint
/// at `path`) describes a model whose weights fit `weights`.
pub fn check_model_config(path: &Path, config: &LlamaConfig, weights: &[NamedTensor]) -> Result<()> {
    config.validate()?;
    let file = path.display();
    let shape_of = |name: &str| weights.iter().find(|t| t.name == name).map(|t| t.shape.as_slice());
    let Some(embedding) = shape_of(EMBEDDING) else {
        bail!("checkpoint {file} has no tensor '{EMBEDDING}': not a language model of this engine");
    };
    ensure!(
        embedding == [config.vocab_size, config.d_model],
        "checkpoint {file}: its model config says vocab_size {} × d_model {}, but '{EMBEDDING}' has shape {embedding:?}",
        config.vocab_size,
        config.d_model
    );
    let layers: BTreeSet<&str> =
        weights.iter().filter_map(|t| t.name.strip_prefix(LAYER_PREFIX)?.split('.').next()).collect();
    ensure!(
        layers.len() == config.n_layers,
        "checkpoint {file}: its model config says n_layers {}, but it holds tensors of {} layers",
        config.n_layers,
        layers.len()
    );
    if let Some(gate) = shape_of(FIRST_GATE) {
        ensure!(
            gate.first() == Some(&config.ffn_hidden),
            "checkpoint {file}: its model config says ffn_hidden {}, but '{FIRST_GATE}' has shape {gate:?}",
            config.ffn_hidden
        );
    }
    let largest = weights.iter().flat_map(|t| t.shape.iter().copied()).max().unwrap_or(0);
    for (name, value) in [
        ("ffn_hidden", config.ffn_hidden),
        ("n_heads", config.n_heads),
        ("rank", config.rank),
        ("comt_hidden", config.comt_hidden),
        ("laurel_rank", config.laurel_rank),
        ("per_token_rank", config.per_token_rank),
        ("d_basis", config.d_basis),
        ("d_ctx", config.d_ctx),
    ] {
        ensure!(
            value <= largest,
            "checkpoint {file}: its model config's {name} {value} exceeds every tensor dimension (at most \
             {largest}): the metadata does not describe these tensors"
        );
    }
    Ok(())
}
