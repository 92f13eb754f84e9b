//! RMSNorm and LayerNorm over the last axis, fused forward and backward. Each saves its
//! input and per-row statistics (rstd, and mean for LayerNorm), nothing else; the
//! backward rules are `Tensor::rms_norm_backward` and `Tensor::layer_norm_backward`.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `x / sqrt(mean(x²) + eps) · weight` over the last axis (LLaMA's RMSNorm).
    pub fn rms_norm(&self, weight: &Var, eps: f32) -> Result<Var> {
        let (x, w) = (self.value().contiguous()?, weight.value().contiguous()?);
        let out = x.rms_norm(&w, eps)?;
        let rstd = out.rstd;
        // d/dx: dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy)), x̂ = x·rstd, plus the gradient x already
        // has (a pre-ln block's residual stream), in the same pass; dw = Σ_rows dy⊙x̂
        Ok(Var::from_op_absorbing(out.y, vec![self.clone(), weight.clone()], move |dy, dx| {
            let (dx, dw) = Tensor::rms_norm_backward(&x, &w, &rstd, dy, dx.as_ref())?;
            Ok(vec![dx, dw])
        }))
    }

    /// A pre-ln LLaMA block's residual add and the next RMSNorm in one kernel:
    /// `(sum, normed)` with `sum = self + delta` (same shape; the next residual stream) and
    /// `normed = rms_norm(sum, weight, eps)`, bit for bit as [`Var::add`] then
    /// [`Var::rms_norm`]. The gradient of `sum` is what arrives from the later residual plus
    /// RMSNorm's `dx`, added by the norm's backward kernel ([`Var::from_op_absorbing`]);
    /// `self` and `delta` both receive it.
    pub fn add_rms_norm(&self, delta: &Var, weight: &Var, eps: f32) -> Result<(Var, Var)> {
        let (x, d, w) = (self.value_ref(), delta.value_ref(), weight.value().contiguous()?);
        let out = x.add_rms_norm(&d, &w, eps)?;
        // d(x + delta)/dx = d(x + delta)/d delta = 1
        let (sum, rstd) = (out.sum.clone(), out.rstd);
        let sum_var =
            Var::from_op(out.sum, vec![self.clone(), delta.clone()], |dsum| Ok(vec![dsum.clone(), dsum.clone()]));
        // d/d sum: rstd·(w⊙dy − ŝ·mean(ŝ⊙w⊙dy)), ŝ = sum·rstd, plus the gradient the sum
        // already has from the later residual add, in the same pass; dw = Σ_rows dy⊙ŝ
        let normed = Var::from_op_absorbing(out.y, vec![sum_var.clone(), weight.clone()], move |dy, dsum| {
            let (dsum, dw) = Tensor::rms_norm_backward(&sum, &w, &rstd, dy, dsum.as_ref())?;
            Ok(vec![dsum, dw])
        });
        Ok((sum_var, normed))
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
        // d/dx: dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂)), g = dy⊙w; dw = Σ dy⊙x̂; db = Σ dy
        Ok(Var::from_op(out.y, inputs, move |dy| {
            let (dx, dw, db) = Tensor::layer_norm_backward(&x, w.as_ref(), &mean, &rstd, dy, has_bias)?;
            Ok([Some(dx), dw, db].into_iter().flatten().collect())
        }))
    }
}
