//! Residual blocks: basic (two 3×3 convolutions) and bottleneck (1×1 → 3×3 → 1×1, expansion
//! 4, stride on the 3×3 as torchvision's ResNet v1.5), each `relu(F(x) + shortcut(x))` with
//! `F` a chain of conv → BatchNorm (→ ReLU between links) and a 1×1 conv + BatchNorm
//! shortcut where the shape changes.
//!
//! CoMT placement (SPEC §2): modulators sit in the residual branch `F` only — pixel
//! modulators replace every BatchNorm affine of `F`, sliding-window modulators scale every
//! convolution of `F` (3×3 and 1×1). The stem, the shortcut projection and the classifier
//! stay plain. This is the placement that reproduces the paper's overhead column (ResNet-18
//! pixel(2) 0.07%, sliding-window(1/64) 1.42%; ResNet-50 0.19% / 1.88%; ResNet-152 0.25% /
//! 2.18% on CIFAR-100); modulating the shortcut too would give ResNet-18 sliding 1.44% and
//! ResNet-50 pixel 0.22%.
//!
//! Parameter names follow torchvision (`conv1.weight`, `bn1.weight`, `downsample.0.weight`,
//! `downsample.1.running_mean`), modulators under the layer they modulate (`conv1.modulator.*`,
//! `bn1.modulator.*`).

use autograd::{Result, Var};
use nn::init;
use nn::modulator::Phi;
use nn::module::join;
use nn::vision::{
    sliding_window_hidden, BatchNorm2d, Buffers, Conv2d, GateRange, PixelBatchNorm2d, SlidingWindowConv2d,
};
use nn::Module;
use tensor::Rng;

use super::config::{Modulation, Parsed};

/// Bottleneck blocks widen their output 4×.
pub const BOTTLENECK_EXPANSION: usize = 4;

/// A convolution of a residual branch: plain or sliding-window modulated.
pub enum BranchConv {
    /// A plain convolution.
    Plain(Conv2d),
    /// A convolution whose output a sliding-window modulator gates.
    SlidingWindow(SlidingWindowConv2d),
}

impl BranchConv {
    /// `conv(x)`, or `conv(x) ⊙ m(x)`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        match self {
            BranchConv::Plain(c) => c.forward(x),
            BranchConv::SlidingWindow(c) => c.forward(x),
        }
    }
}

impl Module for BranchConv {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        match self {
            BranchConv::Plain(c) => c.visit_parameters(prefix, visit),
            BranchConv::SlidingWindow(c) => c.visit_parameters(prefix, visit),
        }
    }
}

/// A BatchNorm of a residual branch: plain (affine) or pixel-modulated.
pub enum BranchNorm {
    /// A plain affine BatchNorm.
    Plain(BatchNorm2d),
    /// A BatchNorm whose affine transform a pixel modulator gates.
    Pixel(PixelBatchNorm2d),
}

impl BranchNorm {
    /// `γ·x̂ + β`, or `x̂ ⊙ m(x̂) + β`.
    pub fn forward(&self, x: &Var, training: bool) -> Result<Var> {
        match self {
            BranchNorm::Plain(n) => n.forward(x, training),
            BranchNorm::Pixel(n) => n.forward(x, training),
        }
    }
}

impl Module for BranchNorm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        match self {
            BranchNorm::Plain(n) => n.visit_parameters(prefix, visit),
            BranchNorm::Pixel(n) => n.visit_parameters(prefix, visit),
        }
    }
}

impl Buffers for BranchNorm {
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        match self {
            BranchNorm::Plain(n) => n.visit_buffers(prefix, visit),
            BranchNorm::Pixel(n) => n.visit_buffers(prefix, visit),
        }
    }
}

/// Builds layers with the config's init, BatchNorm settings and modulators.
pub(crate) struct Builder<'a> {
    pub parsed: Parsed,
    pub bn_momentum: f32,
    pub bn_eps: f32,
    pub rng: &'a mut Rng,
}

impl Builder<'_> {
    /// A bias-free `k×k` convolution, weight Kaiming-normal with fan-out (torchvision's
    /// ResNet init: N(0, 2/(O·k·k))).
    pub fn conv(&mut self, in_channels: usize, out_channels: usize, kernel: usize, stride: usize) -> Conv2d {
        let std = (2.0 / (out_channels * kernel * kernel) as f32).sqrt();
        let weight = init::normal(&[out_channels, in_channels, kernel, kernel], std, self.rng);
        Conv2d { weight, bias: None, stride, padding: kernel / 2 }
    }

    /// A BatchNorm with affine weight 1, bias 0.
    pub fn norm(&self, channels: usize) -> BatchNorm2d {
        let mut norm = BatchNorm2d::new(channels, true);
        (norm.momentum, norm.eps) = (self.bn_momentum, self.bn_eps);
        norm
    }

    fn branch_conv(&mut self, in_channels: usize, out_channels: usize, kernel: usize, stride: usize) -> BranchConv {
        let conv = self.conv(in_channels, out_channels, kernel, stride);
        let (phi, range): (Phi, GateRange) = (self.parsed.phi, self.parsed.gate_range);
        match self.parsed.modulation {
            Modulation::SlidingWindow { divisor } => {
                let hidden = sliding_window_hidden(in_channels, divisor);
                BranchConv::SlidingWindow(SlidingWindowConv2d::new(conv, hidden, phi, range, self.rng))
            }
            _ => BranchConv::Plain(conv),
        }
    }

    fn branch_norm(&mut self, channels: usize) -> BranchNorm {
        match self.parsed.modulation {
            Modulation::Pixel { hidden } => {
                let mut pixel =
                    PixelBatchNorm2d::new(channels, hidden, self.parsed.phi, self.parsed.gate_range, self.rng);
                (pixel.norm.momentum, pixel.norm.eps) = (self.bn_momentum, self.bn_eps);
                BranchNorm::Pixel(pixel)
            }
            _ => BranchNorm::Plain(self.norm(channels)),
        }
    }

    /// One block from `in_channels` at `width` (its output is `width`, or `4·width` for a
    /// bottleneck), the first convolution with stride `stride` (the 3×3 one in a bottleneck).
    pub fn block(&mut self, in_channels: usize, width: usize, stride: usize) -> Block {
        // (in, out, kernel, stride) of each link of the residual branch.
        let links = if self.parsed.bottleneck {
            let out = width * BOTTLENECK_EXPANSION;
            vec![(in_channels, width, 1, 1), (width, width, 3, stride), (width, out, 1, 1)]
        } else {
            vec![(in_channels, width, 3, stride), (width, width, 3, 1)]
        };
        let out_channels = links.last().expect("blocks have links").1;
        let branch = links
            .into_iter()
            .map(|(i, o, k, s)| {
                let conv = self.branch_conv(i, o, k, s);
                (conv, self.branch_norm(o))
            })
            .collect();
        let downsample = (stride != 1 || in_channels != out_channels)
            .then(|| (self.conv(in_channels, out_channels, 1, stride), self.norm(out_channels)));
        Block { branch, downsample }
    }
}

/// `relu(F(x) + shortcut(x))`, `F` = conv → norm (→ ReLU) links, the shortcut the identity
/// or a strided 1×1 conv + BatchNorm.
pub struct Block {
    /// `(conv{i+1}, bn{i+1})` links of `F`: two for basic blocks, three for bottlenecks.
    pub branch: Vec<(BranchConv, BranchNorm)>,
    /// The projection shortcut (`downsample.0`, `downsample.1`) where the shape changes.
    pub downsample: Option<(Conv2d, BatchNorm2d)>,
}

impl Block {
    /// `x[N, C, H, W] → [N, C', H/stride, W/stride]`.
    pub fn forward(&self, x: &Var, training: bool) -> Result<Var> {
        let mut h = x.clone();
        let last = self.branch.len() - 1;
        for (i, (conv, norm)) in self.branch.iter().enumerate() {
            h = norm.forward(&conv.forward(&h)?, training)?;
            if i < last {
                h = h.relu()?;
            }
        }
        let shortcut = match &self.downsample {
            Some((conv, norm)) => norm.forward(&conv.forward(x)?, training)?,
            None => x.clone(),
        };
        h.add(&shortcut)?.relu()
    }
}

impl Module for Block {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        for (i, (conv, norm)) in self.branch.iter().enumerate() {
            conv.visit_parameters(&join(prefix, &format!("conv{}.", i + 1)), visit);
            norm.visit_parameters(&join(prefix, &format!("bn{}.", i + 1)), visit);
        }
        if let Some((conv, norm)) = &self.downsample {
            conv.visit_parameters(&join(prefix, "downsample.0."), visit);
            norm.visit_parameters(&join(prefix, "downsample.1."), visit);
        }
    }
}

impl Buffers for Block {
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        for (i, (_, norm)) in self.branch.iter().enumerate() {
            norm.visit_buffers(&join(prefix, &format!("bn{}.", i + 1)), visit);
        }
        if let Some((_, norm)) = &self.downsample {
            norm.visit_buffers(&join(prefix, "downsample.1."), visit);
        }
    }
}
