//! Causal multi-head self-attention with rotary positions (LLaMA; RoPE θ = 10000), whose
//! q, k, v, o projections are [`ModulatedProjection`]s (Transponder eq. 6).
//!
//! ```text
//! q, k, v = RoPE(x·W_qᵀ ⊙ G_q(x)), RoPE(x·W_kᵀ ⊙ G_k(x)), x·W_vᵀ ⊙ G_v(x)   [B, T, H, D]
//! o       = softmax(q·kᵀ/√D + causal mask)·v  (⊙ σ(x·W_gᵀ) for SDPA-Gate)      [B, T, C]
//! y       = o·W_oᵀ ⊙ G_o(o)  (⊙ G_path(x) for path-level modulation, eq. 7)
//! ```
//! PyTorch equivalent: Hugging Face `LlamaAttention` (no GQA, no bias) with
//! `F.scaled_dot_product_attention(..., is_causal=True)`. Projections and gates run on the
//! flattened `[B·T, C]` rows; attention runs in `[B, T, H, D]` layout, no transposes.
//!
//! [`Attention::forward_cached`] is the decoding form (Hugging Face's `past_key_values`):
//! each sequence keeps its rotated keys and values in a [`KvCache`], new tokens sit at
//! RoPE positions after the cached ones and attend to every cached position (the attention
//! kernels align the causal mask bottom-right, so `Tq < Tk` is the cache case).

use autograd::ops::ProductOutput;
use autograd::{Result, Var};
use tensor::{Error, Rng, Tensor};

use crate::init::WeightInit;
use crate::modulator::{Delta, DenseGate, Gate, ModulatedProjection};
use crate::module::{join, Module};

/// Shape of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// `C`: model width.
    pub d_model: usize,
    /// `H`: heads; the head width `D = C / H` must be even (RoPE rotates pairs).
    pub n_heads: usize,
    /// RoPE base θ (10000 in LLaMA).
    pub rope_theta: f32,
}

/// Causal self-attention with RoPE and gated projections.
pub struct Attention {
    /// Query projection `C → C` (RoPE applied after it).
    pub q_proj: ModulatedProjection,
    /// Key projection `C → C` (RoPE applied after it).
    pub k_proj: ModulatedProjection,
    /// Value projection `C → C`.
    pub v_proj: ModulatedProjection,
    /// Output projection `C → C`.
    pub o_proj: ModulatedProjection,
    /// SDPA-Gate's gate on the attention output before `o_proj`, reading the layer input.
    pub sdpa_gate: Option<DenseGate>,
    /// Path-level gates on the whole output, reading the layer input (eq. 7).
    pub path_gates: Vec<Gate>,
    /// How `o_proj` stores the layer's output on a GPU under bf16 products when no path gate
    /// follows it ([`ProductOutput`]): `Bf16` where the residual stream's fused add + RMSNorm
    /// alone reads it (a pre-ln LLaMA block), as autocast stores a product, and where a fused
    /// gated `o_proj` may be left for that norm to run ([`Attention::forward_deferred`]); `F32`
    /// (the default) for a consumer that reads f32.
    pub output: ProductOutput,
    /// Width, heads and RoPE base.
    pub config: AttentionConfig,
}

impl Attention {
    /// Ungated projections initialised with `init`; push gates afterwards. Errors when the
    /// heads do not split the width into even head dimensions.
    pub fn new(config: AttentionConfig, init: WeightInit, rng: &mut Rng) -> Result<Attention> {
        let AttentionConfig { d_model: d, n_heads: h, .. } = config;
        if h == 0 || d % h != 0 || (d / h) % 2 != 0 {
            return Err(Error::InvalidShape {
                op: "attention",
                shape: vec![d, h],
                reason: format!("{h} heads must split width {d} into even head dimensions"),
            });
        }
        let mut projection = || ModulatedProjection::new(d, d, init, rng);
        Ok(Attention {
            q_proj: projection(),
            k_proj: projection(),
            v_proj: projection(),
            o_proj: projection(),
            sdpa_gate: None,
            path_gates: Vec::new(),
            output: ProductOutput::F32,
            config,
        })
    }

    /// The four projections by their Hugging Face names, for attaching gates.
    pub fn projections_mut(&mut self) -> [(&'static str, &mut ModulatedProjection); 4] {
        [
            ("q_proj", &mut self.q_proj),
            ("k_proj", &mut self.k_proj),
            ("v_proj", &mut self.v_proj),
            ("o_proj", &mut self.o_proj),
        ]
    }

    /// `x: [B, T, C] → [B, T, C]`; token t attends to tokens ≤ t, at RoPE position t.
    /// The q, k and v projections run as one op where that is one product (a GPU under bf16
    /// products, plain or fused-gated projections alike: [`ModulatedProjection::forward_packed`]),
    /// read by attention straight from the packed rows ([`Var::rotary_causal_attention_packed`]);
    /// fused-gated ones and attention are one op there ([`Var::fused_gated_rotary_attention`]:
    /// the gate kernel writes q, k and v rotated).
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.forward_deferred(x)?.value()
    }

    /// [`Attention::forward`] as the residual stream holds it ([`Delta`]): where the layer's
    /// output goes to the stream's fused add and RMSNorm alone (`output` bf16, no path gate)
    /// and `o_proj` is a fused gated projection on a GPU under bf16 products, `o_proj` is left
    /// for that norm to run in its launch ([`ModulatedProjection::deferred`]).
    pub fn forward_deferred(&self, x: &Var) -> Result<Delta> {
        let theta = self.config.rope_theta;
        let heads = self.config.n_heads;
        self.forward_with(x, |rows, shape, scale| {
            let qkv_projections = [&self.q_proj, &self.k_proj, &self.v_proj];
            let [b, t, h, head_dim] = shape;
            if let Some((parts, phi)) = ModulatedProjection::fused_group(&qkv_projections, rows)? {
                let parts = [parts[0], parts[1], parts[2]];
                let tokens = rows.reshape(&[b, t, rows.shape()[1]])?;
                return tokens.fused_gated_rotary_attention(&parts, phi, heads, scale, theta);
            }
            // Stored in bf16, as autocast stores a product: RoPE reads either.
            if let Some(qkv) = ModulatedProjection::forward_packed(&qkv_projections, rows, ProductOutput::Bf16)? {
                let qkv = qkv.reshape(&[b, t, 3 * h * head_dim])?;
                return Var::rotary_causal_attention_packed(&qkv, heads, scale, theta);
            }
            let (q, k, v) = self.heads(rows, shape)?;
            Var::rotary_causal_attention(&q, &k, &v, scale, theta)
        })
    }

    /// `x: [B, T, C] → [B, T, C]` for `T` new tokens of each of `B` sequences, sequence `i`
    /// continuing the positions in `caches[i]` (which gains the new keys and values): token
    /// t of sequence i sits at RoPE position `caches[i].len() + t` and attends to every
    /// cached position and to new tokens ≤ t. With empty caches this is [`Attention::forward`].
    /// Meant for inference (inside `no_grad`): the cache holds plain tensors, no graph.
    pub fn forward_cached(&self, x: &Var, caches: &mut [KvCache]) -> Result<Var> {
        let batch = x.shape().first().copied().unwrap_or(0);
        if caches.len() != batch {
            return Err(Error::ShapeMismatch { op: "attention cache", lhs: x.shape(), rhs: vec![caches.len()] });
        }
        let theta = self.config.rope_theta;
        self.forward_with(x, |rows, shape, scale| {
            let (q, k, v) = self.heads(rows, shape)?;
            let mut outputs = Vec::with_capacity(batch);
            for (i, cache) in caches.iter_mut().enumerate() {
                let position = cache.len();
                let q = q.narrow(0, i, 1)?.rope(theta, position)?;
                let k = k.narrow(0, i, 1)?.rope(theta, position)?.value();
                let (keys, values) = cache.append(&k, &v.narrow(0, i, 1)?.value())?;
                outputs.push(Var::causal_attention(&q, &Var::constant(keys), &Var::constant(values), scale)?);
            }
            match outputs.as_slice() {
                [single] => Ok(single.clone()),
                _ => Var::cat(&outputs.iter().collect::<Vec<_>>(), 0),
            }
        })?
        .value()
    }

    /// The unrotated `[B, T, H, D]` heads of q, k and v, each from its own (gated) projection
    /// of the `[B·T, C]` rows.
    fn heads(&self, rows: &Var, shape: [usize; 4]) -> Result<(Var, Var, Var)> {
        let heads = |p: &ModulatedProjection| p.forward(rows)?.reshape(&shape);
        Ok((heads(&self.q_proj)?, heads(&self.k_proj)?, heads(&self.v_proj)?))
    }

    /// The layer around its attention core: `attend(rows, [B, T, H, D], scale)` computes the
    /// `[B, T, H, D]` attention output from the `[B·T, C]` input rows (projections, RoPE and
    /// attention), then come the SDPA gate, the output projection and the path gates; the
    /// output projection deferred as [`Attention::forward_deferred`] says.
    fn forward_with(&self, x: &Var, attend: impl FnOnce(&Var, [usize; 4], f32) -> Result<Var>) -> Result<Delta> {
        let &[b, t, d] = x.shape().as_slice() else {
            return Err(Error::InvalidShape { op: "attention", shape: x.shape(), reason: "expected [B, T, C]".into() });
        };
        let h = self.config.n_heads;
        let head_dim = d / h;
        let rows = x.reshape(&[b * t, d])?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut o = attend(&rows, [b, t, h, head_dim], scale)?.reshape(&[b * t, d])?;
        if let Some(gate) = &self.sdpa_gate {
            o = o.mul(&gate.forward(&rows)?)?;
        }
        // A path gate's product reads o_proj's output in f32.
        let output = if self.path_gates.is_empty() { self.output } else { ProductOutput::F32 };
        if let Some(gated) = self.o_proj.deferred(&o, output, &[b, t, d])? {
            return Ok(Delta::Gated(gated));
        }
        let mut y = self.o_proj.forward_as(&o, output)?;
        for gate in &self.path_gates {
            crate::trace::record_gate(gate, &rows)?;
            y = y.mul(&gate.forward(&rows)?)?;
        }
        Ok(Delta::Value(y.reshape(&[b, t, d])?))
    }
}

/// One sequence's rotated keys and values in one attention layer, `[1, L, H, D]` each, for
/// decoding without recomputing the prefix. Empty until the first [`Attention::forward_cached`].
#[derive(Default)]
pub struct KvCache {
    keys: Option<Tensor>,
    values: Option<Tensor>,
}

impl KvCache {
    /// Positions cached so far (`L`).
    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[1])
    }

    /// True before the first forward.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `keys, values: [1, T, H, D]` along the positions and returns the whole cache.
    fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let joined = |cached: &Option<Tensor>, new: &Tensor| match cached {
            Some(cached) => Tensor::cat(&[cached, new], 1),
            None => new.contiguous(),
        };
        let (keys, values) = (joined(&self.keys, keys)?, joined(&self.values, values)?);
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values))
    }
}

impl Module for Attention {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        let projections = [
            ("q_proj.", &self.q_proj),
            ("k_proj.", &self.k_proj),
            ("v_proj.", &self.v_proj),
            ("o_proj.", &self.o_proj),
        ];
        for (name, p) in projections {
            p.visit_parameters(&join(prefix, name), visit);
        }
        if let Some(gate) = &self.sdpa_gate {
            gate.visit_parameters(&join(prefix, "sdpa_gate."), visit);
        }
        for gate in &self.path_gates {
            gate.visit_parameters(prefix, visit);
        }
    }
}
