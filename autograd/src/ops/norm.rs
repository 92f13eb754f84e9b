//! RMSNorm and LayerNorm over the last axis, fused forward and backward. Each saves its
//! input and per-row statistics (rstd, and mean for LayerNorm), nothing else.

use kernels::cpu::norm::{layer_norm_backward, rms_norm_backward};
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `x / sqrt(mean(x²) + eps) · weight` over the last axis (LLaMA's RMSNorm).
    pub fn rms_norm(&self, weight: &Var, eps: f32) -> Result<Var> {
        let (x, w) = (self.value().contiguous()?, weight.value().contiguous()?);
        let out = x.rms_norm(&w, eps)?;
        let rstd = out.rstd;
        Ok(Var::from_op(out.y, vec![self.clone(), weight.clone()], move |dy| {
            let cols = w.numel();
            let (mut dx, mut dw) = (tensor::pool::zeros(x.numel()), tensor::pool::zeros(cols));
            // d/dx: dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy)), x̂ = x·rstd; dw = Σ_rows dy⊙x̂
            rms_norm_backward(
                x.as_slice()?,
                w.as_slice()?,
                &rstd,
                dy.contiguous()?.as_slice()?,
                cols,
                &mut dx,
                &mut dw,
            );
            Ok(vec![Tensor::from_vec(dx, x.shape())?, Tensor::from_vec(dw, w.shape())?])
        }))
    }

    /// `(x − mean)/sqrt(var + eps) (· weight + bias)` over the last axis.
    pub fn layer_norm(&self, weight: Option<&Var>, bias: Option<&Var>, eps: f32) -> Result<Var> {
        let x = self.value().contiguous()?;
        let w = weight.map(|w| w.value().contiguous()).transpose()?;
        let b = bias.map(|b| b.value().contiguous()).transpose()?;
        let out = x.layer_norm(w.as_ref(), b.as_ref(), eps)?;
        let (mean, rstd) = (out.mean, out.rstd);
        let mut inputs = vec![self.clone()];
        inputs.extend(weight.cloned());
        inputs.extend(bias.cloned());
        let has_bias = b.is_some();
        Ok(Var::from_op(out.y, inputs, move |dy| {
            let cols = *x.shape().last().unwrap_or(&1);
            let mut dx = tensor::pool::zeros(x.numel());
            let mut dw = w.as_ref().map(|_| tensor::pool::zeros(cols));
            let mut db = has_bias.then(|| tensor::pool::zeros(cols));
            // d/dx: dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂)), g = dy⊙w; dw = Σ dy⊙x̂; db = Σ dy
            layer_norm_backward(
                x.as_slice()?,
                w.as_ref().map(|w| w.as_slice()).transpose()?,
                &mean,
                &rstd,
                dy.contiguous()?.as_slice()?,
                cols,
                &mut dx,
                dw.as_deref_mut(),
                db.as_deref_mut(),
            );
            let mut grads = vec![Tensor::from_vec(dx, x.shape())?];
            for g in [dw, db].into_iter().flatten() {
                grads.push(Tensor::from_vec(g, &[cols])?);
            }
            Ok(grads)
        }))
    }
}
