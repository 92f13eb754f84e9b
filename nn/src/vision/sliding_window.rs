//! CoMT's sliding-window modulator (`002` §3.3, SPEC §2): for a convolution `k×k, stride s,
//! padding p` from `C_in` channels,
//!
//! ```text
//! m = σ̃(conv1x1_{h→1}(φ(conv_{k,s,p}(C_in→h)(x)))),   output = conv(x) ⊙ m
//! ```
//!
//! The first modulator convolution repeats the modulated one's kernel, stride and padding,
//! so `m[N, 1, OH, OW]` holds one scale per sliding window (output position), broadcast over
//! the output channels. Hidden width `h = max(1, C_in / divisor)` with divisor 64 by default
//! (the paper's ratios 1/16, 1/32, 1/64); `σ̃ = 2σ` unless the gate range is `unit`.
//!
//! PyTorch equivalent: `conv(x) * σ̃(nn.Conv2d(h, 1, 1)(φ(nn.Conv2d(C_in, h, k, s, p)(x))))`.
//! Init (the paper is silent): Kaiming-uniform weights, zero biases (SPEC §1's modulator
//! init). Parameters under the modulated convolution's name: its own `weight` (and `bias`),
//! then `modulator.window.{weight,bias}` and `modulator.conv2.{weight,bias}`.

use autograd::{Result, Var};
use tensor::Rng;

use super::{Conv2d, GateRange};
use crate::modulator::Phi;
use crate::module::{join, Module};

/// `h = max(1, C_in / divisor)`: the paper's ratios 1/16, 1/32, 1/64 are divisors 16, 32, 64.
pub fn sliding_window_hidden(in_channels: usize, divisor: usize) -> usize {
    (in_channels / divisor.max(1)).max(1)
}

/// `m(x) = σ̃(conv1x1_{h→1}(φ(conv_{k,s,p}(C_in→h)(x))))`: one scale per output position.
pub struct SlidingWindowModulator {
    /// `conv_{k,s,p}(C_in→h)` with bias: the modulated convolution's window.
    pub window: Conv2d,
    /// `conv1x1_{h→1}` with bias.
    pub conv2: Conv2d,
    /// The nonlinearity `φ` between the two convolutions.
    pub phi: Phi,
    /// The final squashing `σ̃`.
    pub range: GateRange,
}

impl SlidingWindowModulator {
    /// A modulator for `conv` (same input channels, kernel, stride and padding) through
    /// `hidden` units.
    pub fn new(conv: &Conv2d, hidden: usize, phi: Phi, range: GateRange, rng: &mut Rng) -> SlidingWindowModulator {
        let (k, s, p) = (conv.kernel_size(), conv.stride, conv.padding);
        SlidingWindowModulator {
            window: Conv2d::new(conv.in_channels(), hidden, k, s, p, true, rng),
            conv2: Conv2d::new(hidden, 1, 1, 1, 0, true, rng),
            phi,
            range,
        }
    }

    /// `m[N, 1, OH, OW]` for the modulated convolution's input `x[N, C_in, H, W]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        let hidden = self.phi.apply(&self.window.forward(x)?)?;
        self.range.apply(&self.conv2.forward(&hidden)?)
    }
}

impl Module for SlidingWindowModulator {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.window.visit_parameters(&join(prefix, "window."), visit);
        self.conv2.visit_parameters(&join(prefix, "conv2."), visit);
    }
}

/// A convolution whose output is scaled per sliding window: `conv(x) ⊙ m(x)`.
pub struct SlidingWindowConv2d {
    /// The modulated convolution.
    pub conv: Conv2d,
    /// `m`, one scale per output position of `conv`.
    pub modulator: SlidingWindowModulator,
}

impl SlidingWindowConv2d {
    /// Wraps `conv` with a `hidden`-wide modulator reading the same input.
    pub fn new(conv: Conv2d, hidden: usize, phi: Phi, range: GateRange, rng: &mut Rng) -> SlidingWindowConv2d {
        let modulator = SlidingWindowModulator::new(&conv, hidden, phi, range, rng);
        SlidingWindowConv2d { conv, modulator }
    }

    /// `conv(x) ⊙ m(x)`, `[N, O, OH, OW]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.conv.forward(x)?.mul(&self.modulator.forward(x)?)
    }
}

impl Module for SlidingWindowConv2d {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.conv.visit_parameters(prefix, visit);
        self.modulator.visit_parameters(&join(prefix, "modulator."), visit);
    }
}
