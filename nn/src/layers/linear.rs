//! `y = x·Wᵀ (+ b)`, weight stored `[out, in]` as PyTorch and Hugging Face do.

use autograd::{Result, Var};
use tensor::Rng;

use crate::init;
use crate::module::{join, Module};

/// A fully connected layer (no bias by default, as in LLaMA).
pub struct Linear {
    /// `w[out, in]` (PyTorch's layout: `y = x·wᵀ + b`).
    pub weight: Var,
    /// `b[out]`, if any.
    pub bias: Option<Var>,
}

impl Linear {
    /// Kaiming-uniform weight `[out, in]`; bias (if any) zero.
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &mut Rng) -> Linear {
        Linear {
            weight: init::kaiming_uniform(&[out_features, in_features], in_features, rng),
            bias: bias.then(|| init::zeros(&[out_features])),
        }
    }

    /// `x[..., in] → [..., out]`. The transpose is a stride swap, not a copy.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let y = x.matmul(&self.weight.transpose(0, 1)?)?;
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Linear {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            visit(join(prefix, "bias"), b);
        }
    }
}
