//! 2-D convolution of `[N, C, H, W]` tensors, forward and backward (pooling is in
//! `pool.rs`, batch normalisation in `batch_norm.rs`). Each checks shapes and devices and
//! returns an error naming the op and the shapes, then dispatches to `kernels::cpu`, or to
//! `kernels::cuda` for tensors on a GPU.
//!
//! Legend: `N` batch, `C` input channels, `O` output channels, `H, W` input size, `KH, KW`
//! kernel size. PyTorch equivalent: `F.conv2d` (groups 1, dilation 1). No autograd here.

use kernels::cpu::conv::{conv2d_backward, conv2d_forward, Conv2dGeometry};

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
            return cuda::conv2d(&g, self, weight, bias);
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
            return cuda::conv2d_backward(&g, x, weight, dy, needs);
        }
        let (x, w, dy) = (x.contiguous()?, weight.contiguous()?, dy.contiguous()?);
        let mut dx = needs[0].then(|| crate::pool::buffer(x.numel()));
        let mut dw = needs[1].then(|| crate::pool::buffer(w.numel()));
        let mut db = needs[2].then(|| crate::pool::buffer(g.out_channels));
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
    }

    #[test]
    fn conv_output_shapes_follow_pytorch() {
        let x = Tensor::ones(&[2, 3, 32, 32]);
        let w = Tensor::ones(&[8, 3, 7, 7]);
        assert_eq!(x.conv2d(&w, None, 2, 3).unwrap().shape(), [2, 8, 16, 16]);
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of the convolution in `ops/conv.rs`: im2col + cuBLAS through
    //! `kernels::cuda::conv`, forward and backward.

    use kernels::cuda::conv::{self as launch, Conv2dGeometry};

    use super::Conv2dGrads;
    use crate::cuda::{output, CudaStorage};
    use crate::{Result, Tensor};

    /// `y[N, O, OH, OW] = conv(x, w) (+ bias)` for a checked geometry `g`.
    pub(crate) fn conv2d(g: &Conv2dGeometry, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        const OP: &str = "conv2d";
        let dev = x.cuda_device(OP)?;
        let (x, w) = (x.dense()?, w.dense()?);
        let bias = bias.map(Tensor::dense).transpose()?;
        let bias = bias.as_ref().map(|b| b.cuda_f32(OP)).transpose()?;
        let shape = [g.batch, g.out_channels, g.out_height(), g.out_width()];
        // Every element is written: the bias fill or a β = 0 GEMM.
        output(&dev, OP, &shape, |y| Ok(launch::conv2d_forward(&dev, g, x.cuda_f32(OP)?, w.cuda_f32(OP)?, bias, y)?))
    }

    /// The gradients flagged in `needs` (`[x, weight, bias]`) for the output gradient `dy`.
    pub(crate) fn conv2d_backward(
        g: &Conv2dGeometry,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        needs: [bool; 3],
    ) -> Result<Conv2dGrads> {
        const OP: &str = "conv2d_backward";
        let dev = x.cuda_device(OP)?;
        let (x, w, dy) = (x.dense()?, w.dense()?, dy.dense()?);
        let fresh = |need: bool, len: usize| need.then(|| CudaStorage::alloc(&dev, len)).transpose();
        let mut dx = fresh(needs[0], x.numel())?;
        let mut dw = fresh(needs[1], w.numel())?;
        let mut db = fresh(needs[2], g.out_channels)?;
        launch::conv2d_backward(
            &dev,
            g,
            x.cuda_f32(OP)?,
            w.cuda_f32(OP)?,
            dy.cuda_f32(OP)?,
            dx.as_mut().map(|s| s.f32_buffer_mut(OP)).transpose()?,
            dw.as_mut().map(|s| s.f32_buffer_mut(OP)).transpose()?,
            db.as_mut().map(|s| s.f32_buffer_mut(OP)).transpose()?,
        )?;
        Ok(Conv2dGrads {
            x: dx.map(|s| Tensor::from_cuda(s, x.shape())).transpose()?,
            weight: dw.map(|s| Tensor::from_cuda(s, w.shape())).transpose()?,
            bias: db.map(|s| Tensor::from_cuda(s, &[g.out_channels])).transpose()?,
        })
    }
}
