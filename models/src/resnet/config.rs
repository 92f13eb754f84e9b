//! [`ResNetConfig`]: the ResNet presets of SPEC §6 plus the CoMT modulator knobs (SPEC §2),
//! serialisable as the JSON saved beside checkpoints. Missing JSON fields take their defaults.

use nn::modulator::Phi;
use nn::vision::GateRange;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// `(name, block, blocks per stage)` of each preset (He et al. 2016, Table 1).
pub const PRESETS: [(&str, &str, [usize; 4]); 5] = [
    ("resnet18", "basic", [2, 2, 2, 2]),
    ("resnet34", "basic", [3, 4, 6, 3]),
    ("resnet50", "bottleneck", [3, 4, 6, 3]),
    ("resnet101", "bottleneck", [3, 4, 23, 3]),
    ("resnet152", "bottleneck", [3, 8, 36, 3]),
];

/// Block kinds: `basic` (two 3×3 convolutions) and `bottleneck` (1×1, 3×3, 1×1 with
/// expansion 4).
pub const BLOCKS: [&str; 2] = ["basic", "bottleneck"];
/// Stems: `cifar` (3×3 conv, no max-pool) and `imagenet` (7×7/2 conv + 3×3/2 max-pool).
pub const STEMS: [&str; 2] = ["cifar", "imagenet"];
/// Modulators (SPEC §2): `none`, `pixel` (every BatchNorm of a residual branch),
/// `sliding-window` (every convolution of a residual branch).
pub const MODULATORS: [&str; 3] = ["none", "pixel", "sliding-window"];

/// A ResNet and its modulator. `Default` is `resnet18` with the CIFAR stem, 3 input
/// channels, 10 classes, width 64 and no modulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResNetConfig {
    /// The preset it came from (informational).
    pub preset: String,
    /// A name from [`BLOCKS`].
    pub block: String,
    /// Blocks per stage; stage `i` has width `base_width · 2^i` (times 4 at a bottleneck's
    /// output), and every stage after the first starts with stride 2.
    pub layers: Vec<usize>,
    /// Width of the stem and the first stage (64 in the papers; narrower nets for fast runs).
    pub base_width: usize,
    /// Image channels (1 for digits, 3 for CIFAR).
    pub in_channels: usize,
    /// Classes of the final linear layer.
    pub num_classes: usize,
    /// A name from [`STEMS`].
    pub stem: String,
    /// A name from [`MODULATORS`].
    pub modulator: String,
    /// Pixel modulator hidden width h (2; the paper's grid is 2, 4, 8).
    pub pixel_hidden: usize,
    /// Sliding-window hidden width `h = max(1, C_in / sliding_hidden_divisor)` (64; the
    /// paper's ratios 1/16, 1/32, 1/64 are 16, 32, 64).
    pub sliding_hidden_divisor: usize,
    /// Modulator nonlinearity φ: `sigmoid` (SPEC §1's default), `silu` or `relu`.
    pub phi: String,
    /// Modulator output range: `double` (`σ̃ = 2σ`, default) or `unit` (plain σ).
    pub gate_range: String,
    /// BatchNorm running-statistics momentum (0.1, PyTorch's).
    pub bn_momentum: f32,
    /// BatchNorm epsilon (1e-5, PyTorch's).
    pub bn_eps: f32,
}

impl Default for ResNetConfig {
    fn default() -> Self {
        let (preset, block, layers) = PRESETS[0];
        ResNetConfig {
            preset: preset.into(),
            block: block.into(),
            layers: layers.to_vec(),
            base_width: 64,
            in_channels: 3,
            num_classes: 10,
            stem: "cifar".into(),
            modulator: "none".into(),
            pixel_hidden: 2,
            sliding_hidden_divisor: 64,
            phi: "sigmoid".into(),
            gate_range: "double".into(),
            bn_momentum: 0.1,
            bn_eps: 1e-5,
        }
    }
}

/// Which modulator a validated config asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Modulation {
    /// No modulators: the plain ResNet.
    None,
    /// Pixel modulators with this hidden width.
    Pixel {
        /// The modulators' hidden width.
        hidden: usize,
    },
    /// Sliding-window modulators with `h = max(1, C_in / divisor)`.
    SlidingWindow {
        /// Divides a convolution's input channels into the modulator's hidden width.
        divisor: usize,
    },
}

/// A validated config's names, parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Parsed {
    /// True for bottleneck blocks.
    pub bottleneck: bool,
    /// True for the ImageNet stem.
    pub imagenet_stem: bool,
    /// Which modulators the blocks get.
    pub modulation: Modulation,
    /// The modulators' nonlinearity.
    pub phi: Phi,
    /// The modulators' output range.
    pub gate_range: GateRange,
}

fn one_of<'a>(field: &str, value: &str, valid: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let valid: Vec<&str> = valid.into_iter().collect();
    if valid.contains(&value) {
        Ok(())
    } else {
        Err(Error::Config(format!("unknown {field} `{value}`; valid: {}", valid.join(", "))))
    }
}

impl ResNetConfig {
    /// The preset `name` (`resnet18` … `resnet152`) with the defaults above; the error lists
    /// every preset.
    pub fn preset(name: &str) -> Result<ResNetConfig> {
        one_of("preset", name, PRESETS.iter().map(|p| p.0))?;
        let &(preset, block, layers) = PRESETS.iter().find(|p| p.0 == name).expect("checked above");
        Ok(ResNetConfig { preset: preset.into(), block: block.into(), layers: layers.to_vec(), ..Self::default() })
    }

    /// Checks every name and size; errors list the valid names.
    pub fn validate(&self) -> Result<()> {
        self.parse().map(|_| ())
    }

    /// Channels out of the last stage (the classifier's input): `base_width · 2^(stages−1)`,
    /// times 4 for bottleneck blocks.
    pub fn feature_width(&self) -> usize {
        let expansion = if self.block == "bottleneck" { 4 } else { 1 };
        (self.base_width << self.layers.len().saturating_sub(1)) * expansion
    }

    /// The parsed names.
    pub fn parse(&self) -> Result<Parsed> {
        one_of("block", &self.block, BLOCKS)?;
        one_of("stem", &self.stem, STEMS)?;
        one_of("modulator", &self.modulator, MODULATORS)?;
        one_of("phi", &self.phi, Phi::NAMES)?;
        one_of("gate_range", &self.gate_range, GateRange::NAMES)?;
        let bad = |message: String| Err(Error::Config(message));
        let positive = [
            ("base_width", self.base_width),
            ("in_channels", self.in_channels),
            ("num_classes", self.num_classes),
            ("pixel_hidden", self.pixel_hidden),
            ("sliding_hidden_divisor", self.sliding_hidden_divisor),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} must be positive"));
        }
        if self.layers.is_empty() || self.layers.contains(&0) {
            return bad(format!("layers must list at least one stage of at least one block, got {:?}", self.layers));
        }
        let bn_ok = (0.0..=1.0).contains(&self.bn_momentum) && self.bn_eps.is_finite() && self.bn_eps > 0.0;
        if !bn_ok {
            return bad(format!(
                "bn_momentum must be in [0, 1] and bn_eps positive, got {} and {}",
                self.bn_momentum, self.bn_eps
            ));
        }
        let modulation = match self.modulator.as_str() {
            "pixel" => Modulation::Pixel { hidden: self.pixel_hidden },
            "sliding-window" => Modulation::SlidingWindow { divisor: self.sliding_hidden_divisor },
            _ => Modulation::None,
        };
        Ok(Parsed {
            bottleneck: self.block == "bottleneck",
            imagenet_stem: self.stem == "imagenet",
            modulation,
            phi: Phi::from_name(&self.phi).expect("checked above"),
            gate_range: GateRange::from_name(&self.gate_range).expect("checked above"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_errors() {
        let r50 = ResNetConfig::preset("resnet50").unwrap();
        assert_eq!((r50.block.as_str(), r50.layers.as_slice()), ("bottleneck", &[3, 4, 6, 3][..]));
        assert_eq!(r50.feature_width(), 2048);
        assert_eq!(ResNetConfig::default().feature_width(), 512);
        let msg = ResNetConfig::preset("resnet19").unwrap_err().to_string();
        assert!(msg.contains("resnet19") && msg.contains("resnet18") && msg.contains("resnet152"), "{msg}");
        let bad = ResNetConfig { modulator: "channel".into(), ..ResNetConfig::default() };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("channel") && msg.contains("sliding-window"), "{msg}");
        let bad = ResNetConfig { gate_range: "wide".into(), ..ResNetConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("unit"));
        assert!(ResNetConfig { layers: vec![2, 0], ..ResNetConfig::default() }.validate().is_err());
        assert!(ResNetConfig { base_width: 0, ..ResNetConfig::default() }.validate().is_err());
    }

    #[test]
    fn json_round_trip_with_defaults() {
        let c: ResNetConfig = serde_json::from_str(r#"{"preset": "resnet34", "modulator": "pixel"}"#).unwrap();
        assert_eq!(c.base_width, 64);
        let back: ResNetConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
