//! Pooling over `[N, C, H, W]` planes: max pooling (the ImageNet stem's 3×3/2) and global
//! average pooling (the ResNet head).
//!
//! PyTorch equivalents: `F.max_pool2d(x, kernel, stride, padding)` and
//! `F.adaptive_avg_pool2d(x, 1).flatten(1)`. Max pooling saves only the winners' indices;
//! average pooling saves only the input shape. Gradients accumulate in the walk.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Max pooling with a square window: `y[N, C, OH, OW]`, padding counts as −∞.
    pub fn max_pool2d(&self, kernel: usize, stride: usize, padding: usize) -> Result<Var> {
        let x_shape = self.shape();
        let (y, argmax) = self.value_ref().max_pool2d(kernel, stride, padding)?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            // d/dx[n, c, argmax[n, c, o]] = dy[n, c, o]   (summed where windows share a winner)
            Ok(vec![Tensor::max_pool2d_backward(&x_shape, &argmax, dy, kernel, stride, padding)?])
        }))
    }

    /// `y[N, C]`: the mean of each `H×W` plane.
    pub fn global_avg_pool(&self) -> Result<Var> {
        let x_shape = self.shape();
        let y = self.value_ref().global_avg_pool()?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            // d/dx[n, c, s] = dy[n, c] / (H·W)
            Ok(vec![Tensor::global_avg_pool_backward(&x_shape, dy)?])
        }))
    }
}
