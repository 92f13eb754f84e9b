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
//! PyTorch equivalent: `h.cumsum(1) / torch.arange(1, T + 1)[:, None]`. For decoding,
//! [`ContextManager::forward_cached`] continues each sequence's sum in a [`RunningMean`]
//! (the same additions in the same order, so the same bits as the whole sequence at once).

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
        RunningMean::default().extend(xb, channels, yb);
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

/// One sequence's running sum of `h` over the positions seen so far, so its causal mean can
/// continue over new positions (decoding one token at a time).
#[derive(Clone, Debug, Default)]
pub struct RunningMean {
    sum: Vec<f32>,
    count: usize,
}

impl RunningMean {
    /// Positions summed so far.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True before the first position.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Adds the rows of `x: [T, C]` (row-major) one position at a time, writing the mean
    /// over every position so far after each into the matching row of `means`.
    fn extend(&mut self, x: &[f32], channels: usize, means: &mut [f32]) {
        self.sum.resize(channels, 0.0);
        for (xt, mt) in x.chunks(channels).zip(means.chunks_mut(channels)) {
            self.count += 1;
            let inv = 1.0 / self.count as f32;
            for ((s, &v), out) in self.sum.iter_mut().zip(xt).zip(mt) {
                *s += v;
                *out = *s * inv;
            }
        }
    }
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
        let [batch, seq, channels] = dims(h)?;
        let mean = match self.mean_weight {
            Some(_) => Some(causal_mean(h)?.reshape(&[batch * seq, channels])?),
            None => None,
        };
        self.contexts(h, mean)
    }

    /// [`ContextManager::forward`] for `T` new positions of each of `B` sequences, sequence
    /// `i` continuing the running mean in `means[i]` (ignored in [`CclMode::Token`], which
    /// reads no earlier position). For inference: the mean is computed on the host, no graph.
    pub fn forward_cached(&self, h: &Var, means: &mut [RunningMean]) -> Result<Var> {
        let [batch, seq, channels] = dims(h)?;
        if self.mean_weight.is_none() {
            return self.contexts(h, None);
        }
        if means.len() != batch {
            return Err(Error::ShapeMismatch { op: "context manager cache", lhs: h.shape(), rhs: vec![means.len()] });
        }
        let device = h.value_ref().device();
        let x = h.value().to_host()?.contiguous()?;
        let mut m = vec![0.0f32; x.numel()];
        let block = (seq * channels).max(1);
        for ((state, xb), mb) in means.iter_mut().zip(x.as_slice()?.chunks(block)).zip(m.chunks_mut(block)) {
            state.extend(xb, channels.max(1), mb);
        }
        let mean = Tensor::from_vec(m, &[batch * seq, channels])?.to_device(device)?;
        self.contexts(h, Some(Var::constant(mean)))
    }

    /// `SiLU(h·W_ctxᵀ (+ mean·W_meanᵀ))` with the running means `[B·T, C]` already computed.
    fn contexts(&self, h: &Var, mean: Option<Var>) -> Result<Var> {
        let [batch, seq, channels] = dims(h)?;
        let rows = h.reshape(&[batch * seq, channels])?;
        let mut z = rows.matmul(&self.weight.transpose(0, 1)?)?;
        if let (Some(mean_weight), Some(mean)) = (&self.mean_weight, mean) {
            z = z.add(&mean.matmul(&mean_weight.transpose(0, 1)?)?)?;
        }
        z.silu()
    }
}

/// `[B, T, C]` of a context manager's input, or an error naming the shape.
fn dims(h: &Var) -> Result<[usize; 3]> {
    match h.shape().as_slice() {
        &[batch, seq, channels] => Ok([batch, seq, channels]),
        _ => Err(Error::InvalidShape { op: "context manager", shape: h.shape(), reason: "expected [B, T, C]".into() }),
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
