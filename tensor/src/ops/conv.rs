//! Image ops on `[N, C, H, W]` tensors: 2-D convolution (forward and backward), max
//! pooling and global average pooling (batch normalisation is in `batch_norm.rs`). Each
//! checks shapes and devices and returns an error naming the op and the shapes, then
//! dispatches to `kernels::cpu` (the convolution also to `kernels::cuda` on a GPU; the
//! pools are CPU-only for now).
//!
//! Legend: `N` batch, `C` input channels, `O` output channels, `H, W` input size, `KH, KW`
//! kernel size, `S = H·W` one plane. PyTorch equivalents: `F.conv2d` (groups 1, dilation 1),
//! `F.max_pool2d` (floor mode), `F.adaptive_avg_pool2d(x, 1).flatten(1)`. What each op
//! returns beside its output (pooling winners) is exactly what its backward in `autograd`
//! reads. No autograd here.

use kernels::cpu::conv::{conv2d_backward, conv2d_forward, Conv2dGeometry};
use kernels::cpu::pool::{global_avg_pool_forward, max_pool2d_forward, max_pool2d_output_size};

use crate::{Error, Result, Tensor};

/// Gradients of [`Tensor::conv2d`] from [`Tensor::conv2d_backward`]; each is `None` when it
/// was not asked for.
pub struct Conv2dGrads {
    /// `d/dx`, shaped like the input.
    pub x: Option<Tensor>,
    /// `d/dweight`, shaped like the weight.
    pub weight: Option<Tensor>,
    /// `d/dbias`, `[O]`.
    pub bias: Option<Tensor>,
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
        self.same_device("conv2d", weight)?;
        let g = self.conv2d_geometry(weight, stride, padding)?;
        if let Some(b) = bias {
            self.same_device("conv2d", b)?;
            if b.shape != [g.out_channels] {
                return Err(Error::ShapeMismatch {
                    op: "conv2d (bias)",
                    lhs: weight.shape.clone(),
                    rhs: b.shape.clone(),
                });
            }
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::conv::conv2d(&g, self, weight, bias);
        }
        let (x, w) = (self.contiguous()?, weight.contiguous()?);
        let b = bias.map(Tensor::contiguous).transpose()?;
        let (out_h, out_w) = (g.out_height(), g.out_width());
        let mut y = vec![0.0; g.batch * g.out_channels * out_h * out_w];
        conv2d_forward(&g, x.as_slice()?, w.as_slice()?, b.as_ref().map(Tensor::as_slice).transpose()?, &mut y);
        Tensor::from_vec(y, &[g.batch, g.out_channels, out_h, out_w])
    }

    /// The backward of [`Tensor::conv2d`] for the output gradient `dy[N, O, OH, OW]`,
    /// computing only the gradients flagged in `needs` (`[x, weight, bias]`): the first
    /// convolution of a network, reading the images, skips `dx` entirely.
    /// `d/dx = col2im(wᵀ·dy)`, `d/dw = Σ_n dy_n·col_nᵀ`, `d/dbias = Σ_{n,p} dy`.
    pub fn conv2d_backward(
        x: &Tensor,
        weight: &Tensor,
        dy: &Tensor,
        stride: usize,
        padding: usize,
        needs: [bool; 3],
    ) -> Result<Conv2dGrads> {
        const OP: &str = "conv2d_backward";
        x.same_device(OP, weight)?;
        x.same_device(OP, dy)?;
        let g = x.conv2d_geometry(weight, stride, padding)?;
        let y_shape = [g.batch, g.out_channels, g.out_height(), g.out_width()];
        if dy.shape != y_shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: y_shape.to_vec(), rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return crate::cuda::conv::conv2d_backward(&g, x, weight, dy, needs);
        }
        let (x, w, dy) = (x.contiguous()?, weight.contiguous()?, dy.contiguous()?);
        let mut dx = needs[0].then(|| crate::pool::zeros(x.numel()));
        let mut dw = needs[1].then(|| crate::pool::zeros(w.numel()));
        let mut db = needs[2].then(|| crate::pool::zeros(g.out_channels));
        conv2d_backward(
            &g,
            x.as_slice()?,
            w.as_slice()?,
            dy.as_slice()?,
            dx.as_deref_mut(),
            dw.as_deref_mut(),
            db.as_deref_mut(),
        );
        Ok(Conv2dGrads {
            x: dx.map(|d| Tensor::from_vec(d, &x.shape)).transpose()?,
            weight: dw.map(|d| Tensor::from_vec(d, &w.shape)).transpose()?,
            bias: db.map(|d| Tensor::from_vec(d, &[g.out_channels])).transpose()?,
        })
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
}
