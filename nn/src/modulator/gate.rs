//! [`Gate`]: every kind of multiplicative gate a projection or a path can carry, behind one
//! forward and one naming scheme.
//!
//! Parameter names under the gated layer: `modulator_scalar.*` / `modulator_channel.*`
//! (Transponder), `modulator.*` (non-contextual, CoMT), `output_gate.weight` (dense gates).

use autograd::{Result, Var};
use tensor::Rng;

use super::{ComtModulator, DenseGate, Modulator, ModulatorConfig, NonContextualGate, Resolution};
use crate::module::{join, Module};

/// A gate `G(x)` whose output multiplies a layer's output (Transponder eq. 2).
pub enum Gate {
    /// One Transponder modulator, scalar or channel (`layer-scalar`, `layer-channel`, path-level).
    Modulator(Modulator),
    /// Channel modulator × scalar modulator, each with its own A, B, a, b, α
    /// (`layer-channel-scalar` = `transponder`). On a projection this pair runs as the
    /// fused op of eq. 8-10.
    ChannelScalar {
        /// The channel modulator (`modulator_channel`).
        channel: Modulator,
        /// The scalar modulator (`modulator_scalar`).
        scalar: Modulator,
    },
    /// `σ̃_α(β₁·β₂)` (`non-contextual`).
    NonContextual(NonContextualGate),
    /// CoMT's `σ(w₂ᵀ·φ(W₁x + c₁) + c₂)`.
    Comt(ComtModulator),
    /// `σ(x·W_gᵀ)` (SDPA-Gate, ALL-Gate).
    Dense(DenseGate),
}

impl Gate {
    /// The Transponder pair for a `d_in → d_out` layer: a channel and a scalar modulator.
    pub fn channel_scalar(d_in: usize, d_out: usize, config: ModulatorConfig, rng: &mut Rng) -> Gate {
        let channel = Modulator::new(d_in, d_out, Resolution::Channel, config, rng);
        let scalar = Modulator::new(d_in, d_out, Resolution::Scalar, config, rng);
        Gate::ChannelScalar { channel, scalar }
    }

    /// The gate for input `x: [..., d_in]`, broadcastable against the gated `[..., d_out]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        match self {
            Gate::Modulator(m) => m.forward(x),
            Gate::ChannelScalar { channel, scalar } => channel.forward(x)?.mul(&scalar.forward(x)?),
            Gate::NonContextual(g) => g.forward(),
            Gate::Comt(m) => m.forward(x),
            Gate::Dense(g) => g.forward(x),
        }
    }
}

impl Module for Gate {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        let under = |name: &str| join(prefix, &format!("{name}."));
        match self {
            Gate::Modulator(m) => m.visit_parameters(&under(m.name()), visit),
            Gate::ChannelScalar { channel, scalar } => {
                channel.visit_parameters(&under(channel.name()), visit);
                scalar.visit_parameters(&under(scalar.name()), visit);
            }
            Gate::NonContextual(g) => g.visit_parameters(&under("modulator"), visit),
            Gate::Comt(m) => m.visit_parameters(&under("modulator"), visit),
            Gate::Dense(g) => g.visit_parameters(&under("output_gate"), visit),
        }
    }
}
