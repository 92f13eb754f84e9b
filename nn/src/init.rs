//! Parameter initialisers (all seeded through [`tensor::Rng`], so a seed reproduces a
//! model bit for bit).

use autograd::Var;
use tensor::{Rng, Tensor};

use crate::layers::Linear;

/// Kaiming-uniform (PyTorch `nn.Linear` default): U(−1/√fan_in, 1/√fan_in).
pub fn kaiming_uniform(shape: &[usize], fan_in: usize, rng: &mut Rng) -> Var {
    Var::parameter(Tensor::kaiming_uniform(shape, fan_in, rng))
}

/// Normal with mean 0 and standard deviation `std`.
pub fn normal(shape: &[usize], std: f32, rng: &mut Rng) -> Var {
    Var::parameter(Tensor::rand_normal(shape, 0.0, std, rng))
}

/// Zeros.
pub fn zeros(shape: &[usize]) -> Var {
    Var::parameter(Tensor::zeros(shape))
}

/// Ones.
pub fn ones(shape: &[usize]) -> Var {
    Var::parameter(Tensor::ones(shape))
}

/// A constant fill.
pub fn constant(shape: &[usize], value: f32) -> Var {
    Var::parameter(Tensor::full(shape, value))
}

/// How a projection's weight `[out, in]` is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WeightInit {
    /// U(−1/√in, 1/√in), PyTorch `nn.Linear`'s default.
    KaimingUniform,
    /// N(0, std²): Hugging Face LLaMA's `initializer_range` (0.02).
    Normal {
        /// Standard deviation.
        std: f32,
    },
}

impl WeightInit {
    /// A bias-free `in_features → out_features` linear layer initialised this way.
    pub fn linear(self, in_features: usize, out_features: usize, rng: &mut Rng) -> Linear {
        let weight = match self {
            WeightInit::KaimingUniform => kaiming_uniform(&[out_features, in_features], in_features, rng),
            WeightInit::Normal { std } => normal(&[out_features, in_features], std, rng),
        };
        Linear { weight, bias: None }
    }
}
