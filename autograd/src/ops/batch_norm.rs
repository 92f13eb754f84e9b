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

use kernels::cpu::batchnorm::batch_norm_train_backward;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Batch norm of `self: [N, C, H, W]` with optional affine `weight[C]`, `bias[C]` and the
    /// running statistics `running_mean[C]`, `running_var[C]` (updated in place when
    /// `training`). Weight and bias come first, as in [`Var::layer_norm`]; PyTorch's
    /// `F.batch_norm` puts the running statistics first.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm2d(
        &self,
        weight: Option<&Var>,
        bias: Option<&Var>,
        running_mean: &Var,
        running_var: &Var,
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
                let [n, c, h, width] = x.dims_nchw("batch_norm2d backward")?;
                let mut dx = tensor::pool::zeros(x.numel());
                let mut dw = w.as_ref().map(|_| tensor::pool::zeros(c));
                let mut db = has_bias.then(|| tensor::pool::zeros(c));
                // d/dx = weight·rstd/m · (m·dy − Σdy − x̂·Σ(dy·x̂)),  x̂ = (x − μ)·rstd, m = N·S,
                // d/dweight = Σ dy·x̂,  d/dbias = Σ dy
                batch_norm_train_backward(
                    x.as_slice()?,
                    n,
                    c,
                    h * width,
                    w.as_ref().map(Tensor::as_slice).transpose()?,
                    &mean,
                    &rstd,
                    dy.contiguous()?.as_slice()?,
                    &mut dx,
                    dw.as_deref_mut(),
                    db.as_deref_mut(),
                );
                per_channel_grads(dx, x.shape(), dw, db)
            }));
        }
        let (rm, rv) = (running_mean.value().contiguous()?, running_var.value().contiguous()?);
        let y = x.batch_norm_eval(w.as_ref(), b.as_ref(), &rm, &rv, eps)?;
        Ok(Var::from_op(y, inputs, move |dy| {
            let [n, c, h, width] = x.dims_nchw("batch_norm2d backward")?;
            let s = h * width;
            let (xs, dys) = (x.as_slice()?, dy.contiguous()?);
            let dys = dys.as_slice()?;
            let (rm, rv) = (rm.as_slice()?, rv.as_slice()?);
            let gain = |ch: usize| w.as_ref().map_or(Ok(1.0), |w| w.as_slice().map(|w| w[ch]));
            let mut dx = tensor::pool::zeros(x.numel());
            let (mut dw_sum, mut db_sum) = (vec![0.0f64; c], vec![0.0f64; c]);
            // Evaluation is affine per channel: y = x̂·weight + bias, x̂ = (x − rm)/√(rv + eps);
            // d/dx = dy·weight/√(rv + eps),  d/dweight = Σ dy·x̂,  d/dbias = Σ dy
            for i in 0..n * c {
                let ch = i % c;
                let inv_std = 1.0 / (rv[ch] + eps).sqrt();
                let scale = gain(ch)? * inv_std;
                let plane = i * s..(i + 1) * s;
                for ((d, &g), &v) in dx[plane.clone()].iter_mut().zip(&dys[plane.clone()]).zip(&xs[plane]) {
                    *d = g * scale;
                    dw_sum[ch] += f64::from(g * (v - rm[ch]) * inv_std);
                    db_sum[ch] += f64::from(g);
                }
            }
            let narrow = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect::<Vec<f32>>();
            let dw = w.as_ref().map(|_| narrow(dw_sum));
            let db = has_bias.then(|| narrow(db_sum));
            per_channel_grads(dx, x.shape(), dw, db)
        }))
    }
}

/// `[dx, dweight?, dbias?]` as tensors, in the order the op listed its inputs.
fn per_channel_grads(dx: Vec<f32>, shape: &[usize], dw: Option<Vec<f32>>, db: Option<Vec<f32>>) -> Result<Vec<Tensor>> {
    let mut grads = vec![Tensor::from_vec(dx, shape)?];
    for g in [dw, db].into_iter().flatten() {
        let c = g.len();
        grads.push(Tensor::from_vec(g, &[c])?);
    }
    Ok(grads)
}
