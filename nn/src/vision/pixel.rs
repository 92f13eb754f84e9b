//! CoMT's pixel modulator (`002` §3.3, SPEC §2), which replaces the BatchNorm affine:
//!
//! ```text
//! x̂ = BN_noaffine(x),   y = x̂ ⊙ m(x̂) + β,   m = σ̃(conv1x1_{h→1}(φ(conv1x1_{C→h}(x̂))))
//! ```
//!
//! `m[N, 1, H, W]` is one scale per pixel, broadcast over the `C` channels; `β[C]` is the
//! BatchNorm shift, kept. Hidden width `h` ∈ {2, 4, 8}, 2 by default; `σ̃ = 2σ` unless the
//! gate range is `unit` (plain σ).
//!
//! PyTorch equivalent: `bn = nn.BatchNorm2d(C, affine=False)`, `m = σ̃(conv2(φ(conv1(x̂))))`
//! with `conv1 = nn.Conv2d(C, h, 1)`, `conv2 = nn.Conv2d(h, 1, 1)`, `y = x̂ * m + β.view(1, C, 1, 1)`.
//! Init (the paper is silent): both 1×1 convolutions Kaiming-uniform with zero biases (SPEC
//! §1's modulator init), β zero. Parameters: `bias` (β), `modulator.conv1.{weight,bias}`,
//! `modulator.conv2.{weight,bias}`; buffers `running_mean`, `running_var` (the names a
//! `BatchNorm2d` would have, so only the affine weight disappears from a checkpoint).
//! Gradients flow through the autograd ops; nothing is saved beyond what they save.

use autograd::{Result, Var};
use tensor::Rng;

use super::{BatchNorm2d, Buffers, Conv2d, GateRange};
use crate::init;
use crate::modulator::Phi;
use crate::module::{join, Module};

/// `m(x̂) = σ̃(conv1x1_{h→1}(φ(conv1x1_{C→h}(x̂))))`: one scale per pixel.
pub struct PixelModulator {
    /// `conv1x1_{C→h}` with bias.
    pub conv1: Conv2d,
    /// `conv1x1_{h→1}` with bias.
    pub conv2: Conv2d,
    /// The nonlinearity `φ` between the two convolutions.
    pub phi: Phi,
    /// The final squashing `σ̃`.
    pub range: GateRange,
}

impl PixelModulator {
    /// A modulator reading `channels` through `hidden` units.
    pub fn new(channels: usize, hidden: usize, phi: Phi, range: GateRange, rng: &mut Rng) -> PixelModulator {
        PixelModulator {
            conv1: Conv2d::new(channels, hidden, 1, 1, 0, true, rng),
            conv2: Conv2d::new(hidden, 1, 1, 1, 0, true, rng),
            phi,
            range,
        }
    }

    /// `m[N, 1, H, W]` for `x̂[N, C, H, W]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let hidden = self.phi.apply(&self.conv1.forward(x)?)?;
        self.range.apply(&self.conv2.forward(&hidden)?)
    }
}

impl Module for PixelModulator {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.conv1.visit_parameters(&join(prefix, "conv1."), visit);
        self.conv2.visit_parameters(&join(prefix, "conv2."), visit);
    }
}

/// A BatchNorm whose affine `γ·x̂ + β` is replaced by `x̂ ⊙ m(x̂) + β`.
pub struct PixelBatchNorm2d {
    /// The normalisation without affine (running statistics live here).
    pub norm: BatchNorm2d,
    /// `β[C]` (init 0).
    pub bias: Var,
    /// `m`, the per-pixel scale that replaces `γ`.
    pub modulator: PixelModulator,
}

impl PixelBatchNorm2d {
    /// A pixel-modulated batch norm over `channels` with a `hidden`-wide modulator.
    pub fn new(channels: usize, hidden: usize, phi: Phi, range: GateRange, rng: &mut Rng) -> PixelBatchNorm2d {
        PixelBatchNorm2d {
            norm: BatchNorm2d::new(channels, false),
            bias: init::zeros(&[channels]),
            modulator: PixelModulator::new(channels, hidden, phi, range, rng),
        }
    }

    /// `y = x̂ ⊙ m(x̂) + β` with `x̂` the (batch or running) normalised `x[N, C, H, W]`.
    pub fn forward(&self, x: &Var, training: bool) -> Result<Var> {
        let x_hat = self.norm.forward(x, training)?;
        let scale = self.modulator.forward(&x_hat)?;
        let channels = self.norm.channels();
        x_hat.mul(&scale)?.add(&self.bias.reshape(&[1, channels, 1, 1])?)
    }
}

impl Module for PixelBatchNorm2d {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "bias"), &self.bias);
        self.modulator.visit_parameters(&join(prefix, "modulator."), visit);
    }
}

impl Buffers for PixelBatchNorm2d {
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.norm.visit_buffers(prefix, visit);
    }
}
