//! The LLaMA decoder of SPEC §6 with every contextual-modulator variant and baseline:
//! token embedding, N [`DecoderBlock`]s, a final norm and an untied LM head, no biases.
//!
//! Parameter names follow Hugging Face's `LlamaForCausalLM` (`model.embed_tokens.weight`,
//! `model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.mlp.gate_proj.weight`,
//! `model.layers.{i}.input_layernorm.weight`, `model.norm.weight`, `lm_head.weight`), so a
//! baseline checkpoint loads in `transformers`. Extra parameters sit under the layer they
//! gate: `...q_proj.modulator_channel.A`, `...q_proj.modulator_scalar.alpha`,
//! `...q_proj.modulator.w1` (CoMT), `...q_proj.output_gate.weight` (ALL-Gate),
//! `...self_attn.sdpa_gate.weight`, `...self_attn.modulator_scalar.A` (path-level),
//! `model.layers.{i}.resweight`, `attn_laurel.*`, `laurel_pa.gamma`, `per_token.*`,
//! `token_scale.weight`; CCL (`ccl`): `...mlp.context.weight`, `...mlp.gate_proj.basis.weight`,
//! `...mlp.gate_proj.mix.weight`, `...mlp.gate_proj.gate_basis.weight`, ....
//!
//! Init: embeddings and base linear weights N(0, 0.02²) (Hugging Face's
//! `initializer_range`), norm gains 1, modulators as SPEC §1. The `rezero`, `per-token`
//! (U = 0), `laurel-lr` (B = 0) and `laurel-pa` (γ = 0) variants start with some exactly
//! zero gradients by construction (every parameter still gets a gradient tensor).

mod block;
mod cache;
mod config;
mod ffn;
mod trace;
mod variant;

pub use block::DecoderBlock;
pub use cache::{BlockCache, DecodeCache};
pub use config::{LlamaConfig, PRESETS};
pub use ffn::FeedForward;
pub use trace::GateTrace;
pub use variant::{Coverage, Variant, COVERAGES, TRANSPONDER_ALIAS, VARIANTS};

use autograd::{no_grad, Var};
use nn::init::WeightInit;
use nn::layers::Norm;
use nn::layers::{DyT, Embedding, Linear};
use nn::modulator::Stream;
use nn::Module;
use tensor::{Rng, Tokens};

use crate::{Error, Result};

/// A LLaMA language model built from a [`LlamaConfig`].
pub struct Llama {
    /// The (validated) config it was built from.
    pub config: LlamaConfig,
    /// `model.embed_tokens`: `[V, C]`.
    pub embed_tokens: Embedding,
    /// `model.layers.{i}`.
    pub layers: Vec<DecoderBlock>,
    /// Final norm (DyT for the `dyt` variant).
    pub norm: Norm,
    /// Untied output projection `[V, C]`.
    pub lm_head: Linear,
}

/// Whether some block mixes the activations before its input (LAuReL-PA's γ): the model then
/// keeps every block's output and adds it up.
fn mixes_earlier(layers: &[DecoderBlock]) -> bool {
    layers.iter().any(|block| block.residual.gamma.is_some())
}

impl Llama {
    /// Validates `config` and initialises every parameter from `seed` (bit-reproducible).
    pub fn new(config: &LlamaConfig, seed: u64) -> Result<Llama> {
        let parsed = config.parse()?;
        let mut rng = Rng::new(seed);
        let (d, vocab) = (config.d_model, config.vocab_size);
        let embed_tokens = Embedding::new(vocab, d, config.init_std, &mut rng);
        let mut layers = (0..config.n_layers)
            .map(|l| DecoderBlock::new(config, &parsed, l, &mut rng))
            .collect::<Result<Vec<_>>>()?;
        let norm = if parsed.variant == Variant::Dyt { Norm::Dyt(DyT::new(d)) } else { Norm::rms(d, config.norm_eps) };
        // Where the residual stream's fused add + RMSNorm alone reads the sublayers' outputs
        // (each block's and, after the last, the final norm: no LAuReL-PA activations either),
        // their output projections store them in bf16 under bf16 products, as autocast does.
        if !mixes_earlier(&layers) && matches!(norm, Norm::Rms(_)) {
            layers.iter_mut().for_each(DecoderBlock::store_fused_outputs_in_bf16);
        }
        let lm_head = WeightInit::Normal { std: config.init_std }.linear(d, vocab, &mut rng);
        Ok(Llama { config: config.clone(), embed_tokens, layers, norm, lm_head })
    }

    /// Logits `[B·T, V]` for the row-major token ids `ids[B·T]` of `batch` sequences of `seq`
    /// (on the model's device, [`Module::device`]: every op of the pass reads the same ids).
    pub fn forward(&self, ids: &Tokens, batch: usize, seq: usize) -> Result<Var> {
        Ok(self.lm_head.forward(&self.hidden(ids, batch, seq)?)?)
    }

    /// The final norm's output `[B·T, C]`: the LM head's input, for `ids` as [`Llama::forward`].
    fn hidden(&self, ids: &Tokens, batch: usize, seq: usize) -> Result<Var> {
        self.forward_with(ids, batch, seq, |block, x, earlier, _| block.forward(x, ids, earlier))
    }

    /// Logits `[B·T, V]` for `seq` new tokens of each of `batch` sequences (`ids[B·T]`
    /// row-major), sequence `i` continuing at position `cache.lengths()[i]`; `cache` gains
    /// the new positions. The logits equal those [`Llama::forward`] gives at the same
    /// positions of the whole sequences. Inference only: runs without the autograd tape.
    pub fn forward_cached(&self, ids: &Tokens, batch: usize, seq: usize, cache: &mut DecodeCache) -> Result<Var> {
        if cache.batch() != batch || cache.blocks.len() != self.layers.len() {
            return Err(Error::Config(format!(
                "decode cache for {} sequences and {} blocks used with batch {batch} of a {}-block model",
                cache.batch(),
                cache.blocks.len(),
                self.layers.len()
            )));
        }
        no_grad(|| {
            let h = self.forward_with(ids, batch, seq, |block, x, earlier, l| {
                block.forward_cached(x, ids, earlier, &mut cache.blocks[l])
            })?;
            Ok(self.lm_head.forward(&h)?)
        })
    }

    /// Embedding, `run_block(block, residual stream, earlier activations, index)` for each
    /// block and the final norm: the LM head's input `[B·T, C]`. The last block's residual
    /// add runs fused with the final RMSNorm ([`Stream::normed`]).
    fn forward_with(
        &self,
        ids: &Tokens,
        batch: usize,
        seq: usize,
        mut run_block: impl FnMut(&DecoderBlock, &Stream, &[Var], usize) -> Result<Stream>,
    ) -> Result<Var> {
        if ids.len() != batch * seq || ids.is_empty() {
            return Err(Error::Config(format!("{} token ids given for batch {batch} × seq {seq}", ids.len())));
        }
        let embedded = self.embed_tokens.forward(ids, &[batch, seq])?;
        // Activations x_0 (embedding), x_1, ...: LAuReL-PA mixes the ones before a block's
        // input. Kept only when a block reads them (which returns its output added).
        let mixes_earlier = mixes_earlier(&self.layers);
        let mut activations = vec![embedded.clone()];
        let mut x = Stream::new(embedded);
        for (l, block) in self.layers.iter().enumerate() {
            let earlier = if mixes_earlier { &activations[..l] } else { &[] };
            x = run_block(block, &x, earlier, l)?;
            if mixes_earlier {
                let value = x.value()?;
                activations.push(value.clone());
                x = Stream::new(value);
            }
        }
        let (_, h) = x.normed(&self.norm)?;
        Ok(h.reshape(&[batch * seq, self.config.d_model])?)
    }

    /// Mean cross-entropy of next-token `targets[B·T]` (on the model's device, as `ids`; rows
    /// with an out-of-range target are an error; no ignore index): `forward(..)
    /// .cross_entropy(targets, None)`, computed by the LM head's fused loss
    /// ([`Var::linear_cross_entropy`], the head has no bias), which never holds the `[B·T, V]`
    /// logits or their gradient. Training and evaluation both use it.
    pub fn loss(&self, ids: &Tokens, targets: &Tokens, batch: usize, seq: usize) -> Result<Var> {
        if targets.len() != ids.len() {
            return Err(Error::Config(format!("{} targets for {} token ids", targets.len(), ids.len())));
        }
        let h = self.hidden(ids, batch, seq)?;
        Ok(h.linear_cross_entropy(&self.lm_head.weight, targets, None, None)?)
    }
}

impl Module for Llama {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.embed_tokens.visit_parameters(&format!("{prefix}model.embed_tokens."), visit);
        for (i, block) in self.layers.iter().enumerate() {
            block.visit_parameters(&format!("{prefix}model.layers.{i}."), visit);
        }
        self.norm.visit_parameters(&format!("{prefix}model.norm."), visit);
        self.lm_head.visit_parameters(&format!("{prefix}lm_head."), visit);
    }
}
