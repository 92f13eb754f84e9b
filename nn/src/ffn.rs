//! The SwiGLU feed-forward network of LLaMA with gated projections (Transponder eq. 6):
//!
//! ```text
//! y = (SiLU(x·W_gateᵀ ⊙ G_gate(x)) ⊙ (x·W_upᵀ ⊙ G_up(x)))·W_downᵀ ⊙ G_down(·)  (⊙ G_path(x), eq. 7)
//! ```
//! PyTorch equivalent: Hugging Face `LlamaMLP` (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`).
//! `SiLU(·) ⊙ (·)` is one fused op ([`Var::swiglu`]), which keeps only the two projections for
//! its backward. On a GPU under bf16 products the gate and up projections run as one op
//! ([`ModulatedProjection::forward_packed`]: one product of their packed weights when they
//! carry no gates, one fused gated group when both take the fused gate) and the SwiGLU reads
//! the two halves of its rows ([`Var::swiglu_halves`]).
//! Rows are flattened to `[N, C]` for the projections and restored at the end.

use autograd::ops::ProductOutput;
use autograd::{Result, Var};
use tensor::Rng;

use crate::init::WeightInit;
use crate::modulator::{Delta, Gate, ModulatedProjection};
use crate::module::{join, Module};

/// SwiGLU FFN: `C → hidden → C`.
pub struct SwiGlu {
    /// `C → hidden`, through SiLU.
    pub gate_proj: ModulatedProjection,
    /// `C → hidden`, the linear branch.
    pub up_proj: ModulatedProjection,
    /// `hidden → C`.
    pub down_proj: ModulatedProjection,
    /// Path-level gates on the whole output, reading the FFN input (eq. 7).
    pub path_gates: Vec<Gate>,
    /// How `down_proj` stores the output when no path gate follows it, as
    /// [`crate::attention::Attention::output`] for `o_proj`.
    pub output: ProductOutput,
}

impl SwiGlu {
    /// Ungated projections initialised with `init`; push gates afterwards.
    pub fn new(d_model: usize, hidden: usize, init: WeightInit, rng: &mut Rng) -> SwiGlu {
        SwiGlu {
            gate_proj: ModulatedProjection::new(d_model, hidden, init, rng),
            up_proj: ModulatedProjection::new(d_model, hidden, init, rng),
            down_proj: ModulatedProjection::new(hidden, d_model, init, rng),
            path_gates: Vec::new(),
            output: ProductOutput::F32,
        }
    }

    /// The three projections by their Hugging Face names, for attaching gates.
    pub fn projections_mut(&mut self) -> [(&'static str, &mut ModulatedProjection); 3] {
        [("gate_proj", &mut self.gate_proj), ("up_proj", &mut self.up_proj), ("down_proj", &mut self.down_proj)]
    }

    /// `x: [..., C] → [..., C]`.
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.forward_deferred(x)?.value()
    }

    /// [`SwiGlu::forward`] as the residual stream holds it ([`Delta`]): `down_proj` left for
    /// the stream's next RMSNorm to run in its launch where it may
    /// ([`crate::attention::Attention::forward_deferred`] says when).
    pub fn forward_deferred(&self, x: &Var) -> Result<Delta> {
        let shape = x.shape();
        let d = self.gate_proj.in_features();
        let rows = x.reshape(&[x.value_ref().numel() / d.max(1), d])?;
        // The gate and up projections as one op where that is one product, SwiGLU over its
        // two halves; fused-gated ones and SwiGLU as one op there (the gate kernel writes
        // SwiGLU's output: [`Var::fused_gated_swiglu`]).
        // SwiGLU reads a plain product's halves in bf16 under bf16 products, as autocast stores them.
        let pair = [&self.gate_proj, &self.up_proj];
        let hidden = match ModulatedProjection::fused_group(&pair, &rows)? {
            Some((parts, phi)) => rows.fused_gated_swiglu(&[parts[0], parts[1]], phi)?,
            None => match ModulatedProjection::forward_packed(&pair, &rows, ProductOutput::Bf16)? {
                Some(gate_up) => gate_up.swiglu_halves()?,
                None => self.gate_proj.forward(&rows)?.swiglu(&self.up_proj.forward(&rows)?)?,
            },
        };
        let output = if self.path_gates.is_empty() { self.output } else { ProductOutput::F32 };
        if let Some(gated) = self.down_proj.deferred(&hidden, output, &shape)? {
            return Ok(Delta::Gated(gated));
        }
        let mut y = self.down_proj.forward_as(&hidden, output)?;
        for gate in &self.path_gates {
            crate::trace::record_gate(gate, &rows)?;
            y = y.mul(&gate.forward(&rows)?)?;
        }
        Ok(Delta::Value(y.reshape(&shape)?))
    }
}

impl Module for SwiGlu {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        let projections =
            [("gate_proj.", &self.gate_proj), ("up_proj.", &self.up_proj), ("down_proj.", &self.down_proj)];
        for (name, p) in projections {
            p.visit_parameters(&join(prefix, name), visit);
        }
        for gate in &self.path_gates {
            gate.visit_parameters(prefix, visit);
        }
    }
}
