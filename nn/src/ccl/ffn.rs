//! LLaMA's SwiGLU FFN with every linear layer a CCL (SPEC §3: "CCL replaces the FFN's linear
//! layers"), the three sharing one Global Context Manager:
//!
//! ```text
//! c = ContextManager(h)                                   [B·T, d_ctx]   (none for static)
//! y = down(SiLU(gate(h, c)) ⊙ up(h, c), c)                [B, T, C]
//! ```
//! Parameter names under the FFN: `context.weight` (`context.mean_weight`),
//! `gate_proj.*`, `up_proj.*`, `down_proj.*` (each as [`ContextConditionedLinear`]).

use autograd::{Result, Var};
use tensor::{Error, Rng};

use super::{CclConfig, ContextConditionedLinear, ContextManager, RunningMean};
use crate::init::WeightInit;
use crate::module::{join, Module};

/// SwiGLU `C → hidden → C` built from three CCLs and one context manager.
pub struct CclFfn {
    /// The block's Global Context Manager (absent for the `static` ablation).
    pub context: Option<ContextManager>,
    /// `C → hidden`, through SiLU.
    pub gate_proj: ContextConditionedLinear,
    /// `C → hidden`, the linear branch.
    pub up_proj: ContextConditionedLinear,
    /// `hidden → C`.
    pub down_proj: ContextConditionedLinear,
}

impl CclFfn {
    /// A CCL SwiGLU of width `d_model` and hidden width `hidden`; `init` draws the basis and
    /// mixing matrices.
    pub fn new(d_model: usize, hidden: usize, config: CclConfig, init: WeightInit, rng: &mut Rng) -> CclFfn {
        let context =
            config.ablation.has_context().then(|| ContextManager::new(d_model, config.d_ctx, config.mode, rng));
        CclFfn {
            context,
            gate_proj: ContextConditionedLinear::new(d_model, hidden, config, init, rng),
            up_proj: ContextConditionedLinear::new(d_model, hidden, config, init, rng),
            down_proj: ContextConditionedLinear::new(hidden, d_model, config, init, rng),
        }
    }

    /// The three layers by their Hugging Face names.
    pub fn layers(&self) -> [(&'static str, &ContextConditionedLinear); 3] {
        [("gate_proj", &self.gate_proj), ("up_proj", &self.up_proj), ("down_proj", &self.down_proj)]
    }

    /// `h: [B, T, C] → [B, T, C]`; position t reads only positions ≤ t.
    pub fn forward(&self, h: &Var) -> Result<Var> {
        let context = self.context.as_ref().map(|m| m.forward(h)).transpose()?;
        self.forward_with_context(h, context)
    }

    /// [`CclFfn::forward`] for `T` new positions of each of `B` sequences, the context
    /// manager continuing sequence `i`'s running mean in `means[i]` (decoding).
    pub fn forward_cached(&self, h: &Var, means: &mut [RunningMean]) -> Result<Var> {
        let context = self.context.as_ref().map(|m| m.forward_cached(h, means)).transpose()?;
        self.forward_with_context(h, context)
    }

    fn forward_with_context(&self, h: &Var, context: Option<Var>) -> Result<Var> {
        let shape = h.shape();
        let &[batch, seq, channels] = shape.as_slice() else {
            return Err(Error::InvalidShape { op: "ccl ffn", shape, reason: "expected [B, T, C]".into() });
        };
        let rows = h.reshape(&[batch * seq, channels])?;
        let c = context.as_ref();
        let hidden = self.gate_proj.forward(&rows, c)?.swiglu(&self.up_proj.forward(&rows, c)?)?;
        self.down_proj.forward(&hidden, c)?.reshape(&shape)
    }
}

impl Module for CclFfn {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        if let Some(m) = &self.context {
            m.visit_parameters(&join(prefix, "context."), visit);
        }
        for (name, layer) in self.layers() {
            layer.visit_parameters(&join(prefix, &format!("{name}.")), visit);
        }
    }
}
