//! Vision layers for the ResNet path (SPEC §2, §6): 2-D convolution, batch normalisation,
//! and CoMT's two convolutional modulators (`002`, §3.3).
//!
//! - [`Conv2d`]: `y = conv(x, w) (+ b)`, PyTorch `nn.Conv2d` (groups 1, dilation 1).
//! - [`BatchNorm2d`]: PyTorch `nn.BatchNorm2d`, train/eval mode, with its running statistics
//!   exposed as buffers ([`Buffers`]) so checkpoints save them.
//! - [`PixelBatchNorm2d`]: CoMT's pixel modulator replacing the BatchNorm affine,
//!   `y = x̂ ⊙ m(x̂) + β`, one scale per pixel ([`PixelModulator`]).
//! - [`SlidingWindowConv2d`]: a convolution whose output is scaled per output position by
//!   CoMT's sliding-window modulator, `conv(x) ⊙ m(x)` ([`SlidingWindowModulator`]).
//!
//! Both modulators end in `σ̃ = 2σ` (in (0, 2), 1 at 0, as SPEC §1's calibrated sigmoid but
//! without α) or, with [`GateRange::Unit`], plain `σ` (SPEC §2's `--gate-range unit`).

mod batch_norm;
mod conv;
mod pixel;
mod sliding_window;

pub use batch_norm::BatchNorm2d;
pub use conv::Conv2d;
pub use pixel::{PixelBatchNorm2d, PixelModulator};
pub use sliding_window::{sliding_window_hidden, SlidingWindowConv2d, SlidingWindowModulator};

use autograd::{Result, Var};

use crate::module::{Module, NamedParameter};

/// Non-trainable state a layer carries besides its parameters (BatchNorm running
/// statistics: PyTorch's buffers). Buffers are [`Var`] constants: no gradient, never
/// handed to an optimizer, but saved and loaded by name like parameters (see [`StateDict`]).
pub trait Buffers {
    /// Calls `visit(name, buffer)` for every buffer, names prefixed with `prefix`.
    fn visit_buffers(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var));

    /// Every buffer with its full name, in a stable order.
    fn named_buffers(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        self.visit_buffers("", &mut |name, var| out.push(NamedParameter { name, var: var.clone() }));
        out
    }
}

/// A model's parameters and buffers together, PyTorch's `state_dict()`: pass
/// `&StateDict(&model)` where a [`Module`] is saved or loaded (checkpoints) so the running
/// statistics travel with the weights. Not for optimizers or parameter counts, which must
/// see the parameters alone.
pub struct StateDict<'a, M: ?Sized>(pub &'a M);

impl<M: Module + Buffers + ?Sized> Module for StateDict<'_, M> {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.0.visit_parameters(prefix, visit);
        self.0.visit_buffers(prefix, visit);
    }
}

/// The squashing at the end of a CoMT convolutional modulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GateRange {
    /// `σ̃(z) = 2σ(z)`, in (0, 2) and 1 at `z = 0`: the modulator can amplify as well as damp.
    #[default]
    Double,
    /// Plain `σ(z)` in (0, 1) (`--gate-range unit`).
    Unit,
}

impl GateRange {
    /// Every name [`GateRange::from_name`] accepts, in the order error messages list them.
    pub const NAMES: [&'static str; 2] = ["double", "unit"];

    /// Parses a config/CLI name (`double`, `unit`).
    pub fn from_name(name: &str) -> Option<GateRange> {
        match name {
            "double" => Some(GateRange::Double),
            "unit" => Some(GateRange::Unit),
            _ => None,
        }
    }

    /// The config/CLI name.
    pub fn name(self) -> &'static str {
        match self {
            GateRange::Double => "double",
            GateRange::Unit => "unit",
        }
    }

    /// `2σ(z)` or `σ(z)` elementwise.
    pub fn apply(self, z: &Var) -> Result<Var> {
        match self {
            GateRange::Double => z.sigmoid()?.mul_scalar(2.0),
            GateRange::Unit => z.sigmoid(),
        }
    }
}
