//! Neural-network ops over the last axis or a fixed layout: softmax, cross-entropy,
//! RMSNorm, LayerNorm, rotary embedding, embedding lookup and causal attention, each with
//! its backward rule beside the forward.
//!
//! Each forward returns what its backward needs (row statistics, log-sum-exp) beside the
//! output, as tensors on the input's device, so the autograd crate saves exactly that and
//! nothing more, and GPU results stay on the GPU (only cross-entropy waits for the device,
//! whose kernel reports its row count). Token ids and targets are host slices on every
//! device (a CUDA op copies them over; they are small).

use kernels::cpu::{attention, cross_entropy, embedding, norm, rope, softmax};

use super::rope_table::rope_table;
use crate::{Error, Result, Tensor};

/// Output of [`Tensor::rms_norm`]: `y` and the per-row `1/rms` (`[rows]`, on `y`'s device)
/// saved for backward.
pub struct RmsNormOutput {
    /// The normalised, scaled output (the input's shape).
    pub y: Tensor,
    /// `1/√(mean(x²) + eps)` of every row, `[rows]`.
    pub rstd: Tensor,
}

/// Output of [`Tensor::layer_norm`]: `y`, per-row mean and `1/std` (each `[rows]`, on
/// `y`'s device) saved for backward.
pub struct LayerNormOutput {
    /// The normalised (and affine-transformed) output (the input's shape).
    pub y: Tensor,
    /// The mean of every row, `[rows]`.
    pub mean: Tensor,
    /// `1/√(var + eps)` of every row, `[rows]`.
    pub rstd: Tensor,
}

/// Output of [`Tensor::cross_entropy`]: the mean loss over counted rows, with the per-row
/// log-sum-exp and the count saved for backward.
pub struct CrossEntropy {
    /// The mean loss, rank 0 on the logits' device (a GPU loss stays there until asked for;
    /// see [`CrossEntropy::loss_value`]).
    pub loss: Tensor,
    /// Log-sum-exp of every row's logits, `[N]` on the logits' device.
    pub lse: Tensor,
    /// Rows whose target is not the ignore index.
    pub count: usize,
}

impl CrossEntropy {
    /// The loss on the host (waits for the GPU when the logits are there).
    pub fn loss_value(&self) -> Result<f32> {
        self.loss.to_host()?.item()
    }
}

impl Tensor {
    /// Width of the last axis, or an error naming `op` for a rank-0 tensor.
    fn last_dim(&self, op: &'static str) -> Result<usize> {
        self.shape.last().copied().ok_or_else(|| Error::InvalidShape {
            op,
            shape: vec![],
            reason: "needs at least one dimension".into(),
        })
    }

    /// Width of the last axis and a contiguous copy (the layout CPU row kernels need).
    fn rows(&self, op: &'static str) -> Result<(usize, Tensor)> {
        self.require_cpu(op)?;
        let cols = self.last_dim(op)?;
        Ok((cols, self.contiguous()?))
    }

    /// Errors unless `other` has exactly this tensor's shape and device.
    fn check_like(&self, op: &'static str, other: &Tensor) -> Result<()> {
        self.same_device(op, other)?;
        if other.shape != self.shape {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: other.shape.clone() });
        }
        Ok(())
    }

    /// Errors unless `stats` holds one value per row of `rows` rows, on this tensor's device.
    fn check_row_stats(&self, op: &'static str, stats: &Tensor, rows: usize) -> Result<()> {
        self.same_device(op, stats)?;
        if stats.numel() != rows {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: stats.shape.clone() });
        }
        Ok(())
    }

    /// Softmax over the last axis.
    pub fn softmax(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::softmax::softmax(self, self.last_dim("softmax")?, false);
        }
        let (cols, x) = self.rows("softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// `dy · ∂softmax/∂x` from the forward's output `y`: `dx = y ⊙ (dy − Σ dy⊙y)` per row.
    pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        Tensor::softmax_family_backward("softmax_backward", y, dy, false)
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::softmax::softmax(self, self.last_dim("log_softmax")?, true);
        }
        let (cols, x) = self.rows("log_softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::log_softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// `dy · ∂log_softmax/∂x` from the forward's output `y`: `dx = dy − exp(y)·Σ dy` per row.
    pub fn log_softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        Tensor::softmax_family_backward("log_softmax_backward", y, dy, true)
    }

    /// The backward of softmax (`log == false`) or log-softmax from the saved output.
    fn softmax_family_backward(op: &'static str, y: &Tensor, dy: &Tensor, log: bool) -> Result<Tensor> {
        y.check_like(op, dy)?;
        #[cfg(feature = "cuda")]
        if y.cuda_storage().is_some() {
            return crate::cuda::softmax::softmax_backward(y, dy, y.last_dim(op)?, log);
        }
        let (cols, y) = y.rows(op)?;
        let mut dx = crate::pool::zeros(y.numel());
        let backward = if log { softmax::log_softmax_backward } else { softmax::softmax_backward };
        backward(y.as_slice()?, dy.contiguous()?.as_slice()?, cols, &mut dx);
        Tensor::from_vec(dx, &y.shape)
    }

    /// Errors unless this is `[N, V]` logits for `targets[N]` with every target below `V`
    /// or equal to `ignore_index`; returns `V`.
    fn check_targets(&self, op: &'static str, targets: &[u32], ignore_index: Option<u32>) -> Result<usize> {
        let cols = self.last_dim(op)?;
        let rows = self.numel() / cols.max(1);
        if self.rank() != 2 || targets.len() != rows {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: vec![targets.len()] });
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= cols && Some(t) != ignore_index) {
            return Err(Error::IndexOutOfRange { op, index: bad as usize, size: cols });
        }
        Ok(cols)
    }

    /// Mean cross-entropy of logits `[N, V]` against class ids `targets[N]`; rows whose
    /// target equals `ignore_index` are skipped (PyTorch `F.cross_entropy`). On a GPU this
    /// waits for the logits (the kernel reports its row count) but leaves the loss there.
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<CrossEntropy> {
        let cols = self.check_targets("cross_entropy", targets, ignore_index)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::softmax::cross_entropy(self, cols, targets, ignore_index);
        }
        let (_, x) = self.rows("cross_entropy")?;
        let rows = targets.len();
        let mut losses = vec![0.0; rows];
        let mut lse = vec![0.0; rows];
        let count =
            cross_entropy::cross_entropy_forward(x.as_slice()?, cols, targets, ignore_index, &mut losses, &mut lse);
        let total: f64 = losses.iter().map(|&l| l as f64).sum();
        let loss = if count == 0 { 0.0 } else { (total / count as f64) as f32 };
        Ok(CrossEntropy { loss: Tensor::scalar(loss), lse: Tensor::from_vec(lse, &[rows])?, count })
    }

    /// `scale · (softmax(logits) − onehot(target))` for every row not ignored (ignored rows
    /// get zeros): the backward of [`Tensor::cross_entropy`] from its saved `lse`, with
    /// `scale = d loss / count`.
    pub fn cross_entropy_backward(
        logits: &Tensor,
        targets: &[u32],
        ignore_index: Option<u32>,
        lse: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let cols = logits.check_targets(OP, targets, ignore_index)?;
        logits.check_row_stats(OP, lse, targets.len())?;
        #[cfg(feature = "cuda")]
        if logits.cuda_storage().is_some() {
            return crate::cuda::softmax::cross_entropy_backward(logits, cols, targets, ignore_index, lse, scale);
        }
        let (_, logits) = logits.rows(OP)?;
        let mut dlogits = crate::pool::zeros(logits.numel());
        let lse = lse.contiguous()?;
        cross_entropy::cross_entropy_backward(
            logits.as_slice()?,
            cols,
            targets,
            ignore_index,
            lse.as_slice()?,
            scale,
            &mut dlogits,
        );
        Tensor::from_vec(dlogits, &logits.shape)
    }

    /// Errors unless `weight` (when given) is `[cols]` on this tensor's device.
    fn check_weight(&self, op: &'static str, weight: Option<&Tensor>, cols: usize) -> Result<()> {
        match weight {
            Some(w) if w.shape != [cols] => {
                Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: w.shape.clone() })
            }
            Some(w) => self.same_device(op, w),
            None => Ok(()),
        }
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) · weight` (LLaMA's norm).
    pub fn rms_norm(&self, weight: &Tensor, eps: f32) -> Result<RmsNormOutput> {
        let cols = self.last_dim("rms_norm")?;
        self.check_weight("rms_norm", Some(weight), cols)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::norm::rms_norm(self, weight, cols, eps);
        }
        let (_, x) = self.rows("rms_norm")?;
        let rows = x.numel() / cols.max(1);
        let mut y = crate::pool::buffer(x.numel());
        let mut rstd = vec![0.0; rows];
        norm::rms_norm_forward(x.as_slice()?, weight.contiguous()?.as_slice()?, cols, eps, &mut y, &mut rstd);
        Ok(RmsNormOutput { y: Tensor::from_vec(y, &self.shape)?, rstd: Tensor::from_vec(rstd, &[rows])? })
    }

    /// `(dx, dweight)` of [`Tensor::rms_norm`] from its input, weight and saved `rstd`:
    /// `dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy))`, `dweight = Σ_rows dy⊙x̂`, with `x̂ = x·rstd`.
    pub fn rms_norm_backward(x: &Tensor, weight: &Tensor, rstd: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let cols = x.last_dim(OP)?;
        x.check_weight(OP, Some(weight), cols)?;
        x.check_like(OP, dy)?;
        x.check_row_stats(OP, rstd, x.numel() / cols.max(1))?;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return crate::cuda::norm::rms_norm_backward(x, weight, rstd, dy, cols);
        }
        let (_, x) = x.rows(OP)?;
        let (w, rstd) = (weight.contiguous()?, rstd.contiguous()?);
        let (mut dx, mut dw) = (crate::pool::buffer(x.numel()), crate::pool::zeros(cols));
        norm::rms_norm_backward(
            x.as_slice()?,
            w.as_slice()?,
            rstd.as_slice()?,
            dy.contiguous()?.as_slice()?,
            cols,
            &mut dx,
            &mut dw,
            false,
        );
        Ok((Tensor::from_vec(dx, &x.shape)?, Tensor::from_vec(dw, &w.shape)?))
    }

    /// LayerNorm over the last axis, with optional affine weight and bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<LayerNormOutput> {
        let cols = self.last_dim("layer_norm")?;
        self.check_weight("layer_norm", weight, cols)?;
        self.check_weight("layer_norm", bias, cols)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::norm::layer_norm(self, weight, bias, cols, eps);
        }
        let (_, x) = self.rows("layer_norm")?;
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
        Ok(LayerNormOutput {
            y: Tensor::from_vec(y, &self.shape)?,
            mean: Tensor::from_vec(mean, &[rows])?,
            rstd: Tensor::from_vec(rstd, &[rows])?,
        })
    }

    /// `(dx, dweight, dbias)` of [`Tensor::layer_norm`] from its input, optional weight and
    /// saved `mean`/`rstd`; `dweight` is computed when `weight` is given, `dbias` when
    /// `with_bias`. With `g = dy⊙w`: `dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂))`,
    /// `dweight = Σ_rows dy⊙x̂`, `dbias = Σ_rows dy`.
    pub fn layer_norm_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        with_bias: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "layer_norm_backward";
        let cols = x.last_dim(OP)?;
        let rows = x.numel() / cols.max(1);
        x.check_weight(OP, weight, cols)?;
        x.check_like(OP, dy)?;
        x.check_row_stats(OP, mean, rows)?;
        x.check_row_stats(OP, rstd, rows)?;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return crate::cuda::norm::layer_norm_backward(x, weight, mean, rstd, dy, cols, with_bias);
        }
        let (_, x) = x.rows(OP)?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let (mean, rstd) = (mean.contiguous()?, rstd.contiguous()?);
        let mut dx = crate::pool::zeros(x.numel());
        let mut dw = w.as_ref().map(|_| crate::pool::zeros(cols));
        let mut db = with_bias.then(|| crate::pool::zeros(cols));
        norm::layer_norm_backward(
            x.as_slice()?,
            w.as_ref().map(|w| w.as_slice()).transpose()?,
            mean.as_slice()?,
            rstd.as_slice()?,
            dy.contiguous()?.as_slice()?,
            cols,
            &mut dx,
            dw.as_deref_mut(),
            db.as_deref_mut(),
        );
        let column = |g: Vec<f32>| Tensor::from_vec(g, &[cols]);
        Ok((Tensor::from_vec(dx, &x.shape)?, dw.map(column).transpose()?, db.map(column).transpose()?))
    }

    /// `(B, T, H, D)` of a rank-4 tensor, or an error naming `op`.
    pub fn dims4(&self, op: &'static str) -> Result<[usize; 4]> {
        match self.shape.as_slice() {
            &[b, t, h, d] => Ok([b, t, h, d]),
            _ => Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "expected [B, T, H, D]".into() }),
        }
    }

    /// [`Tensor::dims4`] with an even head dim (rotary embedding pairs its halves).
    fn rope_dims(&self, op: &'static str) -> Result<[usize; 4]> {
        let dims = self.dims4(op)?;
        if dims[3] % 2 != 0 {
            return Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "head dim must be even".into() });
        }
        Ok(dims)
    }

    /// Rotary position embedding of `x: [B, T, H, D]` (HF LLaMA rotate-half convention),
    /// token t at position `pos_offset + t`, base `theta` (10000 in LLaMA).
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [b, t, h, d] = self.rope_dims("rope")?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::rope::rope(self, theta, pos_offset, false);
        }
        let x = self.contiguous()?;
        let table = rope_table(pos_offset + t, d, theta);
        let mut y = crate::pool::buffer(x.numel());
        rope::rope_forward(x.as_slice()?, &table.cos, &table.sin, b, t, h, d, pos_offset, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// The backward of [`Tensor::rope`] for the gradient `self = dy` of its output: the
    /// inverse rotation `dx = Rᵀ dy` (a rotation is orthogonal; nothing is saved).
    pub fn rope_backward(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [b, t, h, d] = self.rope_dims("rope_backward")?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::rope::rope(self, theta, pos_offset, true);
        }
        let dy = self.contiguous()?;
        let table = rope_table(pos_offset + t, d, theta);
        let mut dx = crate::pool::buffer(dy.numel());
        rope::rope_backward(dy.as_slice()?, &table.cos, &table.sin, b, t, h, d, pos_offset, &mut dx, false);
        Tensor::from_vec(dx, &self.shape)
    }

    /// Errors unless every id is below `vocab`.
    fn check_ids(op: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
        match ids.iter().find(|&&i| i as usize >= vocab) {
            Some(&bad) => Err(Error::IndexOutOfRange { op, index: bad as usize, size: vocab }),
            None => Ok(()),
        }
    }

    /// Rows of `self: [V, C]` picked by `ids`; the output has shape `ids_shape + [C]`
    /// (PyTorch `F.embedding`, also `index_select` over dimension 0).
    pub fn embedding(&self, ids: &[u32], ids_shape: &[usize]) -> Result<Tensor> {
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
        Tensor::check_ids("embedding", ids, vocab)?;
        let out_shape = [ids_shape, &[dim]].concat();
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::embedding::embedding(self, ids, &out_shape);
        }
        self.require_cpu("embedding")?;
        let w = self.contiguous()?;
        let mut out = crate::pool::buffer(ids.len() * dim);
        embedding::embedding_forward(w.as_slice()?, dim, ids, &mut out);
        Tensor::from_vec(out, &out_shape)
    }

    /// The weight gradient `[vocab, C]` of [`Tensor::embedding`] for the gradient `dy`
    /// (`ids_shape + [C]`) of its output: `dW[ids[i]] += dy[i]` (a row used twice gets both).
    pub fn embedding_backward(ids: &[u32], dy: &Tensor, vocab: usize) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        let dim = dy.last_dim(OP)?;
        if dy.numel() != ids.len() * dim {
            return Err(Error::ShapeMismatch { op: OP, lhs: dy.shape.clone(), rhs: vec![ids.len(), dim] });
        }
        Tensor::check_ids(OP, ids, vocab)?;
        #[cfg(feature = "cuda")]
        if dy.cuda_storage().is_some() {
            return crate::cuda::embedding::embedding_backward(ids, dy, vocab, dim);
        }
        dy.require_cpu(OP)?;
        let mut dw = crate::pool::zeros(vocab * dim);
        embedding::embedding_backward(ids, dy.contiguous()?.as_slice()?, dim, &mut dw);
        Tensor::from_vec(dw, &[vocab, dim])
    }

    /// Checks causal-attention operands (`q: [B, Tq, H, D]`, `k, v: [B, Tk, H, D]`,
    /// `0 < D`, `Tq ≤ Tk`, one device); returns `[B, Tq, Tk, H, D]`.
    fn attention_dims(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<[usize; 5]> {
        let [b, tq, h, d] = q.dims4(op)?;
        let [kb, tk, kh, kd] = k.dims4(op)?;
        if [kb, kh, kd] != [b, h, d] || v.shape != k.shape || tq > tk {
            return Err(Error::ShapeMismatch { op, lhs: q.shape.clone(), rhs: k.shape.clone() });
        }
        if d == 0 {
            return Err(Error::InvalidShape { op, shape: q.shape.clone(), reason: "zero head dim".into() });
        }
        q.same_device(op, k)?;
        q.same_device(op, v)?;
        Ok([b, tq, tk, h, d])
    }

    /// Causal scaled-dot-product attention of `q: [B, Tq, H, D]` over `k, v: [B, Tk, H, D]`
    /// (Tq ≤ Tk; the queries are the last Tq positions). Returns the output `[B, Tq, H, D]`
    /// and the per-query log-sum-exp `[B, H, Tq]` (on the inputs' device) for backward. No
    /// T×T mask is built.
    pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Tensor)> {
        let [b, tq, tk, h, d] = Tensor::attention_dims("causal_attention", q, k, v)?;
        #[cfg(feature = "cuda")]
        if q.cuda_storage().is_some() {
            return crate::cuda::attention::causal_attention(q, k, v, scale);
        }
        q.require_cpu("causal_attention")?;
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
        Ok((Tensor::from_vec(out, &q.shape)?, Tensor::from_vec(lse, &[b, h, tq])?))
    }

    /// `(dq, dk, dv)` of [`Tensor::causal_attention`] from its inputs, output `out`, saved
    /// `lse` and the output gradient `dout`. The probabilities are recomputed tile by tile:
    /// `dq = dS·k·scale`, `dk = dSᵀ·q·scale`, `dv = Pᵀ·dout`, `dS = P ⊙ (dP − rowsum(dout⊙out))`.
    pub fn causal_attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "causal_attention_backward";
        let [b, tq, tk, h, d] = Tensor::attention_dims(OP, q, k, v)?;
        q.check_like(OP, out)?;
        q.check_like(OP, dout)?;
        q.check_row_stats(OP, lse, b * h * tq)?;
        #[cfg(feature = "cuda")]
        if q.cuda_storage().is_some() {
            return crate::cuda::attention::causal_attention_backward(q, k, v, out, lse, dout, scale);
        }
        q.require_cpu(OP)?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let (out, lse, dout) = (out.contiguous()?, lse.contiguous()?, dout.contiguous()?);
        let (mut dq, mut dk, mut dv) =
            (crate::pool::buffer(q.numel()), crate::pool::buffer(k.numel()), crate::pool::buffer(v.numel()));
        attention::causal_attention_backward(
            q.as_slice()?,
            k.as_slice()?,
            v.as_slice()?,
            out.as_slice()?,
            lse.as_slice()?,
            dout.as_slice()?,
            b,
            tq,
            tk,
            h,
            d,
            scale,
            &mut dq,
            &mut dk,
            &mut dv,
            false,
        );
        Ok((Tensor::from_vec(dq, &q.shape)?, Tensor::from_vec(dk, &k.shape)?, Tensor::from_vec(dv, &v.shape)?))
    }
}
