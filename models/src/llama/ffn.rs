//! A decoder block's feed-forward sublayer: LLaMA's SwiGLU (with whatever gates its variant
//! attaches) or, for the `ccl` variant, the CCL SwiGLU of SPEC §3.

use autograd::Var;
use nn::ccl::{CclFfn, RunningMean};
use nn::ffn::SwiGlu;
use nn::modulator::Delta;
use nn::Module;

/// The FFN of one block. Parameters sit under `mlp.` either way.
pub enum FeedForward {
    /// `down(SiLU(gate(x)) ⊙ up(x))` with (optionally gated) dense projections.
    SwiGlu(SwiGlu),
    /// The same with every projection a context-conditioned linear layer.
    Ccl(CclFfn),
}

impl FeedForward {
    /// `h: [B, T, C] → [B, T, C]`.
    pub fn forward(&self, h: &Var) -> autograd::Result<Var> {
        match self {
            FeedForward::SwiGlu(f) => f.forward(h),
            FeedForward::Ccl(f) => f.forward(h),
        }
    }

    /// [`FeedForward::forward`] as the residual stream holds it: a SwiGLU's `down_proj` may be
    /// left for the stream's next RMSNorm to run ([`SwiGlu::forward_deferred`]).
    pub fn forward_deferred(&self, h: &Var) -> autograd::Result<Delta> {
        match self {
            FeedForward::SwiGlu(f) => f.forward_deferred(h),
            FeedForward::Ccl(f) => f.forward(h).map(Delta::Value),
        }
    }

    /// [`FeedForward::forward`] for new positions of `B` sequences; a CCL FFN continues
    /// sequence `i`'s context running mean in `means[i]` (decoding), a SwiGLU reads no state.
    pub fn forward_cached(&self, h: &Var, means: &mut [RunningMean]) -> autograd::Result<Var> {
        match self {
            FeedForward::SwiGlu(f) => f.forward(h),
            FeedForward::Ccl(f) => f.forward_cached(h, means),
        }
    }

    /// The CCL FFN, if this is one.
    pub fn as_ccl(&self) -> Option<&CclFfn> {
        match self {
            FeedForward::Ccl(f) => Some(f),
            FeedForward::SwiGlu(_) => None,
        }
    }
}

impl Module for FeedForward {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        match self {
            FeedForward::SwiGlu(f) => f.visit_parameters(prefix, visit),
            FeedForward::Ccl(f) => f.visit_parameters(prefix, visit),
        }
    }
}
