//! The Transponder modulator `G(x) = σ̃_α(B·φ(A·x + a) + b)` (eq. 4-5) and its
//! non-contextual ablation `σ̃_α(β₁·β₂)` (SPEC §1).
//!
//! PyTorch equivalent: `2*torch.sigmoid(alpha * (B(phi(A(x)))))` with `A = nn.Linear(d_in, r)`
//! and `B = nn.Linear(r, m)`. The gate has `m = 1` (scalar) or `m = d_out` (channel) columns
//! and broadcasts over the modulated output.

use autograd::{Result, Var};
use tensor::{Device, Rng, Tensor};

use super::{calibrated_sigmoid, Phi};
use crate::init;
use crate::module::{join, Module};

/// How finely a modulator scales its sublayer (Transponder §3.3, intra-layer granularity).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// One gate per token (`B: 1 × r`).
    Scalar,
    /// One gate per output channel per token (`B: d_out × r`).
    Channel,
}

/// Hyper-parameters shared by every modulator of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModulatorConfig {
    /// Bottleneck rank `r` (default 8; ablation grid 2, 4, 8, 16, 32).
    pub rank: usize,
    /// `φ` (default sigmoid).
    pub phi: Phi,
    /// When false, α stays at 1 and is not a parameter (the `fixed-alpha` ablation: it is
    /// left out of [`Module::visit_parameters`], so optimizers and checkpoints never see it).
    pub learnable_alpha: bool,
}

impl Default for ModulatorConfig {
    fn default() -> Self {
        ModulatorConfig { rank: 8, phi: Phi::Sigmoid, learnable_alpha: true }
    }
}

/// The curvature α: a trainable scalar (init 1) or the constant 1.
fn alpha(learnable: bool) -> Var {
    if learnable {
        init::ones(&[1])
    } else {
        Var::constant(Tensor::ones(&[1]))
    }
}

/// Puts a frozen α (the constant 1, not a parameter) on `device`. `Module::to_device` moves
/// parameters only, so a frozen α follows the values it gates there at their first forward
/// (one upload of one value, then none); a learnable α moves with the other parameters.
fn place_frozen_alpha(alpha: &Var, learnable: bool, device: Device) -> Result<()> {
    if !learnable && alpha.value_ref().device() != device {
        let moved = alpha.value_ref().to_device(device)?;
        alpha.set_value(moved)?;
    }
    Ok(())
}

/// `G(x) = σ̃_α(B·φ(A·x + a) + b)` (Transponder eq. 4 with the biases of SPEC §1).
/// Init: A and B Kaiming-uniform, a and b zero, α = 1.
pub struct Modulator {
    /// `A: [r, d_in]`.
    pub a_weight: Var,
    /// `a: [r]`.
    pub a_bias: Var,
    /// `B: [m, r]`, m = 1 or d_out.
    pub b_weight: Var,
    /// `b: [m]`.
    pub b_bias: Var,
    /// `α: [1]`.
    pub alpha: Var,
    /// Scalar or channel gate.
    pub resolution: Resolution,
    /// The hidden nonlinearity φ.
    pub phi: Phi,
    /// False when α is the constant 1 (then it is not a parameter).
    pub learnable_alpha: bool,
}

impl Modulator {
    /// A modulator reading `d_in` features and gating an output of width `d_out`.
    pub fn new(d_in: usize, d_out: usize, resolution: Resolution, config: ModulatorConfig, rng: &mut Rng) -> Modulator {
        let (r, m) = (config.rank, if resolution == Resolution::Channel { d_out } else { 1 });
        Modulator {
            a_weight: init::kaiming_uniform(&[r, d_in], d_in, rng),
            a_bias: init::zeros(&[r]),
            b_weight: init::kaiming_uniform(&[m, r], r, rng),
            b_bias: init::zeros(&[m]),
            alpha: alpha(config.learnable_alpha),
            resolution,
            phi: config.phi,
            learnable_alpha: config.learnable_alpha,
        }
    }

    /// The gate `[..., m]` for `x: [..., d_in]`, values in (0, 2).
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.place_frozen_alpha(x.value_ref().device())?;
        let hidden = self.phi.apply(&x.matmul(&self.a_weight.transpose(0, 1)?)?.add(&self.a_bias)?)?;
        let logits = hidden.matmul(&self.b_weight.transpose(0, 1)?)?.add(&self.b_bias)?;
        calibrated_sigmoid(&logits, &self.alpha)
    }

    /// Puts α on `device` when it is frozen (a constant that `Module::to_device` does not see).
    pub fn place_frozen_alpha(&self, device: Device) -> Result<()> {
        place_frozen_alpha(&self.alpha, self.learnable_alpha, device)
    }

    /// `[A, a, B, b, α]`, the order [`Var::fused_gated_projection`] takes.
    pub fn parameters_in_order(&self) -> [&Var; 5] {
        [&self.a_weight, &self.a_bias, &self.b_weight, &self.b_bias, &self.alpha]
    }

    /// Its name under the modulated layer: `modulator_scalar` or `modulator_channel`.
    pub fn name(&self) -> &'static str {
        match self.resolution {
            Resolution::Scalar => "modulator_scalar",
            Resolution::Channel => "modulator_channel",
        }
    }
}

impl Module for Modulator {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "A"), &self.a_weight);
        visit(join(prefix, "a"), &self.a_bias);
        visit(join(prefix, "B"), &self.b_weight);
        visit(join(prefix, "b"), &self.b_bias);
        if self.learnable_alpha {
            visit(join(prefix, "alpha"), &self.alpha);
        }
    }
}

/// `G = σ̃_α(β₁·β₂)`: the same calibrated gate with input-independent logits (SPEC §1,
/// `non-contextual`). β₁ scalar (init 1), β₂ ∈ R^{d_out} (init 0), so G = 1 at init.
pub struct NonContextualGate {
    /// `β₁: [1]`.
    pub beta1: Var,
    /// `β₂: [d_out]`.
    pub beta2: Var,
    /// `α: [1]`.
    pub alpha: Var,
    /// False when α is the constant 1 (then it is not a parameter).
    pub learnable_alpha: bool,
}

impl NonContextualGate {
    /// A gate over `d_out` channels; `learnable_alpha = false` freezes α at 1.
    pub fn new(d_out: usize, learnable_alpha: bool) -> NonContextualGate {
        NonContextualGate {
            beta1: init::ones(&[1]),
            beta2: init::zeros(&[d_out]),
            alpha: alpha(learnable_alpha),
            learnable_alpha,
        }
    }

    /// The gate `[d_out]` (it broadcasts over tokens; the input is not read).
    pub fn forward(&self) -> Result<Var> {
        place_frozen_alpha(&self.alpha, self.learnable_alpha, self.beta1.value_ref().device())?;
        calibrated_sigmoid(&self.beta2.mul(&self.beta1)?, &self.alpha)
    }
}

impl Module for NonContextualGate {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "beta1"), &self.beta1);
        visit(join(prefix, "beta2"), &self.beta2);
        if self.learnable_alpha {
            visit(join(prefix, "alpha"), &self.alpha);
        }
    }
}
