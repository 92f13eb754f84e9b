//! CoMT's LLaMA modulator (`002`, §3.2, SPEC §2): one scalar gate per linear projection,
//! `g(x) = σ(w₂ᵀ·φ(W₁x + c₁) + c₂)` in (0, 1), hidden width 2 by default.
//!
//! PyTorch equivalent: `torch.sigmoid(nn.Linear(h, 1)(phi(nn.Linear(d_in, h)(x))))`.
//! Init (the paper is silent; PyTorch's `nn.Linear` default is the natural reading):
//! W₁ and w₂ Kaiming-uniform, c₁ and c₂ zero, so g starts near ½ rather than at 1 (unlike
//! Transponder's calibrated σ̃, which starts at 1).

use autograd::{Result, Var};
use tensor::Rng;

use super::Phi;
use crate::init;
use crate::module::{join, Module};

/// `g(x) = σ(w₂ᵀ·φ(W₁x + c₁) + c₂)`: a scalar gate per token.
pub struct ComtModulator {
    /// `W₁: [h, d_in]`.
    pub w1: Var,
    /// `c₁: [h]`.
    pub c1: Var,
    /// `w₂: [1, h]`.
    pub w2: Var,
    /// `c₂: [1]`.
    pub c2: Var,
    /// The hidden nonlinearity φ.
    pub phi: Phi,
}

impl ComtModulator {
    /// A modulator reading `d_in` features through `hidden` units.
    pub fn new(d_in: usize, hidden: usize, phi: Phi, rng: &mut Rng) -> ComtModulator {
        ComtModulator {
            w1: init::kaiming_uniform(&[hidden, d_in], d_in, rng),
            c1: init::zeros(&[hidden]),
            w2: init::kaiming_uniform(&[1, hidden], hidden, rng),
            c2: init::zeros(&[1]),
            phi,
        }
    }

    /// The gate `[..., 1]` for `x: [..., d_in]`, values in (0, 1).
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let hidden = self.phi.apply(&x.matmul(&self.w1.transpose(0, 1)?)?.add(&self.c1)?)?;
        hidden.matmul(&self.w2.transpose(0, 1)?)?.add(&self.c2)?.sigmoid()
    }
}

impl Module for ComtModulator {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "w1"), &self.w1);
        visit(join(prefix, "c1"), &self.c1);
        visit(join(prefix, "w2"), &self.w2);
        visit(join(prefix, "c2"), &self.c2);
    }
}
