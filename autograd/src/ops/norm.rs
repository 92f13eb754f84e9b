//! RMSNorm and LayerNorm over the last axis, fused forward and backward. Each saves its
//! input and per-row statistics (rstd, and mean for LayerNorm), nothing else; the
//! backward rules are `Tensor::rms_norm_backward` and `Tensor::layer_norm_backward`.

use tensor::ops::AddRmsNormOutput;
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
        let inputs = vec![self.clone(), delta.clone()];
        let sum_node = |sum| Var::from_op(sum, inputs, |dsum| Ok(vec![dsum.clone(), dsum.clone()]));
        Ok(Var::add_rms_norm_nodes(out, sum_node, weight, w))
    }

    /// The graph nodes of a fused residual add and RMSNorm's output `out` (`w`: `weight`'s
    /// contiguous value): the sum's, made by `sum_node` from the sum's value, and the
    /// normalised sum's, whose backward is RMSNorm's of the sum. [`Var::add_rms_norm`] and
    /// the gated add and norm (`Var::fused_gated_add_rms_norm`) differ only in the first.
    pub(crate) fn add_rms_norm_nodes(
        out: AddRmsNormOutput,
        sum_node: impl FnOnce(Tensor) -> Var,
        weight: &Var,
        w: Tensor,
    ) -> (Var, Var) {
        let (sum, rstd) = (out.sum.clone(), out.rstd);
        let sum_var = sum_node(out.sum);
        // d/d sum: rstd·(w⊙dy − ŝ·mean(ŝ⊙w⊙dy)), ŝ = sum·rstd, plus the gradient the sum
        // already has from the later residual add, in the same pass; dw = Σ_rows dy⊙ŝ
        let normed = Var::from_op_absorbing(out.y, vec![sum_var.clone(), weight.clone()], move |dy, dsum| {
            let (dsum, dw) = Tensor::rms_norm_backward(&sum, &w, &rstd, dy, dsum.as_ref())?;
            Ok(vec![dsum, dw])
        });
        (sum_var, normed)
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
