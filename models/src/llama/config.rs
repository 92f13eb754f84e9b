//! [`LlamaConfig`]: the LLaMA presets of SPEC §6 plus every variant knob, serialisable as
//! the JSON saved beside checkpoints. Missing JSON fields take their defaults.

use nn::ccl::{CclAblation, CclConfig, CclMode};
use nn::modulator::Phi;
use serde::{Deserialize, Serialize};

use super::variant::{listed, Coverage, Variant};
use crate::{Error, Result};

/// `(name, d_model, ffn_hidden, n_layers, n_heads)` of each preset (SPEC §6).
pub const PRESETS: [(&str, usize, usize, usize, usize); 7] = [
    ("llama-tiny", 128, 344, 4, 4),
    ("llama-small", 256, 688, 6, 8),
    ("llama-60m", 512, 1376, 8, 8),
    ("llama-130m", 768, 2048, 12, 12),
    ("llama-250m", 768, 2560, 24, 16),
    ("llama-350m", 1024, 2736, 24, 16),
    ("llama-1b", 2048, 5461, 24, 32),
];

/// A LLaMA decoder and its variant. `Default` is `llama-tiny`, `pre-ln`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LlamaConfig {
    /// The preset it came from (informational).
    pub preset: String,
    /// Model width `C`.
    pub d_model: usize,
    /// SwiGLU hidden width.
    pub ffn_hidden: usize,
    /// Number of decoder blocks `N`.
    pub n_layers: usize,
    /// Attention heads (the head width must be even for RoPE).
    pub n_heads: usize,
    /// 32,000 in the presets (the papers' T5 tokenizer); training sets the tokenizer's.
    pub vocab_size: usize,
    /// Training context (256 by default). RoPE does not limit `forward` to it.
    pub seq_len: usize,
    /// RoPE base θ (10000).
    pub rope_theta: f32,
    /// RMSNorm epsilon (1e-6, as Hugging Face LLaMA).
    pub norm_eps: f32,
    /// Std of the N(0, std²) init of embeddings and every base linear weight (Hugging Face
    /// LLaMA's `initializer_range`, 0.02). Modulators use Kaiming-uniform (SPEC §1).
    pub init_std: f32,
    /// A name from [`super::VARIANTS`] or `transponder`.
    pub variant: String,
    /// Post-LN residuals (`Norm(x + F(x))`) instead of pre-LN for the modulator variants.
    pub post_ln: bool,
    /// Transponder modulator rank r (8).
    pub rank: usize,
    /// Modulator nonlinearity φ: `sigmoid`, `silu` or `relu`.
    pub phi: String,
    /// Which projections carry modulators: a name from [`super::COVERAGES`].
    pub coverage: String,
    /// Freeze every Transponder α at 1 (the `fixed-alpha` variant sets this implicitly).
    pub fixed_alpha: bool,
    /// CoMT modulator hidden width (2).
    pub comt_hidden: usize,
    /// LAuReL-LR rank (16).
    pub laurel_rank: usize,
    /// Per-token transform rank; 0 means `round(√d_model)` (SPEC §4).
    pub per_token_rank: usize,
    /// Run `layer-channel-scalar` projections through the fused op (eq. 8-10).
    pub fused: bool,
    /// CCL basis size k (64; SPEC §3). `ccl` only.
    pub d_basis: usize,
    /// CCL context width d_ctx (64). `ccl` only.
    pub d_ctx: usize,
    /// CCL context mode: `token` or `causal-mean`. `ccl` only.
    pub ccl_mode: String,
    /// CCL ablation: `none`, `static`, `no-out-gate` or `no-basis-gate`. `ccl` only.
    pub ccl_ablation: String,
}

impl Default for LlamaConfig {
    fn default() -> Self {
        let (preset, d_model, ffn_hidden, n_layers, n_heads) = PRESETS[0];
        LlamaConfig {
            preset: preset.into(),
            d_model,
            ffn_hidden,
            n_layers,
            n_heads,
            vocab_size: 32_000,
            seq_len: 256,
            rope_theta: 10_000.0,
            norm_eps: 1e-6,
            init_std: 0.02,
            variant: "pre-ln".into(),
            post_ln: false,
            rank: 8,
            phi: "sigmoid".into(),
            coverage: "all".into(),
            fixed_alpha: false,
            comt_hidden: 2,
            laurel_rank: 16,
            per_token_rank: 0,
            fused: true,
            d_basis: 64,
            d_ctx: 64,
            ccl_mode: "token".into(),
            ccl_ablation: "none".into(),
        }
    }
}

/// A validated config's names, parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Parsed {
    pub variant: Variant,
    pub phi: Phi,
    pub coverage: Coverage,
    pub ccl: CclConfig,
}

impl LlamaConfig {
    /// The preset `name` (SPEC §6) with vocab 32,000, sequence 256 and the `pre-ln` variant.
    /// The error lists every preset.
    pub fn preset(name: &str) -> Result<LlamaConfig> {
        let &(preset, d_model, ffn_hidden, n_layers, n_heads) =
            PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
                Error::Config(format!(
                    "unknown preset `{name}`; valid presets: {}",
                    listed(PRESETS.iter().map(|p| p.0))
                ))
            })?;
        Ok(LlamaConfig { preset: preset.into(), d_model, ffn_hidden, n_layers, n_heads, ..LlamaConfig::default() })
    }

    /// The same architecture at width `d_model`, the FFN hidden width scaled with it
    /// (`round(ffn_hidden · d_model / preset d_model)`, LLaMA's ≈ 8/3 ratio) and the heads
    /// kept (validation fails if they no longer split the width into even head dimensions).
    /// The dense-width baselines of CCL Table 2 (Base-64, Base-512) are built this way.
    pub fn with_d_model(&self, d_model: usize) -> LlamaConfig {
        let ratio = self.ffn_hidden as f64 / self.d_model.max(1) as f64;
        let ffn_hidden = ((d_model as f64 * ratio).round() as usize).max(1);
        LlamaConfig { d_model, ffn_hidden, ..self.clone() }
    }

    /// Checks every name and combination; errors list the valid names.
    pub fn validate(&self) -> Result<()> {
        self.parse().map(|_| ())
    }

    /// The parsed variant (an error lists the valid names).
    pub fn variant(&self) -> Result<Variant> {
        Variant::from_name(&self.variant)
    }

    /// Transponder α is learnable unless frozen by `fixed_alpha` or the `fixed-alpha` variant.
    pub fn learnable_alpha(&self) -> bool {
        !(self.fixed_alpha || self.variant == "fixed-alpha")
    }

    /// The per-token transform's rank: `per_token_rank`, or `round(√d_model)` when 0.
    pub fn resolved_per_token_rank(&self) -> usize {
        if self.per_token_rank > 0 {
            self.per_token_rank
        } else {
            ((self.d_model as f64).sqrt().round() as usize).max(1)
        }
    }

    pub(crate) fn parse(&self) -> Result<Parsed> {
        let variant = self.variant()?;
        let phi = Phi::from_name(&self.phi)
            .ok_or_else(|| Error::Config(format!("unknown phi `{}`; valid phi: {}", self.phi, listed(Phi::NAMES))))?;
        let coverage = Coverage::from_name(&self.coverage)?;
        let bad = |message: String| Err(Error::Config(message));
        let positive = [
            ("d_model", self.d_model),
            ("ffn_hidden", self.ffn_hidden),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("rank", self.rank),
            ("comt_hidden", self.comt_hidden),
            ("laurel_rank", self.laurel_rank),
            ("d_basis", self.d_basis),
            ("d_ctx", self.d_ctx),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} must be positive"));
        }
        if !self.d_model.is_multiple_of(self.n_heads) || !(self.d_model / self.n_heads).is_multiple_of(2) {
            return bad(format!(
                "{} heads must split d_model {} into even head dimensions",
                self.n_heads, self.d_model
            ));
        }
        if !(self.rope_theta > 0.0 && self.norm_eps > 0.0 && self.init_std > 0.0) {
            return bad("rope_theta, norm_eps and init_std must be positive".into());
        }
        let path_level = matches!(variant, Variant::PathScalar | Variant::PathChannel);
        let coverage_ok = coverage == Coverage::All
            || variant.is_projection_modulator()
            || (path_level && matches!(coverage, Coverage::Attn | Coverage::Mlp));
        if !coverage_ok {
            return bad(format!(
                "coverage `{}` does not apply to variant `{}`: projection-level modulators (layer-scalar, \
                 layer-channel, layer-channel-scalar, non-contextual, fixed-alpha, comt) take any coverage, \
                 path-scalar and path-channel take all, attn or mlp, every other variant only all",
                self.coverage, self.variant
            ));
        }
        if self.post_ln && variant.has_own_residual_rule() {
            return bad(format!(
                "post_ln does not combine with `{}`, which has its own residual rule; post_ln combines with \
                 pre-ln, post-ln, the modulator variants, per-token, token-scale, ccl, sdpa-gate and all-gate",
                self.variant
            ));
        }
        if self.fixed_alpha && !variant.has_alpha() {
            return bad(format!(
                "fixed_alpha freezes a Transponder α, which `{}` does not have; variants with α: path-scalar, \
                 path-channel, layer-scalar, layer-channel, layer-channel-scalar, non-contextual, fixed-alpha",
                self.variant
            ));
        }
        let ccl = self.parse_ccl(variant)?;
        Ok(Parsed { variant, phi, coverage, ccl })
    }

    /// The CCL options; set away from their defaults they need the `ccl` variant.
    fn parse_ccl(&self, variant: Variant) -> Result<CclConfig> {
        let mode = CclMode::from_name(&self.ccl_mode).ok_or_else(|| {
            Error::Config(format!("unknown ccl_mode `{}`; valid: {}", self.ccl_mode, listed(CclMode::NAMES)))
        })?;
        let ablation = CclAblation::from_name(&self.ccl_ablation).ok_or_else(|| {
            Error::Config(format!(
                "unknown ccl_ablation `{}`; valid: {}",
                self.ccl_ablation,
                listed(CclAblation::NAMES)
            ))
        })?;
        let ccl = CclConfig { d_basis: self.d_basis, d_ctx: self.d_ctx, mode, ablation };
        if variant != Variant::Ccl && ccl != CclConfig::default() {
            return Err(Error::Config(format!(
                "d_basis, d_ctx, ccl_mode and ccl_ablation configure the `ccl` variant, not `{}`",
                self.variant
            )));
        }
        Ok(ccl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_errors() {
        let c = LlamaConfig::preset("llama-60m").unwrap();
        assert_eq!((c.d_model, c.ffn_hidden, c.n_layers, c.n_heads, c.seq_len), (512, 1376, 8, 8, 256));
        let err = LlamaConfig::preset("llama-7b").unwrap_err().to_string();
        assert!(err.contains("llama-tiny") && err.contains("llama-1b"), "{err}");
        for name in PRESETS.map(|p| p.0) {
            LlamaConfig::preset(name).unwrap().validate().unwrap();
        }
        let with = |f: fn(&mut LlamaConfig)| {
            let mut c = LlamaConfig::default();
            f(&mut c);
            c.validate().map_err(|e| e.to_string())
        };
        assert!(with(|c| c.phi = "gelu".into()).unwrap_err().contains("sigmoid, silu, relu"));
        assert!(with(|c| c.coverage = "only-qk".into()).unwrap_err().contains("layer-channel-scalar"));
        assert!(with(|c| c.variant = "rezero".into()).is_ok());
        assert!(with(|c| {
            c.variant = "rezero".into();
            c.post_ln = true;
        })
        .is_err());
        assert!(with(|c| c.n_heads = 3).is_err());
        assert!(with(|c| c.fixed_alpha = true).is_err());
    }

    #[test]
    fn json_round_trip_fills_missing_fields() {
        let c = LlamaConfig { variant: "transponder".into(), ..LlamaConfig::preset("llama-small").unwrap() };
        let back: LlamaConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        let partial: LlamaConfig = serde_json::from_str(r#"{"variant": "comt"}"#).unwrap();
        assert_eq!((partial.variant.as_str(), partial.rank), ("comt", 8));
    }
}
