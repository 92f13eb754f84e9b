//! ResNet-18/34/50/101/152 (He et al. 2016; SPEC §6) with CoMT's pixel and sliding-window
//! modulators (`002` §3.3; SPEC §2): stem → four stages of residual [`Block`]s → global
//! average pool → linear classifier.
//!
//! Stems: `cifar` (3×3/1 conv, BatchNorm, ReLU, no max-pool: 32×32 inputs keep their
//! resolution into the first stage) and `imagenet` (7×7/2 conv, BatchNorm, ReLU, 3×3/2
//! max-pool). Stage `i` has width `base_width · 2^i` (64 in the papers; a narrower
//! `base_width` gives fast nets for tests and CPU runs) and stride 2 from the second stage on.
//! Input channels and classes are configurable (1 and 10 for digits, 3 and 10/100 for CIFAR).
//!
//! PyTorch equivalent: `torchvision.models.resnet18(num_classes)` (v1.5: the bottleneck's
//! stride on its 3×3), with `conv1 = Conv2d(C, 64, 3, 1, 1, bias=False)` and
//! `maxpool = Identity()` for the CIFAR stem. Parameter and buffer names are torchvision's
//! (`conv1.weight`, `bn1.running_mean`, `layer2.0.downsample.0.weight`, `fc.weight`), so a
//! baseline state dict maps one to one; modulators add `*.modulator.*` under the layer they
//! modulate, and a pixel-modulated BatchNorm has no `weight`. Init as torchvision:
//! convolutions Kaiming-normal (fan-out, ReLU gain), BatchNorm weight 1 and bias 0, the
//! classifier Kaiming-uniform with zero bias; modulators as `nn::vision` says.

mod block;
mod config;

pub use block::{Block, BranchConv, BranchNorm, BOTTLENECK_EXPANSION};
pub use config::{Modulation, Parsed, ResNetConfig, BLOCKS, MODULATORS, PRESETS, STEMS};

use autograd::Var;
use nn::layers::Linear;
use nn::module::join;
use nn::vision::{BatchNorm2d, Buffers, Conv2d};
use nn::Module;
use tensor::Rng;

use block::Builder;

use crate::{Error, Result};

/// Marker in the names of every modulator parameter (`layer1.0.bn1.modulator.conv1.weight`).
pub const MODULATOR_MARKER: &str = ".modulator.";

/// A ResNet built from a [`ResNetConfig`].
pub struct ResNet {
    /// The config it was built from.
    pub config: ResNetConfig,
    /// Stem convolution (3×3/1 or 7×7/2).
    pub conv1: Conv2d,
    /// Stem BatchNorm.
    pub bn1: BatchNorm2d,
    /// `layer1` … `layer4`: the blocks of each stage.
    pub stages: Vec<Vec<Block>>,
    /// The classifier.
    pub fc: Linear,
}

impl ResNet {
    /// Builds the network `config` describes with weights drawn from `seed`.
    pub fn new(config: &ResNetConfig, seed: u64) -> Result<ResNet> {
        let parsed = config.parse()?;
        let mut rng = Rng::new(seed);
        let mut builder = Builder { parsed, bn_momentum: config.bn_momentum, bn_eps: config.bn_eps, rng: &mut rng };
        let (stem_kernel, stem_stride) = if parsed.imagenet_stem { (7, 2) } else { (3, 1) };
        let conv1 = builder.conv(config.in_channels, config.base_width, stem_kernel, stem_stride);
        let bn1 = builder.norm(config.base_width);
        let mut channels = config.base_width;
        let mut stages = Vec::with_capacity(config.layers.len());
        for (i, &blocks) in config.layers.iter().enumerate() {
            let width = config.base_width << i;
            let stage: Vec<Block> = (0..blocks)
                .map(|j| {
                    let stride = if i > 0 && j == 0 { 2 } else { 1 };
                    let block = builder.block(channels, width, stride);
                    channels = block.branch.last().map_or(channels, |(conv, _)| out_channels(conv));
                    block
                })
                .collect();
            stages.push(stage);
        }
        let fc = Linear::new(channels, config.num_classes, true, &mut rng);
        Ok(ResNet { config: config.clone(), conv1, bn1, stages, fc })
    }

    /// Logits `[N, classes]` for `images[N, in_channels, H, W]`. `training` selects batch
    /// statistics (and updates the running ones) or the running statistics in every
    /// BatchNorm.
    pub fn forward(&self, images: &Var, training: bool) -> Result<Var> {
        let shape = images.shape();
        if shape.len() != 4 || shape[1] != self.config.in_channels {
            return Err(Error::Config(format!("images must be [N, {}, H, W], got {shape:?}", self.config.in_channels)));
        }
        let mut h = self.bn1.forward(&self.conv1.forward(images)?, training)?.relu()?;
        if self.config.stem == "imagenet" {
            h = h.max_pool2d(3, 2, 1)?;
        }
        for block in self.stages.iter().flatten() {
            h = block.forward(&h, training)?;
        }
        Ok(self.fc.forward(&h.global_avg_pool()?)?)
    }

    /// Mean cross-entropy of the logits against `labels[N]`, and the logits.
    pub fn loss(&self, images: &Var, labels: &[u32], training: bool) -> Result<(Var, Var)> {
        let logits = self.forward(images, training)?;
        Ok((logits.cross_entropy(labels, None)?, logits))
    }

    /// Scalar parameters that belong to modulators (names containing `.modulator.`).
    pub fn modulator_parameters(&self) -> usize {
        let mut total = 0;
        self.visit_parameters("", &mut |name, var| {
            if name.contains(MODULATOR_MARKER) {
                total += var.value_ref().numel();
            }
        });
        total
    }
}

/// Output channels of a branch convolution.
fn out_channels(conv: &BranchConv) -> usize {
    match conv {
        BranchConv::Plain(c) => c.out_channels(),
        BranchConv::SlidingWindow(c) => c.conv.out_channels(),
    }
}

impl Module for ResNet {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.conv1.visit_parameters(&join(prefix, "conv1."), visit);
        self.bn1.visit_parameters(&join(prefix, "bn1."), visit);
        for (i, stage) in self.stages.iter().enumerate() {
            for (j, block) in stage.iter().enumerate() {
                block.visit_parameters(&join(prefix, &format!("layer{}.{j}.", i + 1)), visit);
            }
        }
        self.fc.visit_parameters(&join(prefix, "fc."), visit);
    }
}

impl Buffers for ResNet {
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.bn1.visit_buffers(&join(prefix, "bn1."), visit);
        for (i, stage) in self.stages.iter().enumerate() {
            for (j, block) in stage.iter().enumerate() {
                block.visit_buffers(&join(prefix, &format!("layer{}.{j}.", i + 1)), visit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(modulator: &str) -> ResNetConfig {
        ResNetConfig { base_width: 4, modulator: modulator.into(), ..ResNetConfig::default() }
    }

    #[test]
    fn names_follow_torchvision() {
        let net = ResNet::new(&ResNetConfig { base_width: 4, ..ResNetConfig::preset("resnet50").unwrap() }, 0).unwrap();
        let names: Vec<String> = net.named_parameters().into_iter().map(|p| p.name).collect();
        for want in ["conv1.weight", "bn1.bias", "layer1.0.conv3.weight", "layer2.0.downsample.0.weight", "fc.bias"] {
            assert!(names.iter().any(|n| n == want), "{want} missing");
        }
        let buffers: Vec<String> = net.named_buffers().into_iter().map(|p| p.name).collect();
        assert!(buffers.iter().any(|n| n == "layer4.2.bn3.running_var"));
        assert!(buffers.iter().any(|n| n == "layer3.0.downsample.1.running_mean"));
    }

    #[test]
    fn modulators_sit_in_the_residual_branch_only() {
        for (modulator, layer) in [("pixel", "bn"), ("sliding-window", "conv")] {
            let net = ResNet::new(&tiny(modulator), 0).unwrap();
            let names: Vec<String> = net.named_parameters().into_iter().map(|p| p.name).collect();
            let modulated: Vec<&String> = names.iter().filter(|n| n.contains(MODULATOR_MARKER)).collect();
            assert!(modulated.iter().all(|n| n.starts_with("layer") && n.contains(&format!(".{layer}"))));
            assert!(!modulated.iter().any(|n| n.contains("downsample")));
            // 8 blocks × 2 links, each with two modulator convolutions (weight + bias).
            assert_eq!(modulated.len(), 8 * 2 * 4, "{modulator}");
        }
        let pixel = ResNet::new(&tiny("pixel"), 0).unwrap();
        assert!(!pixel.named_parameters().iter().any(|p| p.name == "layer1.0.bn1.weight"));
    }

    #[test]
    fn forward_shapes_for_both_stems() {
        let net = ResNet::new(&tiny("none"), 1).unwrap();
        let x = Var::constant(tensor::Tensor::ones(&[2, 3, 8, 8]));
        assert_eq!(net.forward(&x, true).unwrap().shape(), [2, 10]);
        let imagenet = ResNetConfig { stem: "imagenet".into(), in_channels: 1, ..tiny("pixel") };
        let net = ResNet::new(&imagenet, 1).unwrap();
        let x = Var::constant(tensor::Tensor::ones(&[2, 1, 32, 32]));
        assert_eq!(net.forward(&x, false).unwrap().shape(), [2, 10]);
        assert!(net.forward(&Var::constant(tensor::Tensor::ones(&[2, 3, 32, 32])), false).is_err());
    }
}
