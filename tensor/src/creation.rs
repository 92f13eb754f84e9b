//! Creating tensors: constants, ranges and seeded random initialisers.

use crate::{Rng, Tensor};

impl Tensor {
    /// A tensor of `shape` filled with `value`.
    pub fn full(shape: &[usize], value: f32) -> Tensor {
        let numel = shape.iter().product();
        Tensor::from_vec(vec![value; numel], shape).expect("full: length matches shape by construction")
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::full(shape, 0.0)
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize]) -> Tensor {
        Tensor::full(shape, 1.0)
    }

    /// A rank-0 tensor holding `value`.
    pub fn scalar(value: f32) -> Tensor {
        Tensor::full(&[], value)
    }

    /// `[start, start + step, ...]` with `len` elements (PyTorch `arange(start, start+len·step, step)`).
    pub fn arange(start: f32, step: f32, len: usize) -> Tensor {
        let data = (0..len).map(|i| start + step * i as f32).collect();
        Tensor::from_vec(data, &[len]).expect("arange: length matches shape by construction")
    }

    /// Uniform samples in [low, high) drawn from `rng` in row-major order.
    pub fn rand_uniform(shape: &[usize], low: f32, high: f32, rng: &mut Rng) -> Tensor {
        let numel = shape.iter().product();
        let data = (0..numel).map(|_| rng.uniform_range(low, high)).collect();
        Tensor::from_vec(data, shape).expect("rand_uniform: length matches shape by construction")
    }

    /// Normal samples with `mean` and `std` drawn from `rng` in row-major order.
    pub fn rand_normal(shape: &[usize], mean: f32, std: f32, rng: &mut Rng) -> Tensor {
        let numel = shape.iter().product();
        let data = (0..numel).map(|_| mean + std * rng.normal()).collect();
        Tensor::from_vec(data, shape).expect("rand_normal: length matches shape by construction")
    }

    /// Kaiming-uniform init (PyTorch `nn.Linear`'s default, `a = √5`): U(−b, b) with
    /// b = 1/√fan_in. Used for the modulators' A and B (Transponder §1 init).
    pub fn kaiming_uniform(shape: &[usize], fan_in: usize, rng: &mut Rng) -> Tensor {
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        Tensor::rand_uniform(shape, -bound, bound, rng)
    }

    /// A tensor of the same shape filled with `value`.
    pub fn full_like(&self, value: f32) -> Tensor {
        Tensor::full(&self.shape, value)
    }

    /// A tensor of the same shape filled with zeros.
    pub fn zeros_like(&self) -> Tensor {
        Tensor::zeros(&self.shape)
    }
}
