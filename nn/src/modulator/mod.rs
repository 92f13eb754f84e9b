//! Contextual modulators (Transponder `000`, CoMT `002`) and the gates and residual rules
//! they are compared with (SPEC §1, §2, §5).
//!
//! A modulator reads the same input `x` as the sublayer it modulates and returns a gate
//! that multiplies the sublayer's output (Transponder eq. 2):
//!
//! - [`Modulator`]: `G(x) = σ̃_α(B·φ(A·x + a) + b)`, `σ̃_α(z) = 2σ(αz)` (eq. 4-5), scalar or
//!   channel resolution, learnable or fixed α;
//! - [`NonContextualGate`]: `σ̃_α(β₁·β₂)`, the input-independent ablation;
//! - [`ComtModulator`]: CoMT's `σ(w₂ᵀ·φ(W₁x + c₁) + c₂)` in (0, 1);
//! - [`DenseGate`]: `σ(x·W_gᵀ)` with a full `W_g` (the SDPA-Gate and ALL-Gate baselines).
//!
//! [`ModulatedProjection`] is a linear layer with a list of such gates on its output (eq. 6),
//! fused into one op for the channel × scalar pair (eq. 8-10). [`Residual`] holds the
//! residual rules of a decoder block (pre-ln, post-ln, DeepNorm, ReZero, LAuReL, ...).

mod comt;
mod contextual;
mod dense;
mod gate;
mod projection;
mod residual;

pub use comt::ComtModulator;
pub use contextual::{Modulator, ModulatorConfig, NonContextualGate, Resolution};
pub use dense::DenseGate;
pub use gate::Gate;
pub use projection::{GatedOutput, ModulatedProjection};
pub use residual::{Delta, Residual, ResidualRule, Stream};

use autograd::ops::Unary;
use autograd::{Result, Var};

/// The pointwise nonlinearity `φ` inside a modulator (SPEC §1: sigmoid by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Phi {
    /// `σ(x)` (the default).
    #[default]
    Sigmoid,
    /// `x·σ(x)`.
    Silu,
    /// `max(x, 0)`.
    Relu,
}

impl Phi {
    /// Every name [`Phi::from_name`] accepts, in the order error messages list them.
    pub const NAMES: [&'static str; 3] = ["sigmoid", "silu", "relu"];

    /// Parses a config/CLI name (`sigmoid`, `silu`, `relu`).
    pub fn from_name(name: &str) -> Option<Phi> {
        match name {
            "sigmoid" => Some(Phi::Sigmoid),
            "silu" => Some(Phi::Silu),
            "relu" => Some(Phi::Relu),
            _ => None,
        }
    }

    /// The config/CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Phi::Sigmoid => "sigmoid",
            Phi::Silu => "silu",
            Phi::Relu => "relu",
        }
    }

    /// The elementwise op, as the autograd and kernel crates name it.
    pub fn unary(self) -> Unary {
        match self {
            Phi::Sigmoid => Unary::Sigmoid,
            Phi::Silu => Unary::Silu,
            Phi::Relu => Unary::Relu,
        }
    }

    /// `φ(x)` elementwise.
    pub fn apply(self, x: &Var) -> Result<Var> {
        x.unary(self.unary())
    }
}

/// `σ̃_α(z) = 2·σ(α·z)` (Transponder eq. 5): in (0, 2), and 1 at `z = 0`.
pub fn calibrated_sigmoid(z: &Var, alpha: &Var) -> Result<Var> {
    z.mul(alpha)?.sigmoid()?.mul_scalar(2.0)
}
