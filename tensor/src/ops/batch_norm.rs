//! Batch normalisation of `x[N, C, H, W]` over `N, H, W` per channel (Ioffe & Szegedy 2015),
//! training and evaluation forms, forward and backward, on the CPU (`kernels::cpu::batch_norm`)
//! or a GPU (`kernels::cuda::batch_norm`). No autograd here.
//!
//! `y = (x − μ[c])·rstd[c] (· weight[c] + bias[c])`, `rstd = 1/√(σ² + eps)`. Training uses
//! the batch statistics (biased variance) and updates the running statistics in place;
//! evaluation uses the running statistics, an affine map per channel. PyTorch equivalent:
//! `F.batch_norm`. Legend: `N` batch, `C` channels, `S = H·W` one plane.

use kernels::cpu::batch_norm::{batch_norm_eval_forward, batch_norm_train_backward, batch_norm_train_forward};
use kernels::cpu::batch_norm::{Affine, BatchNormDims, BatchStats, RunningStats};
use kernels::cpu::norm::NormGrads;

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::batch_norm_train`]: `y` and the per-channel batch mean and
/// `1/√(var + eps)` (`[C]` each, on `x`'s device) that the backward reads.
pub struct BatchNormOutput {
    /// The normalised output, shaped like `x`.
    pub y: Tensor,
    /// The batch mean μ per channel, `[C]`.
    pub mean: Tensor,
    /// `1/√(σ² + eps)` per channel with the biased batch variance σ², `[C]`.
    pub rstd: Tensor,
}

/// Gradients of a batch norm: `d/dx` always, `d/dweight` and `d/dbias` when asked for.
pub struct BatchNormGrads {
    /// `d/dx`, shaped like `x`.
    pub x: Tensor,
    /// `d/dweight = Σ dy·x̂`, `[C]` (when the op has a weight).
    pub weight: Option<Tensor>,
    /// `d/dbias = Σ dy`, `[C]` (when the op has a bias).
    pub bias: Option<Tensor>,
}

impl BatchNormGrads {
    /// `[dx, dweight?, dbias?]`, the order in which the op lists its inputs.
    pub fn into_vec(self) -> Vec<Tensor> {
        let mut grads = vec![self.x];
        grads.extend(self.weight);
        grads.extend(self.bias);
        grads
    }
}

/// `[dx, dweight?, dbias?]` host vectors as [`BatchNormGrads`].
fn host_grads(dx: Vec<f32>, shape: &[usize], dw: Option<Vec<f32>>, db: Option<Vec<f32>>) -> Result<BatchNormGrads> {
    let per_channel = |g: Vec<f32>| {
        let c = g.len();
        Tensor::from_vec(g, &[c])
    };
    Ok(BatchNormGrads {
        x: Tensor::from_vec(dx, shape)?,
        weight: dw.map(per_channel).transpose()?,
        bias: db.map(per_channel).transpose()?,
    })
}

impl Tensor {
    /// Checks `x[N, C, H, W]` against per-channel `[C]` tensors (weight, bias, running
    /// statistics) on its device and returns the kernels' sizes `(N, C, S = H·W)` with `eps`
    /// and `momentum`.
    fn batch_norm_dims(
        &self,
        op: &'static str,
        per_channel: &[Option<&Tensor>],
        (eps, momentum): (f32, f32),
    ) -> Result<BatchNormDims> {
        let [n, c, h, w] = self.dims_nchw(op)?;
        for t in per_channel.iter().flatten() {
            self.same_device(op, t)?;
            if t.shape != [c] {
                return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: t.shape.clone() });
            }
        }
        Ok(BatchNormDims { batch: n, channels: c, spatial: h * w, eps, momentum })
    }

    /// Training-mode batch norm of `x[N, C, H, W]` with the batch statistics (biased
    /// variance), optional affine `weight[C]`, `bias[C]`. Updates the running statistics in
    /// place, `running = (1 − momentum)·running + momentum·batch` with the unbiased variance
    /// (PyTorch). Needs at least two values per channel (`N·H·W ≥ 2`), as PyTorch does.
    pub fn batch_norm_train(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: &mut Tensor,
        running_var: &mut Tensor,
        momentum: f32,
        eps: f32,
    ) -> Result<BatchNormOutput> {
        let op = "batch_norm_train";
        let per_channel = [weight, bias, Some(&*running_mean), Some(&*running_var)];
        let dims = self.batch_norm_dims(op, &per_channel, (eps, momentum))?;
        if dims.batch * dims.spatial < 2 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "training needs more than one value per channel".into(),
            });
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::train(
                self,
                &dims,
                Affine { weight, bias },
                RunningStats { mean: running_mean, var: running_var },
            );
        }
        let c = dims.channels;
        let x = self.contiguous()?;
        let (w, b) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.numel()], vec![0.0; c], vec![0.0; c]);
        let affine = Affine {
            weight: w.as_ref().map(Tensor::as_slice).transpose()?,
            bias: b.as_ref().map(Tensor::as_slice).transpose()?,
        };
        let running = RunningStats { mean: running_mean.as_mut_slice()?, var: running_var.as_mut_slice()? };
        let stats = BatchStats { mean: &mut mean[..], rstd: &mut rstd[..] };
        batch_norm_train_forward(x.as_slice()?, affine, &dims, running, &mut y, stats);
        Ok(BatchNormOutput {
            y: Tensor::from_vec(y, &self.shape)?,
            mean: Tensor::from_vec(mean, &[c])?,
            rstd: Tensor::from_vec(rstd, &[c])?,
        })
    }

    /// Evaluation-mode batch norm: `(x − running_mean)/√(running_var + eps) (· weight + bias)`.
    pub fn batch_norm_eval(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: &Tensor,
        running_var: &Tensor,
        eps: f32,
    ) -> Result<Tensor> {
        let op = "batch_norm_eval";
        // Evaluation leaves the running statistics as they are: no momentum.
        let dims = self.batch_norm_dims(op, &[weight, bias, Some(running_mean), Some(running_var)], (eps, 0.0))?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::eval(
                self,
                &dims,
                Affine { weight, bias },
                RunningStats { mean: running_mean, var: running_var },
            );
        }
        let x = self.contiguous()?;
        let (w, b) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        let (rm, rv) = (running_mean.contiguous()?, running_var.contiguous()?);
        let mut y = vec![0.0; x.numel()];
        let affine = Affine {
            weight: w.as_ref().map(Tensor::as_slice).transpose()?,
            bias: b.as_ref().map(Tensor::as_slice).transpose()?,
        };
        batch_norm_eval_forward(
            x.as_slice()?,
            affine,
            &dims,
            RunningStats { mean: rm.as_slice()?, var: rv.as_slice()? },
            &mut y,
        );
        Tensor::from_vec(y, &self.shape)
    }

    /// The backward of [`Tensor::batch_norm_train`] from its saved batch `mean` and `rstd`,
    /// for the output gradient `dy` (shaped like `x`). `d/dweight` is computed when `weight`
    /// is given, `d/dbias` when `bias`:
    /// `d/dx = weight·rstd/m · (m·dy − Σdy − x̂·Σ(dy·x̂))`, `x̂ = (x − μ)·rstd`, `m = N·S`,
    /// `d/dweight = Σ dy·x̂`, `d/dbias = Σ dy`.
    pub fn batch_norm_train_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        bias: bool,
    ) -> Result<BatchNormGrads> {
        let op = "batch_norm_train_backward";
        // The backward reads the saved rstd: neither eps nor momentum is used.
        let dims = x.batch_norm_dims(op, &[weight, Some(mean), Some(rstd)], (0.0, 0.0))?;
        x.same_device(op, dy)?;
        if dy.shape != x.shape {
            return Err(Error::ShapeMismatch { op, lhs: x.shape.clone(), rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::train_backward(x, &dims, weight, BatchStats { mean, rstd }, dy, bias);
        }
        let c = dims.channels;
        let (x, dy) = (x.contiguous()?, dy.contiguous()?);
        let w = weight.map(Tensor::contiguous).transpose()?;
        let (mean, rstd) = (mean.contiguous()?, rstd.contiguous()?);
        let mut dx = crate::pool::buffer(x.numel());
        let mut dw = w.as_ref().map(|_| crate::pool::buffer(c));
        let mut db = bias.then(|| crate::pool::buffer(c));
        batch_norm_train_backward(
            x.as_slice()?,
            w.as_ref().map(Tensor::as_slice).transpose()?,
            BatchStats { mean: mean.as_slice()?, rstd: rstd.as_slice()? },
            dy.as_slice()?,
            &dims,
            NormGrads { dx: &mut dx, dweight: dw.as_deref_mut(), dbias: db.as_deref_mut() },
        );
        host_grads(dx, &x.shape, dw, db)
    }

    /// The backward of [`Tensor::batch_norm_eval`], an affine map per channel:
    /// `y = x̂·weight + bias`, `x̂ = (x − rm)/√(rv + eps)`; `d/dx = dy·weight/√(rv + eps)`,
    /// `d/dweight = Σ dy·x̂` (when `weight` is given), `d/dbias = Σ dy` (when `bias`).
    pub fn batch_norm_eval_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        running_mean: &Tensor,
        running_var: &Tensor,
        eps: f32,
        dy: &Tensor,
        bias: bool,
    ) -> Result<BatchNormGrads> {
        let op = "batch_norm_eval_backward";
        let dims = x.batch_norm_dims(op, &[weight, Some(running_mean), Some(running_var)], (eps, 0.0))?;
        x.same_device(op, dy)?;
        if dy.shape != x.shape {
            return Err(Error::ShapeMismatch { op, lhs: x.shape.clone(), rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            let running = RunningStats { mean: running_mean, var: running_var };
            return cuda::eval_backward(x, &dims, weight, running, dy, bias);
        }
        let BatchNormDims { batch: n, channels: c, spatial: s, .. } = dims;
        let (x, dy) = (x.contiguous()?, dy.contiguous()?);
        let w = weight.map(Tensor::contiguous).transpose()?;
        let (rm, rv) = (running_mean.contiguous()?, running_var.contiguous()?);
        let (xs, dys) = (x.as_slice()?, dy.as_slice()?);
        let (rm, rv) = (rm.as_slice()?, rv.as_slice()?);
        let gain = |ch: usize| w.as_ref().map_or(Ok(1.0), |w| w.as_slice().map(|w| w[ch]));
        let mut dx = crate::pool::buffer(x.numel());
        let (mut dw_sum, mut db_sum) = (vec![0.0f64; c], vec![0.0f64; c]);
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
        let db = bias.then(|| narrow(db_sum));
        host_grads(dx, &x.shape, dw, db)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_name_the_op() {
        let x = Tensor::zeros(&[2, 3, 5, 5]);
        let (mut rm, mut rv) = (Tensor::zeros(&[3]), Tensor::ones(&[3]));
        assert!(x.batch_norm_train(Some(&Tensor::ones(&[4])), None, &mut rm, &mut rv, 0.1, 1e-5).is_err());
        assert!(Tensor::zeros(&[1, 3, 1, 1]).batch_norm_train(None, None, &mut rm, &mut rv, 0.1, 1e-5).is_err());
        let out = x.batch_norm_train(None, None, &mut rm, &mut rv, 0.1, 1e-5).unwrap();
        let msg = Tensor::batch_norm_train_backward(&x, None, &out.mean, &out.rstd, &Tensor::zeros(&[2, 3]), false)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(msg.contains("batch_norm_train_backward") && msg.contains("[2, 3]"), "{msg}");
    }

    #[test]
    fn batch_norm_train_normalises_and_updates_running_stats() {
        let x = Tensor::from_vec((0..16).map(|i| i as f32).collect(), &[2, 2, 2, 2]).unwrap();
        let (mut rm, mut rv) = (Tensor::zeros(&[2]), Tensor::ones(&[2]));
        let out = x.batch_norm_train(None, None, &mut rm, &mut rv, 0.5, 0.0).unwrap();
        // Channel 0 holds 0..4 and 8..12: mean 5.5.
        assert!((out.mean.to_vec()[0] - 5.5).abs() < 1e-6);
        assert!((rm.to_vec()[0] - 2.75).abs() < 1e-6);
        let y = out.y.to_vec();
        let channel0: f32 = y[..4].iter().chain(&y[8..12]).sum();
        assert!(channel0.abs() < 1e-5);
        let eval = x.batch_norm_eval(None, None, &Tensor::zeros(&[2]), &Tensor::ones(&[2]), 0.0).unwrap();
        assert!(eval.all_close(&x, 1e-6, 1e-6));
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/batch_norm.rs`: batch normalisation through
    //! `kernels::cuda::batch_norm` (training forward and backward, evaluation forward).
    //!
    //! The evaluation backward has no kernel of its own; it is composed of launchers that
    //! compute exactly its formulas: `d/dx = dy·weight/√(rv + eps)` is the evaluation forward
    //! applied to `dy` with a zero mean and no bias, and `d/dweight = Σ dy·x̂`, `d/dbias = Σ dy`
    //! (with `x̂ = (x − rm)·rstd`, `rstd = 1/√(rv + eps)`) are the sums the training backward
    //! computes when given `rm` and that `rstd` as its statistics (its own `dx`, which subtracts
    //! batch terms, goes to a scratch buffer that is dropped).

    use std::sync::Arc;

    use kernels::cuda::batch_norm::{self as launch, Affine, BatchNormDims, BatchStats, NormGrads, RunningStats};
    use kernels::cuda::elementwise::{scalar_forward, unary_forward, Binary, Unary};
    use kernels::cuda::DeviceBuffer;

    use super::{BatchNormGrads, BatchNormOutput};
    use crate::cuda::{output, CudaStorage};
    use crate::{Error, Result, Storage, Tensor};

    /// The f32 device buffer of `t` for writing in place, first replacing `t` by a private
    /// dense copy when it is strided, part of a larger buffer or shared with another tensor
    /// (copy-on-write, as `Tensor::as_mut_slice` on the host).
    fn owned_f32_mut<'t>(t: &'t mut Tensor, op: &'static str) -> Result<&'t mut DeviceBuffer<f32>> {
        let dense = t.is_contiguous() && t.offset == 0 && t.storage.len() == t.numel();
        let shared = Arc::strong_count(&t.storage) > 1 || Arc::weak_count(&t.storage) > 0;
        if !dense || shared {
            *t = t.deep_copy()?;
        }
        let device = t.device;
        match Arc::get_mut(&mut t.storage) {
            Some(Storage::Cuda(storage)) => storage.f32_buffer_mut(op),
            _ => Err(Error::UnsupportedDevice { op, device }),
        }
    }

    /// Dense views of optional per-channel tensors.
    fn dense_all<const K: usize>(tensors: [Option<&Tensor>; K]) -> Result<[Option<Tensor>; K]> {
        let mut out = [const { None }; K];
        for (slot, t) in out.iter_mut().zip(tensors) {
            *slot = t.map(Tensor::dense).transpose()?;
        }
        Ok(out)
    }

    /// The f32 buffer of an optional dense tensor.
    fn buffer<'t>(t: &'t Option<Tensor>, op: &'static str) -> Result<Option<&'t DeviceBuffer<f32>>> {
        t.as_ref().map(|t| t.cuda_f32(op)).transpose()
    }

    /// Training forward (`dims` checked by the caller): `y`, the batch mean and rstd; updates
    /// the running statistics in place.
    pub(crate) fn train(
        x: &Tensor,
        dims: &BatchNormDims,
        affine: Affine<'_, Tensor>,
        running: RunningStats<&mut Tensor>,
    ) -> Result<BatchNormOutput> {
        const OP: &str = "batch_norm_train";
        let dev = x.cuda_device(OP)?;
        let c = dims.channels;
        let x = x.dense()?;
        let [w, b] = dense_all([affine.weight, affine.bias])?;
        let mut y = CudaStorage::alloc(&dev, x.numel())?;
        let (mut mean, mut rstd) = (CudaStorage::alloc(&dev, c)?, CudaStorage::alloc(&dev, c)?);
        launch::batch_norm_train_forward(
            &dev,
            x.cuda_f32(OP)?,
            Affine { weight: buffer(&w, OP)?, bias: buffer(&b, OP)? },
            dims,
            RunningStats { mean: owned_f32_mut(running.mean, OP)?, var: owned_f32_mut(running.var, OP)? },
            y.f32_buffer_mut(OP)?,
            BatchStats { mean: mean.f32_buffer_mut(OP)?, rstd: rstd.f32_buffer_mut(OP)? },
        )?;
        Ok(BatchNormOutput {
            y: Tensor::from_cuda(y, x.shape())?,
            mean: Tensor::from_cuda(mean, &[c])?,
            rstd: Tensor::from_cuda(rstd, &[c])?,
        })
    }

    /// Evaluation forward with the running statistics (`dims` checked by the caller).
    pub(crate) fn eval(
        x: &Tensor,
        dims: &BatchNormDims,
        affine: Affine<'_, Tensor>,
        running: RunningStats<&Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "batch_norm_eval";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        let [w, b] = dense_all([affine.weight, affine.bias])?;
        let (rm, rv) = (running.mean.dense()?, running.var.dense()?);
        let running = RunningStats { mean: rm.cuda_f32(OP)?, var: rv.cuda_f32(OP)? };
        output(&dev, OP, x.shape(), |y| {
            let affine = Affine { weight: buffer(&w, OP)?, bias: buffer(&b, OP)? };
            Ok(launch::batch_norm_eval_forward(&dev, x.cuda_f32(OP)?, affine, dims, running, y)?)
        })
    }

    /// Fresh `[C]` gradients for the weight (when there is one) and the bias (when asked),
    /// for a backward launcher to write.
    fn per_channel_grads(
        dev: &Arc<kernels::cuda::CudaDevice>,
        c: usize,
        weight: bool,
        bias: bool,
    ) -> Result<[Option<CudaStorage>; 2]> {
        let fresh = |need: bool| need.then(|| CudaStorage::alloc(dev, c)).transpose();
        Ok([fresh(weight)?, fresh(bias)?])
    }

    /// The f32 buffer of an optional gradient storage, for writing.
    fn grad_mut<'s>(s: &'s mut Option<CudaStorage>, op: &'static str) -> Result<Option<&'s mut DeviceBuffer<f32>>> {
        s.as_mut().map(|s| s.f32_buffer_mut(op)).transpose()
    }

    /// `[dx, dweight?, dbias?]` as [`BatchNormGrads`].
    fn grads(dx: Tensor, [dw, db]: [Option<CudaStorage>; 2], c: usize) -> Result<BatchNormGrads> {
        Ok(BatchNormGrads {
            x: dx,
            weight: dw.map(|s| Tensor::from_cuda(s, &[c])).transpose()?,
            bias: db.map(|s| Tensor::from_cuda(s, &[c])).transpose()?,
        })
    }

    /// Training backward from the saved batch statistics (`dims` checked by the caller).
    pub(crate) fn train_backward(
        x: &Tensor,
        dims: &BatchNormDims,
        weight: Option<&Tensor>,
        stats: BatchStats<&Tensor>,
        dy: &Tensor,
        bias: bool,
    ) -> Result<BatchNormGrads> {
        const OP: &str = "batch_norm_train_backward";
        let dev = x.cuda_device(OP)?;
        let c = dims.channels;
        let (x, dy, mean, rstd) = (x.dense()?, dy.dense()?, stats.mean.dense()?, stats.rstd.dense()?);
        let [w] = dense_all([weight])?;
        let mut dx = CudaStorage::alloc(&dev, x.numel())?;
        let mut per_channel = per_channel_grads(&dev, c, w.is_some(), bias)?;
        {
            let [dw, db] = &mut per_channel;
            launch::batch_norm_train_backward(
                &dev,
                x.cuda_f32(OP)?,
                buffer(&w, OP)?,
                BatchStats { mean: mean.cuda_f32(OP)?, rstd: rstd.cuda_f32(OP)? },
                dy.cuda_f32(OP)?,
                dims,
                NormGrads { dx: dx.f32_buffer_mut(OP)?, dweight: grad_mut(dw, OP)?, dbias: grad_mut(db, OP)? },
            )?;
        }
        grads(Tensor::from_cuda(dx, x.shape())?, per_channel, c)
    }

    /// Evaluation backward with the running statistics (`dims` checked by the caller; see
    /// the module doc).
    pub(crate) fn eval_backward(
        x: &Tensor,
        dims: &BatchNormDims,
        weight: Option<&Tensor>,
        running: RunningStats<&Tensor>,
        dy: &Tensor,
        bias: bool,
    ) -> Result<BatchNormGrads> {
        const OP: &str = "batch_norm_eval_backward";
        let dev = x.cuda_device(OP)?;
        let (c, eps) = (dims.channels, dims.eps);
        let (x, dy, rm, rv) = (x.dense()?, dy.dense()?, running.mean.dense()?, running.var.dense()?);
        let [w] = dense_all([weight])?;
        let (rm, rv) = (rm.cuda_f32(OP)?, rv.cuda_f32(OP)?);
        // d/dx = dy·weight/√(rv + eps): the evaluation forward of dy with mean 0 and no bias.
        let zero_mean = CudaStorage::zeros(&dev, c)?;
        let dx = output(&dev, OP, x.shape(), |dx| {
            let zero_mean = zero_mean.f32_buffer(OP)?;
            let affine = Affine { weight: buffer(&w, OP)?, bias: None };
            let running = RunningStats { mean: zero_mean, var: rv };
            Ok(launch::batch_norm_eval_forward(&dev, dy.cuda_f32(OP)?, affine, dims, running, dx)?)
        })?;
        let mut per_channel = per_channel_grads(&dev, c, w.is_some(), bias)?;
        if w.is_some() || bias {
            // d/dweight = Σ dy·(x − rm)·rstd, d/dbias = Σ dy: the training backward's sums at
            // mean rm and rstd = 1/√(rv + eps).
            let mut rstd = CudaStorage::alloc(&dev, c)?;
            let mut shifted = CudaStorage::alloc(&dev, c)?;
            scalar_forward(&dev, Binary::Add, rv, eps, shifted.f32_buffer_mut(OP)?)?;
            unary_forward(&dev, Unary::Rsqrt, shifted.f32_buffer(OP)?, rstd.f32_buffer_mut(OP)?)?;
            let mut scratch = CudaStorage::alloc(&dev, x.numel())?;
            let [dw, db] = &mut per_channel;
            launch::batch_norm_train_backward(
                &dev,
                x.cuda_f32(OP)?,
                None,
                BatchStats { mean: rm, rstd: rstd.f32_buffer(OP)? },
                dy.cuda_f32(OP)?,
                dims,
                NormGrads { dx: scratch.f32_buffer_mut(OP)?, dweight: grad_mut(dw, OP)?, dbias: grad_mut(db, OP)? },
            )?;
        }
        grads(dx, per_channel, c)
    }
}
