//! [`Llama::forward_with_trace`]: the forward pass with every gate value captured, named by
//! the layer that produced it (the data behind Transponder Figures 2-3 and CCL Figures 5-6).
//!
//! Layers record through [`nn::trace`], keyed by one of their parameters; this maps each key
//! back to the parameter's name and drops the last segment, so a record is named after its
//! gate: `model.layers.3.self_attn.q_proj.modulator_scalar` (Transponder scalar gate),
//! `model.layers.3.mlp.down_proj.modulator_channel`, `model.layers.0.mlp.modulator_scalar`
//! (path-level), `model.layers.0.q_proj.modulator` (CoMT, non-contextual), `...output_gate`
//! (dense gates), and `model.layers.1.mlp.gate_proj` with kind `gate_basis` / `gate_out`
//! (CCL). The normal [`Llama::forward`] records nothing and pays one flag read per layer.

use std::collections::HashMap;

use autograd::Var;
use nn::Module;
use tensor::{Tensor, Tokens};

use super::Llama;
use crate::Result;

/// One captured gate tensor.
#[derive(Clone, Debug)]
pub struct GateTrace {
    /// The gate's name (see the module doc).
    pub name: String,
    /// The decoder block it belongs to (`model.layers.{i}`).
    pub layer: Option<usize>,
    /// `gate` (modulators and dense gates), `gate_basis` or `gate_out` (CCL).
    pub kind: &'static str,
    /// `[B·T, m]` per token (rows in the forward's order), or `[m]` for a gate that does not
    /// read its input (non-contextual).
    pub value: Tensor,
}

impl GateTrace {
    /// The name without the `model.layers.{i}.` prefix: `self_attn.q_proj.modulator_scalar`,
    /// `mlp.gate_proj`, ...
    pub fn local_name(&self) -> &str {
        let Some(layer) = self.layer else { return &self.name };
        self.name.get(format!("model.layers.{layer}.").len()..).unwrap_or(&self.name)
    }
}

impl Llama {
    /// [`Llama::forward`] that also returns every gate value, in the order the layers ran.
    pub fn forward_with_trace(&self, ids: &Tokens, batch: usize, seq: usize) -> Result<(Var, Vec<GateTrace>)> {
        let (logits, records) = nn::trace::capture(|| self.forward(ids, batch, seq));
        let logits = logits?;
        let names: HashMap<u64, String> = self.named_parameters().into_iter().map(|p| (p.var.id(), p.name)).collect();
        let traces = records
            .into_iter()
            .filter_map(|r| {
                let parameter = names.get(&r.key)?;
                let name = parameter.rsplit_once('.').map_or(parameter.as_str(), |(owner, _)| owner).to_string();
                let layer = name.strip_prefix("model.layers.").and_then(|rest| rest.split('.').next()?.parse().ok());
                Some(GateTrace { name, layer, kind: r.kind, value: r.value })
            })
            .collect();
        Ok((logits, traces))
    }
}
