//! Image ops on `[N, C, H, W]` tensors: 2-D convolution, max pooling, global average
//! pooling and batch normalisation (training and evaluation forms). Each checks shapes and
//! returns an error naming the op and the shapes, then dispatches to `kernels::cpu`.
//!
//! Legend: `N` batch, `C` input channels, `O` output channels, `H, W` input size, `KH, KW`
//! kernel size, `S = H·W` one plane. PyTorch equivalents: `F.conv2d` (groups 1, dilation 1),
//! `F.max_pool2d` (floor mode), `F.adaptive_avg_pool2d(x, 1).flatten(1)`, `F.batch_norm`.
//! What each op returns beside its output (pooling winners, batch statistics) is exactly
//! what its backward in `autograd` reads. No autograd here.

use kernels::cpu::batchnorm::{batch_norm_eval_forward, batch_norm_train_forward};
use kernels::cpu::conv::{conv2d_forward, Conv2dGeometry};
use kernels::cpu::pool::{global_avg_pool_forward, max_pool2d_forward, max_pool2d_output_size};

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::batch_norm_train`]: `y` and the per-channel batch mean and
/// `1/√(var + eps)` that the backward reads.
pub struct BatchNormOutput {
    pub y: Tensor,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

impl Tensor {
    /// `[N, C, H, W]` of a rank-4 tensor, or an error naming `op`.
    pub fn dims_nchw(&self, op: &'static str) -> Result<[usize; 4]> {
        match self.shape.as_slice() {
            &[n, c, h, w] => Ok([n, c, h, w]),
            _ => Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "expected [N, C, H, W]".into() }),
        }
    }

    /// The geometry of `conv2d(self, weight, stride, padding)`: `self` is `x[N, C, H, W]`,
    /// `weight` is `w[O, C, KH, KW]`. Errors on a channel mismatch, a zero stride, or a
    /// kernel larger than the padded input.
    pub fn conv2d_geometry(&self, weight: &Tensor, stride: usize, padding: usize) -> Result<Conv2dGeometry> {
        let op = "conv2d";
        let [batch, in_channels, height, width] = self.dims_nchw(op)?;
        let [out_channels, w_channels, kernel_h, kernel_w] = weight.dims_nchw(op)?;
        if w_channels != in_channels {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: weight.shape.clone() });
        }
        let g = Conv2dGeometry { batch, in_channels, out_channels, height, width, kernel_h, kernel_w, stride, padding };
        if stride == 0 || g.out_height() == 0 || g.out_width() == 0 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: format!(
                    "kernel {kernel_h}×{kernel_w} with stride {stride} and padding {padding} leaves no output \
                     (stride must be ≥ 1 and the kernel no larger than the padded input)"
                ),
            });
        }
        Ok(g)
    }

    /// `y[N, O, OH, OW] = conv(x[N, C, H, W], w[O, C, KH, KW]) (+ bias[O])` with the same
    /// stride and zero padding along both axes (PyTorch `F.conv2d`).
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, stride: usize, padding: usize) -> Result<Tensor> {
        self.require_cpu("conv2d")?;
        let g = self.conv2d_geometry(weight, stride, padding)?;
        if let Some(b) = bias {
            if b.shape != [g.out_channels] {
                return Err(Error::ShapeMismatch {
                    op: "conv2d (bias)",
                    lhs: weight.shape.clone(),
                    rhs: b.shape.clone(),
                });
            }
        }
        let (x, w) = (self.contiguous()?, weight.contiguous()?);
        let b = bias.map(Tensor::contiguous).transpose()?;
        let (out_h, out_w) = (g.out_height(), g.out_width());
        let mut y = vec![0.0; g.batch * g.out_channels * out_h * out_w];
        conv2d_forward(&g, x.as_slice()?, w.as_slice()?, b.as_ref().map(Tensor::as_slice).transpose()?, &mut y);
        Tensor::from_vec(y, &[g.batch, g.out_channels, out_h, out_w])
    }

    /// Max pooling with a square `kernel`, `stride` and −∞ `padding` (PyTorch
    /// `F.max_pool2d`, floor mode). Returns `y[N, C, OH, OW]` and, per output, the index of
    /// the winning input within its `H·W` plane (what backward scatters to).
    pub fn max_pool2d(&self, kernel: usize, stride: usize, padding: usize) -> Result<(Tensor, Vec<usize>)> {
        let op = "max_pool2d";
        self.require_cpu(op)?;
        let [n, c, h, w] = self.dims_nchw(op)?;
        let (out_h, out_w) =
            (max_pool2d_output_size(h, kernel, stride, padding), max_pool2d_output_size(w, kernel, stride, padding));
        if kernel == 0 || stride == 0 || padding > kernel / 2 || out_h == 0 || out_w == 0 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: format!(
                    "kernel {kernel}, stride {stride}, padding {padding}: needs kernel, stride ≥ 1, \
                     padding ≤ kernel/2 and a kernel no larger than the padded input"
                ),
            });
        }
        let x = self.contiguous()?;
        let mut y = vec![0.0; n * c * out_h * out_w];
        let mut argmax = vec![0; y.len()];
        max_pool2d_forward(x.as_slice()?, n, c, h, w, kernel, stride, padding, &mut y, &mut argmax);
        Ok((Tensor::from_vec(y, &[n, c, out_h, out_w])?, argmax))
    }

    /// `y[N, C] = mean over H·W of x[N, C, H, W]` (the ResNet head's pooling).
    pub fn global_avg_pool(&self) -> Result<Tensor> {
        let op = "global_avg_pool";
        self.require_cpu(op)?;
        let [n, c, h, w] = self.dims_nchw(op)?;
        if h * w == 0 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "empty planes have no mean".into(),
            });
        }
        let x = self.contiguous()?;
        let mut y = vec![0.0; n * c];
        global_avg_pool_forward(x.as_slice()?, n, c, h * w, &mut y);
        Tensor::from_vec(y, &[n, c])
    }

    /// Checks `x[N, C, H, W]` against per-channel `[C]` tensors (weight, bias, running
    /// statistics) and returns `(N, C, S)`.
    fn batch_norm_dims(&self, op: &'static str, per_channel: &[Option<&Tensor>]) -> Result<(usize, usize, usize)> {
        self.require_cpu(op)?;
        let [n, c, h, w] = self.dims_nchw(op)?;
        for t in per_channel.iter().flatten() {
            if t.shape != [c] {
                return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: t.shape.clone() });
            }
        }
        Ok((n, c, h * w))
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
        let (n, c, s) = self.batch_norm_dims(op, &[weight, bias, Some(running_mean), Some(running_var)])?;
        if n * s < 2 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "training needs more than one value per channel".into(),
            });
        }
        let x = self.contiguous()?;
        let (w, b) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.numel()], vec![0.0; c], vec![0.0; c]);
        batch_norm_train_forward(
            x.as_slice()?,
            n,
            c,
            s,
            w.as_ref().map(Tensor::as_slice).transpose()?,
            b.as_ref().map(Tensor::as_slice).transpose()?,
            eps,
            momentum,
            running_mean.as_mut_slice()?,
            running_var.as_mut_slice()?,
            &mut y,
            &mut mean,
            &mut rstd,
        );
        Ok(BatchNormOutput { y: Tensor::from_vec(y, &self.shape)?, mean, rstd })
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
        let (n, c, s) = self.batch_norm_dims(op, &[weight, bias, Some(running_mean), Some(running_var)])?;
        let x = self.contiguous()?;
        let (w, b) = (weight.map(Tensor::contiguous).transpose()?, bias.map(Tensor::contiguous).transpose()?);
        let (rm, rv) = (running_mean.contiguous()?, running_var.contiguous()?);
        let mut y = vec![0.0; x.numel()];
        batch_norm_eval_forward(
            x.as_slice()?,
            n,
            c,
            s,
            w.as_ref().map(Tensor::as_slice).transpose()?,
            b.as_ref().map(Tensor::as_slice).transpose()?,
            eps,
            rm.as_slice()?,
            rv.as_slice()?,
            &mut y,
        );
        Tensor::from_vec(y, &self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_name_the_op_and_shapes() {
        let x = Tensor::zeros(&[2, 3, 5, 5]);
        let msg = x.conv2d(&Tensor::zeros(&[4, 2, 3, 3]), None, 1, 1).unwrap_err().to_string();
        assert!(msg.contains("conv2d") && msg.contains("[2, 3, 5, 5]") && msg.contains("[4, 2, 3, 3]"), "{msg}");
        assert!(x.conv2d(&Tensor::zeros(&[4, 3, 7, 7]), None, 1, 0).is_err());
        assert!(x.conv2d(&Tensor::zeros(&[4, 3, 3, 3]), Some(&Tensor::zeros(&[3])), 1, 1).is_err());
        assert!(x.max_pool2d(3, 2, 2).is_err());
        assert!(Tensor::zeros(&[2, 3, 5]).global_avg_pool().is_err());
        let (mut rm, mut rv) = (Tensor::zeros(&[3]), Tensor::ones(&[3]));
        assert!(x.batch_norm_train(Some(&Tensor::ones(&[4])), None, &mut rm, &mut rv, 0.1, 1e-5).is_err());
        assert!(Tensor::zeros(&[1, 3, 1, 1]).batch_norm_train(None, None, &mut rm, &mut rv, 0.1, 1e-5).is_err());
    }

    #[test]
    fn conv_output_shapes_follow_pytorch() {
        let x = Tensor::ones(&[2, 3, 32, 32]);
        let w = Tensor::ones(&[8, 3, 7, 7]);
        assert_eq!(x.conv2d(&w, None, 2, 3).unwrap().shape(), [2, 8, 16, 16]);
        let (y, arg) = Tensor::ones(&[2, 8, 16, 16]).max_pool2d(3, 2, 1).unwrap();
        assert_eq!((y.shape(), arg.len()), (&[2, 8, 8, 8][..], 2 * 8 * 64));
        assert_eq!(Tensor::ones(&[2, 8, 4, 4]).global_avg_pool().unwrap().shape(), [2, 8]);
    }

    #[test]
    fn batch_norm_train_normalises_and_updates_running_stats() {
        let x = Tensor::from_vec((0..16).map(|i| i as f32).collect(), &[2, 2, 2, 2]).unwrap();
        let (mut rm, mut rv) = (Tensor::zeros(&[2]), Tensor::ones(&[2]));
        let out = x.batch_norm_train(None, None, &mut rm, &mut rv, 0.5, 0.0).unwrap();
        // Channel 0 holds 0..4 and 8..12: mean 5.5.
        assert!((out.mean[0] - 5.5).abs() < 1e-6);
        assert!((rm.to_vec()[0] - 2.75).abs() < 1e-6);
        let y = out.y.to_vec();
        let channel0: f32 = y[..4].iter().chain(&y[8..12]).sum();
        assert!(channel0.abs() < 1e-5);
        let eval = x.batch_norm_eval(None, None, &Tensor::zeros(&[2]), &Tensor::ones(&[2]), 0.0).unwrap();
        assert!(eval.all_close(&x, 1e-6, 1e-6));
    }
}
