//! `BatchNorm2d`: per-channel normalisation of `x[N, C, H, W]` over `N, H, W`, with optional
//! affine `weight` (init 1) and `bias` (init 0), and running statistics for evaluation.
//!
//! PyTorch equivalent: `nn.BatchNorm2d(C, eps=1e-5, momentum=0.1, affine)`. The running
//! mean (init 0) and variance (init 1) are buffers: non-trainable [`Var`] constants, updated
//! in place by every training-mode forward and listed by [`Buffers::visit_buffers`] under
//! PyTorch's names (`running_mean`, `running_var`). PyTorch's `num_batches_tracked` is not
//! kept: it only matters with `momentum = None` (a cumulative average).

use autograd::{Result, Var};
use tensor::Tensor;

use super::Buffers;
use crate::init;
use crate::module::{join, Module};

/// Batch normalisation over the channels of an image batch.
pub struct BatchNorm2d {
    /// `γ[C]` (init 1), absent without affine.
    pub weight: Option<Var>,
    /// `β[C]` (init 0), absent without affine.
    pub bias: Option<Var>,
    /// Running mean `[C]` (a buffer).
    pub running_mean: Var,
    /// Running unbiased variance `[C]` (a buffer).
    pub running_var: Var,
    /// Weight of the newest batch in the running statistics (0.1).
    pub momentum: f32,
    /// Added to the variance before the square root.
    pub eps: f32,
}

impl BatchNorm2d {
    /// A batch norm over `channels`; `affine = false` only normalises.
    pub fn new(channels: usize, affine: bool) -> BatchNorm2d {
        BatchNorm2d {
            weight: affine.then(|| init::ones(&[channels])),
            bias: affine.then(|| init::zeros(&[channels])),
            running_mean: Var::constant(Tensor::zeros(&[channels])),
            running_var: Var::constant(Tensor::ones(&[channels])),
            momentum: 0.1,
            eps: 1e-5,
        }
    }

    /// Batch statistics (and a running-statistics update) when `training`, the running
    /// statistics otherwise.
    pub fn forward(&self, x: &Var, training: bool) -> Result<Var> {
        x.batch_norm2d(
            self.weight.as_ref(),
            self.bias.as_ref(),
            [&self.running_mean, &self.running_var],
            training,
            self.momentum,
            self.eps,
        )
    }

    /// `C`.
    pub fn channels(&self) -> usize {
        self.running_mean.shape()[0]
    }
}

impl Module for BatchNorm2d {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        if let Some(w) = &self.weight {
            visit(join(prefix, "weight"), w);
        }
        if let Some(b) = &self.bias {
            visit(join(prefix, "bias"), b);
        }
    }
}

impl Buffers for BatchNorm2d {
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "running_mean"), &self.running_mean);
        visit(join(prefix, "running_var"), &self.running_var);
    }
}
