//! Parameters, FLOPs per token and throughput: the columns of CCL Table 2.
//!
//! FLOPs per token count `2·m·n` for every `m × n` weight matrix applied to each token (every
//! projection, modulator, gate and CCL matrix and the LM head: every rank-2 parameter except
//! the lookup tables `embed_tokens` and `token_scale`), `2·r²` for a per-token transform's
//! `r × r` table entry, and the attention products `QKᵀ` and `AV` at `2·T·C` each per layer,
//! over the full window T (the dense upper bound, as THOP reports; a causal kernel does about
//! half). Norms, activations and gate products are elementwise and left out, as in THOP.
//!
//! Throughput builds Base-64, CCL-64 and Base-512 from one preset (its depth, heads and FFN
//! ratio, width overridden as `LlamaConfig::with_d_model`), feeds random tokens at batch ×
//! sequence (64 × 64 by default, the paper's setting) and reports the median over
//! `--repeats` timed runs after one warm-up: inference (forward without a graph, the paper's
//! "full-sequence parallel inference") and a training step's forward + backward.

use std::time::Instant;

use anyhow::Result;
use autograd::no_grad;
use models::llama::{Llama, LlamaConfig};
use nn::Module;
use serde::Serialize;
use tensor::{Rng, Tokens};

use super::AnalyzeArgs;
use crate::device::synchronize;

/// The cost columns of one model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCost {
    /// Every trainable scalar of the model.
    pub parameters: usize,
    /// Lookup tables: the token embedding, per-token transform tables, token scales.
    pub embedding_parameters: usize,
    /// `parameters − embedding_parameters`: the count scaling laws use.
    pub non_embedding_parameters: usize,
    /// `matmul_flops_per_token + attention_flops_per_token`.
    pub flops_per_token: u64,
    /// 2 FLOPs per weight of every matrix a token passes through (and per entry of the per-token tables it reads).
    pub matmul_flops_per_token: u64,
    /// The score and value products, `2·2·T·d_model` per layer (T = `seq_len`).
    pub attention_flops_per_token: u64,
    /// The window T the attention term assumes.
    pub seq_len: usize,
}

/// Parameter counts and FLOPs per token of `model` at window `seq`.
pub fn model_cost(model: &Llama, seq: usize) -> ModelCost {
    let (mut parameters, mut embedding, mut matmul) = (0usize, 0usize, 0u64);
    for p in model.named_parameters() {
        let shape = p.var.shape();
        let numel: usize = shape.iter().product();
        parameters += numel;
        let lookup = p.name.ends_with("embed_tokens.weight") || p.name.ends_with("token_scale.weight");
        if p.name.ends_with("per_token.table") {
            embedding += numel;
            matmul += 2 * (shape[1] * shape[2]) as u64;
        } else if lookup {
            embedding += numel;
        } else if shape.len() == 2 {
            matmul += 2 * numel as u64;
        }
    }
    let config = &model.config;
    let attention = (config.n_layers * 2 * 2 * seq * config.d_model) as u64;
    ModelCost {
        parameters,
        embedding_parameters: embedding,
        non_embedding_parameters: parameters - embedding,
        flops_per_token: matmul + attention,
        matmul_flops_per_token: matmul,
        attention_flops_per_token: attention,
        seq_len: seq,
    }
}

/// One row of the throughput table.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputRow {
    /// The model's name in the CCL paper's Table 2 (`Base-64`, `CCL-64`, `Base-512`).
    pub name: String,
    /// The block variant (pre-ln, transponder, ...).
    pub variant: String,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Hidden width of the feed-forward block.
    pub ffn_hidden: usize,
    /// Trainable parameters.
    pub parameters: usize,
    /// Forward FLOPs per token, in millions ([`ModelCost::flops_per_token`]).
    pub mflops_per_token: f64,
    /// Sequences per timed pass.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Forward-only tokens per second (median of the repeats).
    pub inference_tokens_per_second: f64,
    /// Forward and backward (no optimizer step): tokens per second (median of the repeats).
    pub training_tokens_per_second: f64,
}

/// Median seconds of `repeats` runs of `f` after one warm-up.
fn median_seconds(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The three models of CCL Table 2 built from `args.model`.
pub fn table_2_configs(args: &AnalyzeArgs) -> Result<Vec<(&'static str, LlamaConfig)>> {
    let base = LlamaConfig { vocab_size: args.vocab, seq_len: args.seq, ..LlamaConfig::preset(&args.model)? };
    let narrow = base.with_d_model(64);
    let ccl = LlamaConfig { variant: "ccl".into(), d_basis: 64, ..narrow.clone() };
    let configs = vec![("Base-64", narrow), ("CCL-64", ccl), ("Base-512", base.with_d_model(512))];
    for (_, c) in &configs {
        c.validate()?;
    }
    Ok(configs)
}

/// Times Base-64, CCL-64 and Base-512 on `args.device` and prints the table (each timed
/// run waits for the GPU to finish its work).
pub fn throughput(args: &AnalyzeArgs) -> Result<Vec<ThroughputRow>> {
    let (batch, seq) = (args.batch, args.seq);
    let mut rng = Rng::new(0);
    let ids: Vec<u32> = (0..batch * seq).map(|_| rng.below(args.vocab as u64) as u32).collect();
    let targets: Vec<u32> = (0..batch * seq).map(|_| rng.below(args.vocab as u64) as u32).collect();
    // Uploaded once: every model runs on `args.device`.
    let (ids, targets) = (Tokens::new(&ids, args.device)?, Tokens::labels(&targets, args.device)?);
    let tokens = (batch * seq) as f64;
    crate::say!(
        "{:<9} {:>7} {:>12} {:>12} {:>16} {:>16}",
        "model",
        "d_model",
        "params",
        "MFLOPs/tok",
        "infer tok/s",
        "train tok/s"
    );
    let mut rows = Vec::new();
    for (name, config) in table_2_configs(args)? {
        let model = Llama::new(&config, 0)?;
        model.to_device(args.device)?;
        let cost = model_cost(&model, seq);
        let infer = median_seconds(args.repeats, || {
            no_grad(|| model.forward(&ids, batch, seq))?;
            synchronize(args.device)
        })?;
        let train = median_seconds(args.repeats, || {
            model.loss(&ids, &targets, batch, seq)?.backward()?;
            for p in model.named_parameters() {
                p.var.zero_grad();
            }
            synchronize(args.device)
        })?;
        let row = ThroughputRow {
            name: name.into(),
            variant: config.variant.clone(),
            d_model: config.d_model,
            ffn_hidden: config.ffn_hidden,
            parameters: cost.parameters,
            mflops_per_token: cost.flops_per_token as f64 / 1e6,
            batch,
            seq,
            inference_tokens_per_second: tokens / infer,
            training_tokens_per_second: tokens / train,
        };
        crate::say!(
            "{:<9} {:>7} {:>12} {:>12.2} {:>16.0} {:>16.0}",
            row.name,
            row.d_model,
            row.parameters,
            row.mflops_per_token,
            row.inference_tokens_per_second,
            row.training_tokens_per_second
        );
        rows.push(row);
    }
    Ok(rows)
}
