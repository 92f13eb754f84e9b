//! Batch normalisation of `x[N, C, H, W]` over `N, H, W` per channel (Ioffe & Szegedy 2015,
//! Algorithm 1): `y = (x − μ[c])·rstd[c] (· weight[c] + bias[c])`, `rstd = 1/√(σ² + eps)`.
//!
//! PyTorch equivalent: `F.batch_norm(x, running_mean, running_var, weight, bias, training,
//! momentum, eps)`. Training mode normalises with the batch statistics and updates the
//! running statistics in place (`running = (1 − momentum)·running + momentum·batch`,
//! unbiased variance); it saves `x`, the batch mean and rstd. Evaluation mode normalises with
//! the running statistics, an affine map per channel; it saves `x` and the running
//! statistics as they were. The running statistics are non-trainable [`Var`] leaves
//! (`Var::constant`), so checkpoints can save and load them like parameters.
//! Gradients accumulate in the walk (`+=` semantics).
//!
//! Legend: `N` batch, `C` channels, `S = H·W` one plane.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Batch norm of `self: [N, C, H, W]` with optional affine `weight[C]`, `bias[C]` and the
    /// running statistics `[running_mean[C], running_var[C]]` (updated in place when
    /// `training`). Weight and bias come first, as in [`Var::layer_norm`]; PyTorch's
    /// `F.batch_norm` puts the running statistics first.
    pub fn batch_norm2d(
        &self,
        weight: Option<&Var>,
        bias: Option<&Var>,
        [running_mean, running_var]: [&Var; 2],
        training: bool,
        momentum: f32,
        eps: f32,
    ) -> Result<Var> {
        let x = self.value().contiguous()?;
        let w = weight.map(|w| w.value().contiguous()).transpose()?;
        let b = bias.map(|b| b.value().contiguous()).transpose()?;
        let mut inputs = vec![self.clone()];
        inputs.extend(weight.cloned());
        inputs.extend(bias.cloned());
        let has_bias = bias.is_some();
        if training {
            let out = {
                let (mut rm, mut rv) = (running_mean.value_mut(), running_var.value_mut());
                x.batch_norm_train(w.as_ref(), b.as_ref(), &mut rm, &mut rv, momentum, eps)?
            };
            let (mean, rstd) = (out.mean, out.rstd);
            return Ok(Var::from_op(out.y, inputs, move |dy| {
                // d/dx = weight·rstd/m · (m·dy − Σdy − x̂·Σ(dy·x̂)),  x̂ = (x − μ)·rstd, m = N·S,
                // d/dweight = Σ dy·x̂,  d/dbias = Σ dy
                Ok(Tensor::batch_norm_train_backward(&x, w.as_ref(), &mean, &rstd, dy, has_bias)?.into_vec())
            }));
        }
        let (rm, rv) = (running_mean.value().contiguous()?, running_var.value().contiguous()?);
        let y = x.batch_norm_eval(w.as_ref(), b.as_ref(), &rm, &rv, eps)?;
        Ok(Var::from_op(y, inputs, move |dy| {
            // Evaluation is affine per channel: y = x̂·weight + bias, x̂ = (x − rm)/√(rv + eps);
            // d/dx = dy·weight/√(rv + eps),  d/dweight = Σ dy·x̂,  d/dbias = Σ dy
            Ok(Tensor::batch_norm_eval_backward(&x, w.as_ref(), &rm, &rv, eps, dy, has_bias)?.into_vec())
        }))
    }
}
