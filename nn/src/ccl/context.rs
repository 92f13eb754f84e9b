//! The Global Context Manager of a CCL block (SPEC §3) and the causal running mean it can
//! mix in.
//!
//! ```text
//! token:        c_t = SiLU(W_ctx·h_t)                              [B, T, d_ctx]
//! causal-mean:  c_t = SiLU(W_ctx·h_t + W_mean·m_t),  m_t = (1/(t+1))·Σ_{s≤t} h_s
//! ```
//! `h` is the FFN's input (normalised under pre-ln). Neither form reads a position after t,
//! so the gates, and the model, stay causal. No biases (SPEC writes `SiLU(W_ctx·h_t)`);
//! W_ctx and W_mean are Kaiming-uniform (PyTorch `nn.Linear`'s default).
//!
//! [`causal_mean`] is one op with its own backward (a reverse cumulative sum) rather than a
//! `[T, T]` averaging matmul: O(B·T·C) instead of O(B·T²·C), and it saves nothing.
//! PyTorch equivalent: `h.cumsum(1) / torch.arange(1, T + 1)[:, None]`.

use autograd::{Result, Var};
use tensor::{Error, Rng, Tensor};

use super::CclMode;
use crate::init;
use crate::module::{join, Module};

/// `m[b, t, c] = (1/(t+1))·Σ_{s≤t} h[b, s, c]` for `h: [B, T, C]`.
pub fn causal_mean(h: &Var) -> Result<Var> {
    let shape = h.shape();
    let &[_, seq, channels] = shape.as_slice() else {
        return Err(Error::InvalidShape { op: "causal_mean", shape, reason: "expected [B, T, C]".into() });
    };
    // `max(1)` keeps `chunks` valid for empty tensors (which then have no chunks).
    let (block, channels) = ((seq * channels).max(1), channels.max(1));
    let x = h.value_ref().contiguous()?;
    let x = x.as_slice()?;
    let mut y = vec![0.0f32; x.len()];
    for (xb, yb) in x.chunks(block).zip(y.chunks_mut(block)) {
        let mut sum = vec![0.0f32; channels];
        for (t, (xt, yt)) in xb.chunks(channels).zip(yb.chunks_mut(channels)).enumerate() {
            let inv = 1.0 / (t + 1) as f32;
            for ((s, &v), out) in sum.iter_mut().zip(xt).zip(yt) {
                *s += v;
                *out = *s * inv;
            }
        }
    }
    let y = Tensor::from_vec(y, &shape)?;
    // d m_t / d h_s = 1/(t+1) for s ≤ t, so dh_s = Σ_{t≥s} dm_t/(t+1): a reverse cumulative sum.
    Ok(Var::from_op(y, vec![h.clone()], move |dy| {
        let dy = dy.contiguous()?;
        let dy = dy.as_slice()?;
        let mut dh = vec![0.0f32; dy.len()];
        for (dyb, dhb) in dy.chunks(block).zip(dh.chunks_mut(block)) {
            let mut sum = vec![0.0f32; channels];
            for (t, (dyt, dht)) in dyb.chunks(channels).zip(dhb.chunks_mut(channels)).enumerate().rev() {
                let inv = 1.0 / (t + 1) as f32;
                for ((s, &g), out) in sum.iter_mut().zip(dyt).zip(dht) {
                    *s += g * inv;
                    *out = *s;
                }
            }
        }
        Ok(vec![Tensor::from_vec(dh, &shape)?])
    }))
}

/// `c_t` for every position of a block: one per block, shared by its CCL layers.
pub struct ContextManager {
    /// `W_ctx: [d_ctx, C]`.
    pub weight: Var,
    /// `W_mean: [d_ctx, C]` (only in [`CclMode::CausalMean`]).
    pub mean_weight: Option<Var>,
}

impl ContextManager {
    /// A manager reading width-`d_model` inputs into `d_ctx`-wide contexts.
    pub fn new(d_model: usize, d_ctx: usize, mode: CclMode, rng: &mut Rng) -> ContextManager {
        let mut draw = || init::kaiming_uniform(&[d_ctx, d_model], d_model, rng);
        let weight = draw();
        let mean_weight = (mode == CclMode::CausalMean).then(draw);
        ContextManager { weight, mean_weight }
    }

    /// The mode it was built with.
    pub fn mode(&self) -> CclMode {
        if self.mean_weight.is_some() {
            CclMode::CausalMean
        } else {
            CclMode::Token
        }
    }

    /// `h: [B, T, C]` → contexts `[B·T, d_ctx]`, one row per position (row-major).
    pub fn forward(&self, h: &Var) -> Result<Var> {
        let shape = h.shape();
        let &[batch, seq, channels] = shape.as_slice() else {
            return Err(Error::InvalidShape { op: "context manager", shape, reason: "expected [B, T, C]".into() });
        };
        let rows = h.reshape(&[batch * seq, channels])?;
        let mut z = rows.matmul(&self.weight.transpose(0, 1)?)?;
        if let Some(mean_weight) = &self.mean_weight {
            let mean = causal_mean(h)?.reshape(&[batch * seq, channels])?;
            z = z.add(&mean.matmul(&mean_weight.transpose(0, 1)?)?)?;
        }
        z.silu()
    }
}

impl Module for ContextManager {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
        if let Some(w) = &self.mean_weight {
            visit(join(prefix, "mean_weight"), w);
        }
    }
}
