//! One context-conditioned linear layer (CCL `001`, eq. 1-4; SPEC §3):
//!
//! ```text
//! h   = LayerNorm(x·W_basis)                  [N, k]
//! g_b = σ(c·W_gbᵀ + b_gb),  g_o = σ(c·W_goᵀ + b_go)     [N, k], [N, d_out]
//! y   = ((h ⊙ g_b)·W_mix + bias) ⊙ g_o        [N, d_out]
//! ```
//! The paper's gate MLP `σ(MLP(c_t)) = [g_b | g_o]` is one linear layer `d_ctx → k + d_out`
//! here, stored as its two row blocks (`gate_basis`, `gate_out`) so no split is needed; its
//! hidden layer is the block's shared context manager (`c_t = SiLU(W_ctx·h_t)`), which makes
//! `h_t → c_t → g` the two-layer MLP of the paper's Figure 2. The token-specific operator is
//! `W_eff(t) = W_basis·diag(g_b)·W_mix·diag(g_o)` (eq. 5), never formed in the forward.
//!
//! Init: W_basis and W_mix as the model's other linear weights (`WeightInit`), LayerNorm
//! gain 1 / shift 0, bias 0, gate weights Kaiming-uniform with zero bias (gates start near ½).
//! Storage follows PyTorch: `basis.weight` is `[k, d_in]`, `mix.weight` is `[d_out, k]`.
//!
//! While [`crate::trace`] records, the forward stores `g_b` (`gate_basis`) and `g_o`
//! (`gate_out`) under the id of `bias`.

use autograd::{Result, Var};
use tensor::{Error, Rng};

use super::{CclAblation, CclConfig};
use crate::init;
use crate::init::WeightInit;
use crate::layers::{LayerNorm, Linear};
use crate::module::{join, Module};
use crate::trace;

/// `y = ((LayerNorm(x·W_basis) ⊙ g_b)·W_mix + bias) ⊙ g_o` with gates from a context vector.
pub struct ContextConditionedLinear {
    /// `W_basisᵀ: [k, d_in]`, no bias.
    pub basis: Linear,
    /// LayerNorm over the k basis features (affine).
    pub norm: LayerNorm,
    /// `W_mixᵀ: [d_out, k]`, no bias.
    pub mix: Linear,
    /// `bias: [d_out]`, added before the output gate.
    pub bias: Var,
    /// `c → g_b` logits, `[k, d_ctx]` with bias (absent for `static` and `no-basis-gate`).
    pub gate_basis: Option<Linear>,
    /// `c → g_o` logits, `[d_out, d_ctx]` with bias (absent for `static` and `no-out-gate`).
    pub gate_out: Option<Linear>,
}

/// A bias-carrying gate layer `d_ctx → width`: Kaiming-uniform weight, zero bias.
fn gate_layer(d_ctx: usize, width: usize, rng: &mut Rng) -> Linear {
    Linear::new(d_ctx, width, true, rng)
}

impl ContextConditionedLinear {
    /// A `d_in → d_out` CCL with `config.d_basis` basis features reading `config.d_ctx`-wide
    /// contexts; `init` draws W_basis and W_mix.
    pub fn new(d_in: usize, d_out: usize, config: CclConfig, init: WeightInit, rng: &mut Rng) -> Self {
        let k = config.d_basis;
        let basis = init.linear(d_in, k, rng);
        let mix = init.linear(k, d_out, rng);
        let ablation = config.ablation;
        let gate_basis = ablation.has_basis_gate().then(|| gate_layer(config.d_ctx, k, rng));
        let gate_out = ablation.has_out_gate().then(|| gate_layer(config.d_ctx, d_out, rng));
        ContextConditionedLinear {
            basis,
            norm: LayerNorm::new(k, true),
            mix,
            bias: init::zeros(&[d_out]),
            gate_basis,
            gate_out,
        }
    }

    /// Input width `d_in`.
    pub fn in_features(&self) -> usize {
        self.basis.weight.shape()[1]
    }

    /// Basis size `k`.
    pub fn d_basis(&self) -> usize {
        self.basis.weight.shape()[0]
    }

    /// Output width `d_out`.
    pub fn out_features(&self) -> usize {
        self.mix.weight.shape()[0]
    }

    /// The ablation this layer was built with (read off which gates exist).
    pub fn ablation(&self) -> CclAblation {
        match (&self.gate_basis, &self.gate_out) {
            (Some(_), Some(_)) => CclAblation::None,
            (Some(_), None) => CclAblation::NoOutGate,
            (None, Some(_)) => CclAblation::NoBasisGate,
            (None, None) => CclAblation::Static,
        }
    }

    /// The gates `(g_b [N, k], g_o [N, d_out])` for contexts `c: [N, d_ctx]`; `None` where
    /// the ablation fixes a gate at 1.
    pub fn gates(&self, context: Option<&Var>) -> Result<(Option<Var>, Option<Var>)> {
        let gate = |layer: &Option<Linear>| -> Result<Option<Var>> {
            match (layer, context) {
                (None, _) => Ok(None),
                (Some(l), Some(c)) => Ok(Some(l.forward(c)?.sigmoid()?)),
                (Some(l), None) => Err(Error::InvalidShape {
                    op: "ccl",
                    shape: l.weight.shape(),
                    reason: "this CCL has gates, so it needs a context vector (got none)".into(),
                }),
            }
        };
        Ok((gate(&self.gate_basis)?, gate(&self.gate_out)?))
    }

    /// `x: [N, d_in]` with contexts `c: [N, d_ctx]` (ignored by `static`) → `[N, d_out]`.
    pub fn forward(&self, x: &Var, context: Option<&Var>) -> Result<Var> {
        let (g_b, g_o) = self.gates(context)?;
        if trace::is_recording() {
            for (kind, gate) in [("gate_basis", &g_b), ("gate_out", &g_o)] {
                if let Some(g) = gate {
                    trace::record(self.bias.id(), kind, g.value());
                }
            }
        }
        let mut h = self.norm.forward(&self.basis.forward(x)?)?;
        if let Some(g) = &g_b {
            h = h.mul(g)?;
        }
        let y = self.mix.forward(&h)?.add(&self.bias)?;
        match &g_o {
            Some(g) => y.mul(g),
            None => Ok(y),
        }
    }
}

impl Module for ContextConditionedLinear {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        self.basis.visit_parameters(&join(prefix, "basis."), visit);
        self.norm.visit_parameters(&join(prefix, "norm."), visit);
        self.mix.visit_parameters(&join(prefix, "mix."), visit);
        visit(join(prefix, "bias"), &self.bias);
        if let Some(g) = &self.gate_basis {
            g.visit_parameters(&join(prefix, "gate_basis."), visit);
        }
        if let Some(g) = &self.gate_out {
            g.visit_parameters(&join(prefix, "gate_out."), visit);
        }
    }
}
