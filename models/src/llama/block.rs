//! One LLaMA decoder block with the gates, residual rule and per-token layers its variant
//! asks for (SPEC §1-5):
//!
//! ```text
//! x = x + attn(norm(x));  x = x + PTT(x, tok);  x = x + ffn(norm(x)) ⊙ E[tok]     (pre-ln)
//! ```
//! with the residual rule swapped per [`ResidualRule`], gates on the projections
//! (`Ẑ = (X·Wᵀ) ⊙ G(X)`, eq. 6) or on the paths (`Y = Y + F(h) ⊙ G(h)`, eq. 7), or, for
//! `ccl`, an FFN of context-conditioned linear layers (SPEC §3) whose context manager reads
//! the FFN's input `norm(x)`.
//!
//! DeepNorm's init: v, o and the FFN weights are scaled by β = (8N)^{-1/4} after their
//! N(0, init_std²) draw (DeepNet's rule applied to LLaMA's init).

use autograd::Var;
use nn::attention::{Attention, AttentionConfig};
use nn::ccl::CclFfn;
use nn::ffn::SwiGlu;
use nn::init::WeightInit;
use nn::layers::{DyT, Norm};
use nn::modulator::{
    ComtModulator, Delta, DenseGate, Gate, ModulatedProjection, Modulator, ModulatorConfig, NonContextualGate,
    Residual, ResidualRule, Resolution, Stream,
};
use nn::per_token::{PerTokenTransform, TokenScale};
use nn::Module;
use tensor::ops::{Binary, ProductOutput};
use tensor::{Rng, Tokens};

use super::cache::BlockCache;
use super::config::{LlamaConfig, Parsed};
use super::ffn::FeedForward;
use super::variant::Variant;
use crate::Result;

/// A decoder block: attention, FFN, the residual rule with its norms, optional per-token layers.
pub struct DecoderBlock {
    /// `self_attn`: causal attention with RoPE and gated projections.
    pub self_attn: Attention,
    /// `mlp`: the SwiGLU FFN (dense or, for `ccl`, context-conditioned).
    pub mlp: FeedForward,
    /// The residual rule with its norms and parameters.
    pub residual: Residual,
    /// `per-token`: `x + PTT(x, tok)` between the sublayers.
    pub per_token: Option<PerTokenTransform>,
    /// `token-scale`: FFN output `⊙ E[tok]`.
    pub token_scale: Option<TokenScale>,
}

/// The residual rule of block `layer` (0-based) of `n_layers` for `variant`.
fn residual_rule(config: &LlamaConfig, variant: Variant, layer: usize) -> ResidualRule {
    let (l, n) = (layer + 1, config.n_layers);
    let plain =
        if config.post_ln { ResidualRule::PostNorm { alpha: 1.0 } } else { ResidualRule::PreNorm { scale: 1.0 } };
    match variant {
        Variant::PostLn => ResidualRule::PostNorm { alpha: 1.0 },
        Variant::DeepNorm => ResidualRule::PostNorm { alpha: (2.0 * n as f32).powf(0.25) },
        Variant::MixLn if l <= n / 4 => ResidualRule::PostNorm { alpha: 1.0 },
        Variant::MixLn | Variant::Dyt => ResidualRule::PreNorm { scale: 1.0 },
        Variant::LnScaling => ResidualRule::PreNorm { scale: 1.0 / (l as f32).sqrt() },
        Variant::ReZero => ResidualRule::ReZero,
        Variant::LaurelRw => ResidualRule::LaurelRw,
        Variant::LaurelLr => ResidualRule::LaurelLr { rank: config.laurel_rank },
        Variant::LaurelPa => ResidualRule::LaurelPa { earlier: layer },
        _ => plain,
    }
}

/// The gate a projection `d_in → d_out` named `name` carries under `variant`, if any.
fn projection_gate(
    config: &LlamaConfig,
    parsed: &Parsed,
    name: &str,
    d_in: usize,
    d_out: usize,
    rng: &mut Rng,
) -> Option<Gate> {
    let modulator = ModulatorConfig { rank: config.rank, phi: parsed.phi, learnable_alpha: config.learnable_alpha() };
    let covered = parsed.coverage.covers(name);
    let init = WeightInit::Normal { std: config.init_std };
    Some(match parsed.variant {
        Variant::LayerScalar if covered => {
            Gate::Modulator(Modulator::new(d_in, d_out, Resolution::Scalar, modulator, rng))
        }
        Variant::LayerChannel if covered => {
            Gate::Modulator(Modulator::new(d_in, d_out, Resolution::Channel, modulator, rng))
        }
        Variant::LayerChannelScalar | Variant::FixedAlpha if covered => {
            Gate::channel_scalar(d_in, d_out, modulator, rng)
        }
        Variant::NonContextual if covered => {
            Gate::NonContextual(NonContextualGate::new(d_out, modulator.learnable_alpha))
        }
        Variant::Comt if covered => Gate::Comt(ComtModulator::new(d_in, config.comt_hidden, parsed.phi, rng)),
        Variant::AllGate => Gate::Dense(DenseGate::new(d_in, d_out, init, rng)),
        Variant::SdpaGate if matches!(name, "q_proj" | "k_proj" | "v_proj") => {
            Gate::Dense(DenseGate::new(d_in, d_out, init, rng))
        }
        _ => return None,
    })
}

/// Attaches the variant's gate to each projection and sets the fused flag.
fn attach(
    config: &LlamaConfig,
    parsed: &Parsed,
    projections: &mut [(&'static str, &mut ModulatedProjection)],
    rng: &mut Rng,
) {
    for (name, p) in projections.iter_mut() {
        p.fused = config.fused;
        if let Some(gate) = projection_gate(config, parsed, name, p.in_features(), p.out_features(), rng) {
            p.gates.push(gate);
        }
    }
}

/// Multiplies a projection's weight by `factor` (DeepNorm's β).
fn scale_weight(p: &ModulatedProjection, factor: f32) -> Result<()> {
    let scaled = p.linear.weight.value().scalar_op(Binary::Mul, factor)?;
    Ok(p.linear.weight.set_value(scaled)?)
}

impl DecoderBlock {
    /// Block `layer` (0-based) for a validated config.
    pub(crate) fn new(config: &LlamaConfig, parsed: &Parsed, layer: usize, rng: &mut Rng) -> Result<DecoderBlock> {
        let d = config.d_model;
        let init = WeightInit::Normal { std: config.init_std };
        let attention = AttentionConfig { d_model: d, n_heads: config.n_heads, rope_theta: config.rope_theta };
        let mut self_attn = Attention::new(attention, init, rng)?;
        let mut mlp = match parsed.variant {
            Variant::Ccl => FeedForward::Ccl(CclFfn::new(d, config.ffn_hidden, parsed.ccl, init, rng)),
            _ => FeedForward::SwiGlu(SwiGlu::new(d, config.ffn_hidden, init, rng)),
        };
        if let (Variant::DeepNorm, FeedForward::SwiGlu(mlp)) = (parsed.variant, &mlp) {
            let beta = (8.0 * config.n_layers as f32).powf(-0.25);
            for p in [&self_attn.v_proj, &self_attn.o_proj, &mlp.gate_proj, &mlp.up_proj, &mlp.down_proj] {
                scale_weight(p, beta)?;
            }
        }
        attach(config, parsed, &mut self_attn.projections_mut(), rng);
        if let FeedForward::SwiGlu(mlp) = &mut mlp {
            attach(config, parsed, &mut mlp.projections_mut(), rng);
        }
        if parsed.variant == Variant::SdpaGate {
            self_attn.sdpa_gate = Some(DenseGate::new(d, d, init, rng));
        }
        let path = match parsed.variant {
            Variant::PathScalar => Some(Resolution::Scalar),
            Variant::PathChannel => Some(Resolution::Channel),
            _ => None,
        };
        if let Some(resolution) = path {
            let modulator =
                ModulatorConfig { rank: config.rank, phi: parsed.phi, learnable_alpha: config.learnable_alpha() };
            let path_gate = |rng: &mut Rng| Gate::Modulator(Modulator::new(d, d, resolution, modulator, rng));
            if parsed.coverage.covers("o_proj") {
                self_attn.path_gates.push(path_gate(rng));
            }
            if let (true, FeedForward::SwiGlu(mlp)) = (parsed.coverage.covers("down_proj"), &mut mlp) {
                mlp.path_gates.push(path_gate(rng));
            }
        }
        let eps = config.norm_eps;
        let dyt = parsed.variant == Variant::Dyt;
        let make_norm = || if dyt { Norm::Dyt(DyT::new(d)) } else { Norm::rms(d, eps) };
        let residual = Residual::new(residual_rule(config, parsed.variant, layer), d, make_norm, rng);
        let vocab = config.vocab_size;
        Ok(DecoderBlock {
            self_attn,
            mlp,
            residual,
            per_token: (parsed.variant == Variant::PerToken)
                .then(|| PerTokenTransform::new(vocab, d, config.resolved_per_token_rank(), rng)),
            token_scale: (parsed.variant == Variant::TokenScale).then(|| TokenScale::new(vocab, d)),
        })
    }

    /// Under bf16 products, stores each sublayer's output in bf16 where the residual stream's
    /// fused add and RMSNorm alone read it ([`Residual::adds_fused`]): the attention's unless
    /// the per-token transform reads the stream between the sublayers, the FFN's unless the
    /// token scale multiplies it. The caller checks what reads the last block's output. A
    /// fused gated output projection is then left for that norm to run in its own launch
    /// ([`nn::attention::Attention::forward_deferred`], [`SwiGlu::forward_deferred`]).
    pub(crate) fn store_fused_outputs_in_bf16(&mut self) {
        if !self.residual.adds_fused() {
            return;
        }
        if self.per_token.is_none() {
            self.self_attn.output = ProductOutput::Bf16;
        }
        if let (None, FeedForward::SwiGlu(mlp)) = (&self.token_scale, &mut self.mlp) {
            mlp.output = ProductOutput::Bf16;
        }
    }

    /// The residual stream `x: [B, T, C]` with the row-major token ids `ids[B·T]` → `[B, T, C]`.
    /// `earlier` holds the activations before this block's input (LAuReL-PA reads them). A
    /// pre-ln block leaves its last residual add pending in the returned stream, for the next
    /// RMSNorm to run fused ([`Stream::normed`]).
    pub fn forward(&self, x: &Stream, ids: &Tokens, earlier: &[Var]) -> Result<Stream> {
        self.forward_with(x, ids, earlier, |h| self.self_attn.forward_deferred(h), |h| self.mlp.forward_deferred(h))
    }

    /// [`DecoderBlock::forward`] for `T` new positions of each of `B` sequences, continuing
    /// the keys, values (and CCL running means) in `cache` (one entry per sequence).
    pub fn forward_cached(&self, x: &Stream, ids: &Tokens, earlier: &[Var], cache: &mut BlockCache) -> Result<Stream> {
        let BlockCache { attention, context_means } = cache;
        self.forward_with(
            x,
            ids,
            earlier,
            |h| self.self_attn.forward_cached(h, attention).map(Delta::Value),
            |h| self.mlp.forward_cached(h, context_means).map(Delta::Value),
        )
    }

    /// The block with its attention and FFN sublayers given as closures, each returning its
    /// output as the residual stream holds it ([`Delta`]).
    fn forward_with(
        &self,
        x: &Stream,
        ids: &Tokens,
        earlier: &[Var],
        attention: impl FnOnce(&Var) -> autograd::Result<Delta>,
        ffn: impl FnOnce(&Var) -> autograd::Result<Delta>,
    ) -> Result<Stream> {
        let between = self.per_token.as_ref().map(|ptt| |x: &Var| ptt.forward(x, ids));
        let mlp = |h: &Var| {
            let y = ffn(h)?;
            match &self.token_scale {
                Some(scale) => Ok(Delta::Value(scale.forward(&y.value()?, ids)?)),
                None => Ok(y),
            }
        };
        Ok(self.residual.forward(x, earlier, attention, between, mlp)?)
    }
}

impl Module for DecoderBlock {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.self_attn.visit_parameters(&format!("{prefix}self_attn."), visit);
        self.mlp.visit_parameters(&format!("{prefix}mlp."), visit);
        self.residual.visit_parameters(prefix, visit);
        if let Some(ptt) = &self.per_token {
            ptt.visit_parameters(&format!("{prefix}per_token."), visit);
        }
        if let Some(scale) = &self.token_scale {
            scale.visit_parameters(&format!("{prefix}token_scale."), visit);
        }
    }
}
