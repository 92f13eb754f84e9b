//! Neural-network ops over the last axis or a fixed layout: softmax, cross-entropy,
//! RMSNorm, LayerNorm, rotary embedding, embedding lookup and causal attention.
//!
//! Each returns what its backward needs (row statistics, log-sum-exp) beside the output,
//! so the autograd crate saves exactly that and nothing more.

use kernels::cpu::{attention, cross_entropy, embedding, norm, rope, softmax};

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::rms_norm`]: `y` and the per-row `1/rms` saved for backward.
pub struct RmsNormOutput {
    pub y: Tensor,
    pub rstd: Vec<f32>,
}

/// Output of [`Tensor::layer_norm`]: `y`, per-row mean and `1/std` saved for backward.
pub struct LayerNormOutput {
    pub y: Tensor,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

/// Output of [`Tensor::cross_entropy`]: mean loss over counted rows, with the per-row
/// log-sum-exp and the count saved for backward.
pub struct CrossEntropy {
    pub loss: f32,
    pub lse: Vec<f32>,
    pub count: usize,
}

impl Tensor {
    /// Width of the last axis and a contiguous copy (the layout row kernels need).
    fn rows(&self, op: &'static str) -> Result<(usize, Tensor)> {
        self.require_cpu(op)?;
        let cols = *self.shape.last().ok_or_else(|| Error::InvalidShape {
            op,
            shape: vec![],
            reason: "needs at least one dimension".into(),
        })?;
        Ok((cols, self.contiguous()?))
    }

    /// Softmax over the last axis.
    pub fn softmax(&self) -> Result<Tensor> {
        let (cols, x) = self.rows("softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax(&self) -> Result<Tensor> {
        let (cols, x) = self.rows("log_softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::log_softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// Mean cross-entropy of logits `[N, V]` against class ids `targets[N]`; rows whose
    /// target equals `ignore_index` are skipped (PyTorch `F.cross_entropy`).
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<CrossEntropy> {
        let (cols, x) = self.rows("cross_entropy")?;
        let rows = x.numel() / cols.max(1);
        if self.rank() != 2 || targets.len() != rows {
            return Err(Error::ShapeMismatch {
                op: "cross_entropy",
                lhs: self.shape.clone(),
                rhs: vec![targets.len()],
            });
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= cols && Some(t) != ignore_index) {
            return Err(Error::IndexOutOfRange { op: "cross_entropy", index: bad as usize, size: cols });
        }
        let mut losses = vec![0.0; rows];
        let mut lse = vec![0.0; rows];
        let count =
            cross_entropy::cross_entropy_forward(x.as_slice()?, cols, targets, ignore_index, &mut losses, &mut lse);
        let total: f64 = losses.iter().map(|&l| l as f64).sum();
        let loss = if count == 0 { 0.0 } else { (total / count as f64) as f32 };
        Ok(CrossEntropy { loss, lse, count })
    }

    fn check_weight(&self, op: &'static str, weight: Option<&Tensor>, cols: usize) -> Result<()> {
        match weight {
            Some(w) if w.shape != [cols] => {
                Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: w.shape.clone() })
            }
            _ => Ok(()),
        }
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) · weight` (LLaMA's norm).
    pub fn rms_norm(&self, weight: &Tensor, eps: f32) -> Result<RmsNormOutput> {
        let (cols, x) = self.rows("rms_norm")?;
        self.check_weight("rms_norm", Some(weight), cols)?;
        let mut y = crate::pool::buffer(x.numel());
        let mut rstd = vec![0.0; x.numel() / cols.max(1)];
        norm::rms_norm_forward(x.as_slice()?, weight.contiguous()?.as_slice()?, cols, eps, &mut y, &mut rstd);
        Ok(RmsNormOutput { y: Tensor::from_vec(y, &self.shape)?, rstd })
    }

    /// LayerNorm over the last axis, with optional affine weight and bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<LayerNormOutput> {
        let (cols, x) = self.rows("layer_norm")?;
        self.check_weight("layer_norm", weight, cols)?;
        self.check_weight("layer_norm", bias, cols)?;
        let rows = x.numel() / cols.max(1);
        let (mut y, mut mean, mut rstd) = (crate::pool::buffer(x.numel()), vec![0.0; rows], vec![0.0; rows]);
        let weight = weight.map(|w| w.contiguous()).transpose()?;
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        norm::layer_norm_forward(
            x.as_slice()?,
            weight.as_ref().map(|w| w.as_slice()).transpose()?,
            bias.as_ref().map(|b| b.as_slice()).transpose()?,
            cols,
            eps,
            &mut y,
            &mut mean,
            &mut rstd,
        );
        Ok(LayerNormOutput { y: Tensor::from_vec(y, &self.shape)?, mean, rstd })
    }

    /// `(B, T, H, D)` of a rank-4 tensor, or an error naming `op`.
    pub fn dims4(&self, op: &'static str) -> Result<[usize; 4]> {
        match self.shape.as_slice() {
            &[b, t, h, d] => Ok([b, t, h, d]),
            _ => Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "expected [B, T, H, D]".into() }),
        }
    }

    /// Rotary position embedding of `x: [B, T, H, D]` (HF LLaMA rotate-half convention),
    /// token t at position `pos_offset + t`, base `theta` (10000 in LLaMA).
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [b, t, h, d] = self.dims4("rope")?;
        if d % 2 != 0 {
            return Err(Error::InvalidShape {
                op: "rope",
                shape: self.shape.clone(),
                reason: "head dim must be even".into(),
            });
        }
        let x = self.contiguous()?;
        let (cos, sin) = rope::rope_table(pos_offset + t, d, theta);
        let mut y = crate::pool::buffer(x.numel());
        rope::rope_forward(x.as_slice()?, &cos, &sin, b, t, h, d, pos_offset, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// Rows of `self: [V, C]` picked by `ids`; the output has shape `ids_shape + [C]`
    /// (PyTorch `F.embedding`, also `index_select` over dimension 0).
    pub fn embedding(&self, ids: &[u32], ids_shape: &[usize]) -> Result<Tensor> {
        self.require_cpu("embedding")?;
        let &[vocab, dim] = self.shape.as_slice() else {
            return Err(Error::InvalidShape {
                op: "embedding",
                shape: self.shape.clone(),
                reason: "weight must be [V, C]".into(),
            });
        };
        if ids_shape.iter().product::<usize>() != ids.len() {
            return Err(Error::ShapeMismatch { op: "embedding", lhs: ids_shape.to_vec(), rhs: vec![ids.len()] });
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(Error::IndexOutOfRange { op: "embedding", index: bad as usize, size: vocab });
        }
        let w = self.contiguous()?;
        let mut out = crate::pool::buffer(ids.len() * dim);
        embedding::embedding_forward(w.as_slice()?, dim, ids, &mut out);
        Tensor::from_vec(out, &[ids_shape, &[dim]].concat())
    }

    /// Causal scaled-dot-product attention of `q: [B, Tq, H, D]` over `k, v: [B, Tk, H, D]`
    /// (Tq ≤ Tk; the queries are the last Tq positions). Returns the output `[B, Tq, H, D]`
    /// and the per-query log-sum-exp `[B, H, Tq]` for backward. No T×T mask is built.
    pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Vec<f32>)> {
        let [b, tq, h, d] = q.dims4("causal_attention")?;
        let [kb, tk, kh, kd] = k.dims4("causal_attention")?;
        if [kb, kh, kd] != [b, h, d] || v.shape != k.shape || tq > tk {
            return Err(Error::ShapeMismatch { op: "causal_attention", lhs: q.shape.clone(), rhs: k.shape.clone() });
        }
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let mut out = crate::pool::buffer(q.numel());
        let mut lse = vec![0.0; b * h * tq];
        attention::causal_attention_forward(
            q.as_slice()?,
            k.as_slice()?,
            v.as_slice()?,
            b,
            tq,
            tk,
            h,
            d,
            scale,
            &mut out,
            &mut lse,
        );
        Ok((Tensor::from_vec(out, &q.shape)?, lse))
    }
}
