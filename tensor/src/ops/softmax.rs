//! Softmax and log-softmax over the last axis, each with its backward from the saved
//! output. Kernels: `kernels::cpu::softmax` (`kernels::cuda::softmax` on the GPU).

use kernels::cpu::softmax;

use crate::{Result, Tensor};

impl Tensor {
    /// Softmax over the last axis.
    pub fn softmax(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::softmax(self, self.last_dim("softmax")?, false);
        }
        let (cols, x) = self.rows("softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// `dy · ∂softmax/∂x` from the forward's output `y`: `dx = y ⊙ (dy − Σ dy⊙y)` per row.
    pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        Tensor::softmax_family_backward("softmax_backward", y, dy, false)
    }

    /// Log-softmax over the last axis.
    pub fn log_softmax(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::softmax(self, self.last_dim("log_softmax")?, true);
        }
        let (cols, x) = self.rows("log_softmax")?;
        let mut y = crate::pool::buffer(x.numel());
        softmax::log_softmax_forward(x.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// `dy · ∂log_softmax/∂x` from the forward's output `y`: `dx = dy − exp(y)·Σ dy` per row.
    pub fn log_softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        Tensor::softmax_family_backward("log_softmax_backward", y, dy, true)
    }

    /// The backward of softmax (`log == false`) or log-softmax from the saved output.
    fn softmax_family_backward(op: &'static str, y: &Tensor, dy: &Tensor, log: bool) -> Result<Tensor> {
        y.check_like(op, dy)?;
        #[cfg(feature = "cuda")]
        if y.cuda_storage().is_some() {
            return cuda::softmax_backward(y, dy, y.last_dim(op)?, log);
        }
        let (cols, y) = y.rows(op)?;
        let mut dx = crate::pool::buffer(y.numel());
        let backward = if log { softmax::log_softmax_backward } else { softmax::softmax_backward };
        backward(y.as_slice()?, dy.contiguous()?.as_slice()?, cols, &mut dx);
        Tensor::from_vec(dx, &y.shape)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA half of softmax and log-softmax over the last axis, with their backward.

    use kernels::cuda::softmax as launch;

    use crate::cuda::output;
    use crate::{Result, Tensor};

    /// Softmax (or log-softmax when `log`) over rows of `cols`.
    pub(crate) fn softmax(x: &Tensor, cols: usize, log: bool) -> Result<Tensor> {
        const OP: &str = "softmax";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        output(&dev, OP, x.shape(), |y| {
            let x = x.cuda_f32(OP)?;
            let forward = if log { launch::log_softmax_forward } else { launch::softmax_forward };
            Ok(forward(&dev, x, cols, y)?)
        })
    }

    /// The backward of softmax (or log-softmax when `log`) from its saved output `y`.
    pub(crate) fn softmax_backward(y: &Tensor, dy: &Tensor, cols: usize, log: bool) -> Result<Tensor> {
        const OP: &str = "softmax_backward";
        let dev = y.cuda_device(OP)?;
        let (y, dy) = (y.dense()?, dy.dense()?);
        output(&dev, OP, y.shape(), |dx| {
            let backward = if log { launch::log_softmax_backward } else { launch::softmax_backward };
            Ok(backward(&dev, y.cuda_f32(OP)?, dy.cuda_f32(OP)?, cols, dx)?)
        })
    }
}
