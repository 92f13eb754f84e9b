//! The full-rank sigmoid gate `σ(x·W_gᵀ)` of the SDPA-Gate and ALL-Gate baselines (SPEC §5).
//!
//! `W_g: [d_out, d_in]` (PyTorch layout), so a gate on a `d_in → d_out` projection costs as
//! many parameters as the projection itself: that is what makes ALL-Gate double a block.
//! PyTorch equivalent: `torch.sigmoid(nn.Linear(d_in, d_out, bias=False)(x))`.

use autograd::{Result, Var};
use tensor::Rng;

use crate::init::WeightInit;
use crate::layers::Linear;
use crate::module::Module;

/// `σ(x·W_gᵀ)`, one gate per output channel per token, in (0, 1). `W_g` is initialised
/// like the projection it gates.
pub struct DenseGate {
    /// `W_g: [d_out, d_in]`, no bias.
    pub linear: Linear,
}

impl DenseGate {
    /// A gate reading `d_in` features and producing `d_out`.
    pub fn new(d_in: usize, d_out: usize, init: WeightInit, rng: &mut Rng) -> DenseGate {
        DenseGate { linear: init.linear(d_in, d_out, rng) }
    }

    /// The gate `[..., d_out]` for `x: [..., d_in]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.linear.forward(x)?.sigmoid()
    }
}

impl Module for DenseGate {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.linear.visit_parameters(prefix, visit);
    }
}
