//! The CUDA branch of the convolution in `ops/conv.rs`: im2col + cuBLAS through
//! `kernels::cuda::conv`, forward and backward.

use kernels::cuda::conv::{self as launch, Conv2dGeometry};

use super::{output, CudaStorage};
use crate::ops::Conv2dGrads;
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
    let zeros = |need: bool, len: usize| need.then(|| CudaStorage::zeros(&dev, len)).transpose();
    let mut dx = zeros(needs[0], x.numel())?;
    let mut dw = zeros(needs[1], w.numel())?;
    let mut db = zeros(needs[2], g.out_channels)?;
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
