//! Pooling over `[N, C, H, W]` planes: max pooling (the ImageNet stem's 3×3/2) and global
//! average pooling (the ResNet head).
//!
//! PyTorch equivalents: `F.max_pool2d(x, kernel, stride, padding)` and
//! `F.adaptive_avg_pool2d(x, 1).flatten(1)`. Max pooling saves only the winners' indices;
//! average pooling saves only the input shape. Gradients accumulate in the walk.

use kernels::cpu::pool::{global_avg_pool_backward, max_pool2d_backward};
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Max pooling with a square window: `y[N, C, OH, OW]`, padding counts as −∞.
    pub fn max_pool2d(&self, kernel: usize, stride: usize, padding: usize) -> Result<Var> {
        let x_shape = self.shape();
        let (y, argmax) = self.value_ref().max_pool2d(kernel, stride, padding)?;
        let y_shape = y.shape().to_vec();
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            // Both shapes are [N, C, ·, ·]: the forward checked the rank.
            let (n, c, h, w) = (x_shape[0], x_shape[1], x_shape[2], x_shape[3]);
            let (out_h, out_w) = (y_shape[2], y_shape[3]);
            let mut dx = tensor::pool::zeros(x_shape.iter().product());
            // d/dx[n, c, argmax[n, c, o]] = dy[n, c, o]   (summed where windows share a winner)
            max_pool2d_backward(&argmax, dy.contiguous()?.as_slice()?, n, c, h, w, out_h, out_w, &mut dx);
            Ok(vec![Tensor::from_vec(dx, &x_shape)?])
        }))
    }

    /// `y[N, C]`: the mean of each `H×W` plane.
    pub fn global_avg_pool(&self) -> Result<Var> {
        let x_shape = self.shape();
        let y = self.value_ref().global_avg_pool()?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            let (n, c, spatial) = (x_shape[0], x_shape[1], x_shape[2] * x_shape[3]);
            let mut dx = tensor::pool::zeros(n * c * spatial);
            // d/dx[n, c, s] = dy[n, c] / (H·W)
            global_avg_pool_backward(dy.contiguous()?.as_slice()?, n, c, spatial, &mut dx);
            Ok(vec![Tensor::from_vec(dx, &x_shape)?])
        }))
    }
}
