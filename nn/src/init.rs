//! Parameter initialisers (all seeded through [`tensor::Rng`], so a seed reproduces a
//! model bit for bit).

use autograd::Var;
use tensor::{Rng, Tensor};

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
