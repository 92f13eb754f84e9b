//! Context-conditioned linear layers (CCL, paper `001`, SPEC §3).
//!
//! ```text
//! h = LayerNorm(x·W_basis)                 W_basis: d_in × k     (eq. 1)
//! g = σ(MLP(c_t)) = [g_b | g_o]            g_b ∈ (0,1)^k, g_o ∈ (0,1)^{d_out}   (eq. 2)
//! y = ((h ⊙ g_b)·W_mix + bias) ⊙ g_o       W_mix: k × d_out      (eq. 3-4)
//! c_t = SiLU(W_ctx·h_t)                    the block's Global Context Manager
//! ```
//!
//! - [`ContextConditionedLinear`]: one CCL layer (eq. 1-4).
//! - [`ContextManager`]: `c_t` from the FFN's input, mode [`CclMode::Token`] or
//!   [`CclMode::CausalMean`] (also reads the running mean of the inputs at positions ≤ t).
//! - [`CclFfn`]: LLaMA's SwiGLU with gate, up and down each a CCL, one context manager
//!   shared by the three.
//! - [`CclAblation`]: the paper's Table 4 rows (`static`, `no-out-gate`, `no-basis-gate`).
//!
//! PyTorch equivalent: the paper's Figure 3 (`CCL.forward`), with the bias inside the output
//! gate as SPEC §3 writes it. Every gate is computed per token from `c_t` alone, so a CCL
//! model stays causal.

mod context;
mod ffn;
mod layer;

pub use context::{causal_mean, ContextManager, RunningMean};
pub use ffn::CclFfn;
pub use layer::ContextConditionedLinear;

/// How the Global Context Manager builds `c_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CclMode {
    /// `c_t = SiLU(W_ctx·h_t)`: the token's own (normalised) representation.
    #[default]
    Token,
    /// `c_t = SiLU(W_ctx·h_t + W_mean·mean_{s≤t} h_s)`: also the causal running mean.
    CausalMean,
}

impl CclMode {
    /// Every name [`CclMode::from_name`] accepts.
    pub const NAMES: [&'static str; 2] = ["token", "causal-mean"];

    /// Parses a config/CLI name.
    pub fn from_name(name: &str) -> Option<CclMode> {
        match name {
            "token" => Some(CclMode::Token),
            "causal-mean" => Some(CclMode::CausalMean),
            _ => None,
        }
    }

    /// The config/CLI name.
    pub fn name(self) -> &'static str {
        match self {
            CclMode::Token => "token",
            CclMode::CausalMean => "causal-mean",
        }
    }
}

/// Which gates a CCL keeps (the paper's Table 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CclAblation {
    /// Full CCL: basis and output gates.
    #[default]
    None,
    /// Gates fixed at 1 and no context manager: a static low-rank layer with a norm inside.
    Static,
    /// `g_o = 1`: only the basis gate.
    NoOutGate,
    /// `g_b = 1`: only the output gate.
    NoBasisGate,
}

impl CclAblation {
    /// Every name [`CclAblation::from_name`] accepts.
    pub const NAMES: [&'static str; 4] = ["none", "static", "no-out-gate", "no-basis-gate"];

    /// Parses a config/CLI name.
    pub fn from_name(name: &str) -> Option<CclAblation> {
        match name {
            "none" => Some(CclAblation::None),
            "static" => Some(CclAblation::Static),
            "no-out-gate" => Some(CclAblation::NoOutGate),
            "no-basis-gate" => Some(CclAblation::NoBasisGate),
            _ => None,
        }
    }

    /// The config/CLI name.
    pub fn name(self) -> &'static str {
        match self {
            CclAblation::None => "none",
            CclAblation::Static => "static",
            CclAblation::NoOutGate => "no-out-gate",
            CclAblation::NoBasisGate => "no-basis-gate",
        }
    }

    /// Whether the basis gate `g_b` is computed.
    pub fn has_basis_gate(self) -> bool {
        matches!(self, CclAblation::None | CclAblation::NoOutGate)
    }

    /// Whether the output gate `g_o` is computed.
    pub fn has_out_gate(self) -> bool {
        matches!(self, CclAblation::None | CclAblation::NoBasisGate)
    }

    /// Whether any gate (and hence the context manager) exists.
    pub fn has_context(self) -> bool {
        self != CclAblation::Static
    }
}

/// Shapes and options of a CCL layer or FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CclConfig {
    /// `k`: basis size (64 by default).
    pub d_basis: usize,
    /// Width of the context vector `c_t` (64 by default).
    pub d_ctx: usize,
    /// How `c_t` is built.
    pub mode: CclMode,
    /// Which gates exist.
    pub ablation: CclAblation,
}

impl Default for CclConfig {
    fn default() -> Self {
        CclConfig { d_basis: 64, d_ctx: 64, mode: CclMode::Token, ablation: CclAblation::None }
    }
}
