//! The names a LLaMA config (and the CLI) accepts: architecture variants (SPEC §1-5) and
//! modulator coverage (SPEC §1), with the error messages that list them.

use crate::{Error, Result};

/// A LLaMA variant: a contextual-modulator placement (SPEC §1, §2, §4), CCL (§3) or a
/// baseline (§5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `pre-ln`: the LLaMA baseline, `x + F(Norm(x))`.
    PreLn,
    /// `path-scalar`: one scalar modulator on each sublayer output (eq. 7).
    PathScalar,
    /// `path-channel`: one channel modulator on each sublayer output (eq. 7).
    PathChannel,
    /// `layer-scalar`: a scalar modulator after every covered projection (eq. 6).
    LayerScalar,
    /// `layer-channel`: a channel modulator after every covered projection.
    LayerChannel,
    /// `layer-channel-scalar` = `transponder`: channel × scalar, fused (eq. 8-10).
    LayerChannelScalar,
    /// `non-contextual`: `σ̃_α(β₁·β₂)` after every covered projection.
    NonContextual,
    /// `fixed-alpha`: `transponder` with every α frozen at 1 (not a parameter).
    FixedAlpha,
    /// `comt`: CoMT's scalar `σ(w₂ᵀφ(W₁x + c₁) + c₂)` after every covered projection.
    Comt,
    /// `per-token`: `x + U·(M[tok]·(D·x))` between the sublayers (SPEC §4).
    PerToken,
    /// `token-scale`: FFN output `⊙ E[tok]` (SPEC §4).
    TokenScale,
    /// `ccl`: the FFN's gate, up and down projections are context-conditioned linear layers
    /// sharing one context manager per block (SPEC §3).
    Ccl,
    /// `post-ln`: `Norm(x + F(x))`.
    PostLn,
    /// `deepnorm`: `Norm(α·x + F(x))`, α = (2N)^¼, β-scaled init.
    DeepNorm,
    /// `mix-ln`: post-ln for the first ⌊N/4⌋ blocks, pre-ln after.
    MixLn,
    /// `ln-scaling`: pre-ln with norm outputs scaled by 1/√l.
    LnScaling,
    /// `rezero`: `x + α_l·F(x)`, α_l init 0, no norm.
    ReZero,
    /// `laurel-rw`: `α·F(Norm(x)) + β·x`.
    LaurelRw,
    /// `laurel-lr`: `F(Norm(x)) + x + B·A·x`.
    LaurelLr,
    /// `laurel-pa`: pre-ln plus `Σ_j γ_j·x_j` over earlier activations.
    LaurelPa,
    /// `sdpa-gate`: `σ(h·W_g)` on q, k, v and the SDPA output.
    SdpaGate,
    /// `all-gate`: `σ(X·W_g)` on every projection.
    AllGate,
    /// `dyt`: every norm replaced by DyT.
    Dyt,
}

/// Every variant with its config/CLI name, in the order error messages list them.
pub const VARIANTS: [(Variant, &str); 23] = [
    (Variant::PreLn, "pre-ln"),
    (Variant::PathScalar, "path-scalar"),
    (Variant::PathChannel, "path-channel"),
    (Variant::LayerScalar, "layer-scalar"),
    (Variant::LayerChannel, "layer-channel"),
    (Variant::LayerChannelScalar, "layer-channel-scalar"),
    (Variant::NonContextual, "non-contextual"),
    (Variant::FixedAlpha, "fixed-alpha"),
    (Variant::Comt, "comt"),
    (Variant::PerToken, "per-token"),
    (Variant::TokenScale, "token-scale"),
    (Variant::Ccl, "ccl"),
    (Variant::PostLn, "post-ln"),
    (Variant::DeepNorm, "deepnorm"),
    (Variant::MixLn, "mix-ln"),
    (Variant::LnScaling, "ln-scaling"),
    (Variant::ReZero, "rezero"),
    (Variant::LaurelRw, "laurel-rw"),
    (Variant::LaurelLr, "laurel-lr"),
    (Variant::LaurelPa, "laurel-pa"),
    (Variant::SdpaGate, "sdpa-gate"),
    (Variant::AllGate, "all-gate"),
    (Variant::Dyt, "dyt"),
];

/// `transponder` names the default Transponder configuration, `layer-channel-scalar`.
pub const TRANSPONDER_ALIAS: &str = "transponder";

/// Lists names for an error message: `a, b, c`.
pub(crate) fn listed<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names.into_iter().collect::<Vec<_>>().join(", ")
}

impl Variant {
    /// Parses a variant name (or the alias `transponder`); the error lists every valid name.
    pub fn from_name(name: &str) -> Result<Variant> {
        if name == TRANSPONDER_ALIAS {
            return Ok(Variant::LayerChannelScalar);
        }
        VARIANTS.iter().find(|(_, n)| *n == name).map(|(v, _)| *v).ok_or_else(|| {
            Error::Config(format!(
                "unknown variant `{name}`; valid variants: {}, {TRANSPONDER_ALIAS} (= layer-channel-scalar)",
                listed(VARIANTS.iter().map(|(_, n)| *n))
            ))
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        VARIANTS.iter().find(|(v, _)| *v == self).map_or("pre-ln", |(_, n)| n)
    }

    /// Variants that gate individual projections with a modulator (coverage applies fully).
    pub fn is_projection_modulator(self) -> bool {
        use Variant::*;
        matches!(self, LayerScalar | LayerChannel | LayerChannelScalar | NonContextual | FixedAlpha | Comt)
    }

    /// Variants with a Transponder α (the ones `fixed_alpha` can freeze).
    pub fn has_alpha(self) -> bool {
        use Variant::*;
        matches!(
            self,
            PathScalar | PathChannel | LayerScalar | LayerChannel | LayerChannelScalar | NonContextual | FixedAlpha
        )
    }

    /// Variants with their own residual rule, which therefore do not combine with `post_ln`.
    pub fn has_own_residual_rule(self) -> bool {
        use Variant::*;
        matches!(self, DeepNorm | MixLn | LnScaling | ReZero | LaurelRw | LaurelLr | LaurelPa | Dyt)
    }
}

/// Which linear projections of a block carry modulators (SPEC §1 ablation, CoMT Table 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Coverage {
    /// q, k, v, o, gate, up, down.
    All,
    /// q, k, v, o.
    Attn,
    /// gate, up, down.
    Mlp,
    /// q, k, v, gate, up.
    OnlyFirst,
    /// o, down.
    OnlyLast,
    /// q, k.
    OnlyQk,
    /// q, k, v, o, down.
    NoUpGate,
}

/// Every coverage with its config/CLI name.
pub const COVERAGES: [(Coverage, &str); 7] = [
    (Coverage::All, "all"),
    (Coverage::Attn, "attn"),
    (Coverage::Mlp, "mlp"),
    (Coverage::OnlyFirst, "only-first"),
    (Coverage::OnlyLast, "only-last"),
    (Coverage::OnlyQk, "only-qk"),
    (Coverage::NoUpGate, "no-up-gate"),
];

impl Coverage {
    /// Parses a coverage name; the error lists every valid name.
    pub fn from_name(name: &str) -> Result<Coverage> {
        COVERAGES.iter().find(|(_, n)| *n == name).map(|(c, _)| *c).ok_or_else(|| {
            Error::Config(format!(
                "unknown coverage `{name}`; valid coverages: {}",
                listed(COVERAGES.iter().map(|(_, n)| *n))
            ))
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        COVERAGES.iter().find(|(c, _)| *c == self).map_or("all", |(_, n)| n)
    }

    /// Whether the projection with this Hugging Face name (`q_proj`, ..., `down_proj`) is covered.
    pub fn covers(self, projection: &str) -> bool {
        let attn = matches!(projection, "q_proj" | "k_proj" | "v_proj" | "o_proj");
        match self {
            Coverage::All => true,
            Coverage::Attn => attn,
            Coverage::Mlp => !attn,
            Coverage::OnlyFirst => !matches!(projection, "o_proj" | "down_proj"),
            Coverage::OnlyLast => matches!(projection, "o_proj" | "down_proj"),
            Coverage::OnlyQk => matches!(projection, "q_proj" | "k_proj"),
            Coverage::NoUpGate => !matches!(projection, "gate_proj" | "up_proj"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_errors_list_them() {
        for (variant, name) in VARIANTS {
            assert_eq!(Variant::from_name(name).unwrap(), variant);
            assert_eq!(variant.name(), name);
        }
        assert_eq!(Variant::from_name("transponder").unwrap(), Variant::LayerChannelScalar);
        let err = Variant::from_name("transponda").unwrap_err().to_string();
        assert!(err.contains("pre-ln") && err.contains("laurel-pa") && err.contains("transponder"), "{err}");
        for (coverage, name) in COVERAGES {
            assert_eq!(Coverage::from_name(name).unwrap(), coverage);
        }
        assert!(Coverage::from_name("qk").unwrap_err().to_string().contains("only-qk"));
        assert!(Coverage::NoUpGate.covers("down_proj") && !Coverage::NoUpGate.covers("up_proj"));
    }
}
