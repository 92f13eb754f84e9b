//! `Conv2d`: `y[N, O, OH, OW] = conv(x[N, C, H, W], w[O, C, KH, KW]) (+ b[O])`, a square
//! kernel with the same stride and zero padding along both axes.
//!
//! PyTorch equivalent: `nn.Conv2d(C, O, k, stride, padding, bias)` (groups 1, dilation 1).
//! Init: weight Kaiming-uniform U(±1/√fan_in), fan_in = C·k·k (PyTorch's default bound);
//! bias zero, as [`crate::layers::Linear`]. Models override the weight init where their
//! recipe says so (ResNet: Kaiming-normal, fan-out).

use autograd::{Result, Var};
use tensor::Rng;

use crate::init;
use crate::module::{join, Module};

/// A 2-D convolution layer.
pub struct Conv2d {
    /// `w[O, C, k, k]`.
    pub weight: Var,
    /// `b[O]`, if any.
    pub bias: Option<Var>,
    /// Step of the window, both axes.
    pub stride: usize,
    /// Zeros added on each side, both axes.
    pub padding: usize,
}

impl Conv2d {
    /// A `k×k` convolution from `in_channels` to `out_channels`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
        rng: &mut Rng,
    ) -> Conv2d {
        let fan_in = in_channels * kernel * kernel;
        Conv2d {
            weight: init::kaiming_uniform(&[out_channels, in_channels, kernel, kernel], fan_in, rng),
            bias: bias.then(|| init::zeros(&[out_channels])),
            stride,
            padding,
        }
    }

    /// `x[N, C, H, W] → [N, O, OH, OW]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        x.conv2d(&self.weight, self.bias.as_ref(), self.stride, self.padding)
    }

    /// `C`.
    pub fn in_channels(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `O`.
    pub fn out_channels(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `k` of the square kernel.
    pub fn kernel_size(&self) -> usize {
        self.weight.shape()[2]
    }
}

impl Module for Conv2d {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            visit(join(prefix, "bias"), b);
        }
    }
}
