//! Normalisation layers: RMSNorm (LLaMA), LayerNorm, and DyT (`γ ⊙ tanh(α·x) + β`,
//! the norm-free baseline of SPEC §5), and [`Norm`], the choice between RMSNorm and DyT a
//! decoder block makes.

use autograd::{Result, Var};

use crate::init;
use crate::module::{join, Module};

/// RMSNorm with a learnable gain (init 1), eps 1e-6 as LLaMA.
pub struct RmsNorm {
    /// The gain `[dim]`.
    pub weight: Var,
    /// Added to the mean square before the square root.
    pub eps: f32,
}

impl RmsNorm {
    /// Gain of ones over `dim`.
    pub fn new(dim: usize) -> RmsNorm {
        RmsNorm { weight: init::ones(&[dim]), eps: 1e-6 }
    }

    /// Normalises the last axis.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        x.rms_norm(&self.weight, self.eps)
    }

    /// The residual add before a pre-ln LLaMA sublayer and this norm in one kernel:
    /// `(x + delta, RMSNorm(x + delta))` ([`Var::add_rms_norm`]).
    pub fn forward_after_add(&self, x: &Var, delta: &Var) -> Result<(Var, Var)> {
        x.add_rms_norm(delta, &self.weight, self.eps)
    }
}

impl Module for RmsNorm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
    }
}

/// LayerNorm with optional affine parameters (weight 1, bias 0), eps 1e-5 as PyTorch.
pub struct LayerNorm {
    /// The gain `[dim]`, if affine.
    pub weight: Option<Var>,
    /// The shift `[dim]`, if affine.
    pub bias: Option<Var>,
    /// Added to the variance before the square root.
    pub eps: f32,
}

impl LayerNorm {
    /// `affine = false` normalises only (CCL's basis norm can use either).
    pub fn new(dim: usize, affine: bool) -> LayerNorm {
        LayerNorm { weight: affine.then(|| init::ones(&[dim])), bias: affine.then(|| init::zeros(&[dim])), eps: 1e-5 }
    }

    /// Normalises the last axis.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }
}

impl Module for LayerNorm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        if let Some(w) = &self.weight {
            visit(join(prefix, "weight"), w);
        }
        if let Some(b) = &self.bias {
            visit(join(prefix, "bias"), b);
        }
    }
}

/// Dynamic Tanh: `γ ⊙ tanh(α·x) + β`, α a learnable scalar (init 0.5), γ = 1, β = 0.
pub struct DyT {
    /// The scalar `α` inside the tanh (a one-element parameter).
    pub alpha: Var,
    /// The gain `γ[dim]`.
    pub weight: Var,
    /// The shift `β[dim]`.
    pub bias: Var,
}

impl DyT {
    /// DyT over `dim` channels.
    pub fn new(dim: usize) -> DyT {
        DyT { alpha: init::constant(&[1], 0.5), weight: init::ones(&[dim]), bias: init::zeros(&[dim]) }
    }

    /// Applies the elementwise squashing in place of a norm.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        x.mul(&self.alpha)?.tanh()?.mul(&self.weight)?.add(&self.bias)
    }
}

impl Module for DyT {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "alpha"), &self.alpha);
        visit(join(prefix, "weight"), &self.weight);
        visit(join(prefix, "bias"), &self.bias);
    }
}

/// A block's normalisation layer.
pub enum Norm {
    /// RMSNorm (LLaMA).
    Rms(RmsNorm),
    /// `γ ⊙ tanh(α·x) + β`, α init 0.5 (the `dyt` baseline).
    Dyt(DyT),
}

impl Norm {
    /// An RMSNorm over `dim` with `eps`.
    pub fn rms(dim: usize, eps: f32) -> Norm {
        Norm::Rms(RmsNorm { eps, ..RmsNorm::new(dim) })
    }

    /// Normalises (or squashes) the last axis.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        match self {
            Norm::Rms(n) => n.forward(x),
            Norm::Dyt(n) => n.forward(x),
        }
    }
}

impl Module for Norm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        match self {
            Norm::Rms(n) => n.visit_parameters(prefix, visit),
            Norm::Dyt(n) => n.visit_parameters(prefix, visit),
        }
    }
}
