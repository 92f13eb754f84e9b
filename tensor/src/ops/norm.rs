//! RMSNorm (LLaMA) and LayerNorm over the last axis, each returning the row statistics its
//! backward needs. Kernels: `kernels::cpu::norm` (`kernels::cuda::norm` on the GPU).

use kernels::cpu::norm;

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::rms_norm`]: `y` and the per-row `1/rms` (`[rows]`, on `y`'s device)
/// saved for backward.
pub struct RmsNormOutput {
    /// The normalised, scaled output (the input's shape).
    pub y: Tensor,
    /// `1/√(mean(x²) + eps)` of every row, `[rows]`.
    pub rstd: Tensor,
}

/// Output of [`Tensor::layer_norm`]: `y`, per-row mean and `1/std` (each `[rows]`, on
/// `y`'s device) saved for backward.
pub struct LayerNormOutput {
    /// The normalised (and affine-transformed) output (the input's shape).
    pub y: Tensor,
    /// The mean of every row, `[rows]`.
    pub mean: Tensor,
    /// `1/√(var + eps)` of every row, `[rows]`.
    pub rstd: Tensor,
}

impl Tensor {
    /// Errors unless `weight` (when given) is `[cols]` on this tensor's device.
    fn check_weight(&self, op: &'static str, weight: Option<&Tensor>, cols: usize) -> Result<()> {
        match weight {
            Some(w) if w.shape != [cols] => {
                Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: w.shape.clone() })
            }
            Some(w) => self.same_device(op, w),
            None => Ok(()),
        }
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) · weight` (LLaMA's norm).
    pub fn rms_norm(&self, weight: &Tensor, eps: f32) -> Result<RmsNormOutput> {
        let cols = self.last_dim("rms_norm")?;
        self.check_weight("rms_norm", Some(weight), cols)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::rms_norm(self, weight, cols, eps);
        }
        let (_, x) = self.rows("rms_norm")?;
        let rows = x.numel() / cols.max(1);
        let mut y = crate::pool::buffer(x.numel());
        let mut rstd = vec![0.0; rows];
        norm::rms_norm_forward(x.as_slice()?, weight.contiguous()?.as_slice()?, cols, eps, &mut y, &mut rstd);
        Ok(RmsNormOutput { y: Tensor::from_vec(y, &self.shape)?, rstd: Tensor::from_vec(rstd, &[rows])? })
    }

    /// `(dx, dweight)` of [`Tensor::rms_norm`] from its input, weight and saved `rstd`:
    /// `dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy))`, `dweight = Σ_rows dy⊙x̂`, with `x̂ = x·rstd`.
    pub fn rms_norm_backward(x: &Tensor, weight: &Tensor, rstd: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let cols = x.last_dim(OP)?;
        x.check_weight(OP, Some(weight), cols)?;
        x.check_like(OP, dy)?;
        x.check_row_stats(OP, rstd, x.numel() / cols.max(1))?;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::rms_norm_backward(x, weight, rstd, dy, cols);
        }
        let (_, x) = x.rows(OP)?;
        let (w, rstd) = (weight.contiguous()?, rstd.contiguous()?);
        let (mut dx, mut dw) = (crate::pool::buffer(x.numel()), crate::pool::buffer(cols));
        norm::rms_norm_backward(
            x.as_slice()?,
            w.as_slice()?,
            rstd.as_slice()?,
            dy.contiguous()?.as_slice()?,
            cols,
            &mut dx,
            &mut dw,
        );
        Ok((Tensor::from_vec(dx, &x.shape)?, Tensor::from_vec(dw, &w.shape)?))
    }

    /// LayerNorm over the last axis, with optional affine weight and bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<LayerNormOutput> {
        let cols = self.last_dim("layer_norm")?;
        self.check_weight("layer_norm", weight, cols)?;
        self.check_weight("layer_norm", bias, cols)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::layer_norm(self, weight, bias, cols, eps);
        }
        let (_, x) = self.rows("layer_norm")?;
        let rows = x.numel() / cols.max(1);
        let (mut y, mut mean, mut rstd) = (crate::pool::buffer(x.numel()), vec![0.0; rows], vec![0.0; rows]);
        let weight = weight.map(|w| w.contiguous()).transpose()?;
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        norm::layer_norm_forward(
            x.as_slice()?,
            weight.as_ref().map(|w| w.as_slice()).transpose()?,
            bias.as_ref().map(|b| b.as_slice()).transpose()?,
            cols,
            eps,
            &mut y,
            &mut mean,
            &mut rstd,
        );
        Ok(LayerNormOutput {
            y: Tensor::from_vec(y, &self.shape)?,
            mean: Tensor::from_vec(mean, &[rows])?,
            rstd: Tensor::from_vec(rstd, &[rows])?,
        })
    }

    /// `(dx, dweight, dbias)` of [`Tensor::layer_norm`] from its input, optional weight and
    /// saved `mean`/`rstd`; `dweight` is computed when `weight` is given, `dbias` when
    /// `with_bias`. With `g = dy⊙w`: `dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂))`,
    /// `dweight = Σ_rows dy⊙x̂`, `dbias = Σ_rows dy`.
    pub fn layer_norm_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        with_bias: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "layer_norm_backward";
        let cols = x.last_dim(OP)?;
        let rows = x.numel() / cols.max(1);
        x.check_weight(OP, weight, cols)?;
        x.check_like(OP, dy)?;
        x.check_row_stats(OP, mean, rows)?;
        x.check_row_stats(OP, rstd, rows)?;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::layer_norm_backward(x, weight, mean, rstd, dy, cols, with_bias);
        }
        let (_, x) = x.rows(OP)?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let (mean, rstd) = (mean.contiguous()?, rstd.contiguous()?);
        let mut dx = crate::pool::buffer(x.numel());
        let mut dw = w.as_ref().map(|_| crate::pool::buffer(cols));
        let mut db = with_bias.then(|| crate::pool::buffer(cols));
        norm::layer_norm_backward(
            x.as_slice()?,
            w.as_ref().map(|w| w.as_slice()).transpose()?,
            mean.as_slice()?,
            rstd.as_slice()?,
            dy.contiguous()?.as_slice()?,
            cols,
            &mut dx,
            dw.as_deref_mut(),
            db.as_deref_mut(),
        );
        let column = |g: Vec<f32>| Tensor::from_vec(g, &[cols]);
        Ok((Tensor::from_vec(dx, &x.shape)?, dw.map(column).transpose()?, db.map(column).transpose()?))
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of RMSNorm and LayerNorm in `ops/norm.rs`: forwards that keep their
    //! per-row statistics on the device, and backwards that write fresh gradients.

    use kernels::cuda::norm as launch;

    use super::{LayerNormOutput, RmsNormOutput};
    use crate::cuda::{output, CudaStorage};
    use crate::{Result, Tensor};

    /// Rows of `cols` in `x` (none when `cols` is 0).
    fn rows(x: &Tensor, cols: usize) -> usize {
        x.numel() / cols.max(1)
    }

    /// RMSNorm of `x` (rows of `cols`) with `weight [cols]`; `rstd` saved per row.
    pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, cols: usize, eps: f32) -> Result<RmsNormOutput> {
        const OP: &str = "rms_norm";
        let dev = x.cuda_device(OP)?;
        let (x, w) = (x.dense()?, weight.dense()?);
        let rows = rows(&x, cols);
        let mut rstd = CudaStorage::alloc(&dev, rows)?;
        let y = output(&dev, OP, x.shape(), |y| {
            Ok(launch::rms_norm_forward(
                &dev,
                x.cuda_f32(OP)?,
                w.cuda_f32(OP)?,
                cols,
                eps,
                y,
                rstd.f32_buffer_mut(OP)?,
            )?)
        })?;
        Ok(RmsNormOutput { y, rstd: Tensor::from_cuda(rstd, &[rows])? })
    }

    /// `(dx, dweight)` of RMSNorm from the saved `rstd`.
    pub(crate) fn rms_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        cols: usize,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let dev = x.cuda_device(OP)?;
        let (x, w, rstd, dy) = (x.dense()?, weight.dense()?, rstd.dense()?, dy.dense()?);
        let mut dw = CudaStorage::alloc(&dev, cols)?;
        let dx = output(&dev, OP, x.shape(), |dx| {
            let (x, w, rstd, dy) = (x.cuda_f32(OP)?, w.cuda_f32(OP)?, rstd.cuda_f32(OP)?, dy.cuda_f32(OP)?);
            Ok(launch::rms_norm_backward(&dev, x, w, rstd, dy, cols, dx, dw.f32_buffer_mut(OP)?)?)
        })?;
        Ok((dx, Tensor::from_cuda(dw, &[cols])?))
    }

    /// LayerNorm of `x` (rows of `cols`) with optional `weight`/`bias [cols]`; `mean` and
    /// `rstd` saved per row.
    pub(crate) fn layer_norm(
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        cols: usize,
        eps: f32,
    ) -> Result<LayerNormOutput> {
        const OP: &str = "layer_norm";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        let w = weight.map(Tensor::dense).transpose()?;
        let b = bias.map(Tensor::dense).transpose()?;
        let rows = rows(&x, cols);
        let (mut mean, mut rstd) = (CudaStorage::alloc(&dev, rows)?, CudaStorage::alloc(&dev, rows)?);
        let y = output(&dev, OP, x.shape(), |y| {
            let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
            let b = b.as_ref().map(|b| b.cuda_f32(OP)).transpose()?;
            let (mean, rstd) = (mean.f32_buffer_mut(OP)?, rstd.f32_buffer_mut(OP)?);
            Ok(launch::layer_norm_forward(&dev, x.cuda_f32(OP)?, w, b, cols, eps, y, mean, rstd)?)
        })?;
        Ok(LayerNormOutput { y, mean: Tensor::from_cuda(mean, &[rows])?, rstd: Tensor::from_cuda(rstd, &[rows])? })
    }

    /// `(dx, dweight, dbias)` of LayerNorm from the saved `mean` and `rstd`; `dweight` when
    /// `weight` is given, `dbias` when `with_bias`.
    pub(crate) fn layer_norm_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        cols: usize,
        with_bias: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "layer_norm_backward";
        let dev = x.cuda_device(OP)?;
        let (x, mean, rstd, dy) = (x.dense()?, mean.dense()?, rstd.dense()?, dy.dense()?);
        let w = weight.map(Tensor::dense).transpose()?;
        let mut dw = w.as_ref().map(|_| CudaStorage::alloc(&dev, cols)).transpose()?;
        let mut db = with_bias.then(|| CudaStorage::alloc(&dev, cols)).transpose()?;
        let dx = output(&dev, OP, x.shape(), |dx| {
            let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
            let dw = dw.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
            let db = db.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
            let (x, mean, rstd, dy) = (x.cuda_f32(OP)?, mean.cuda_f32(OP)?, rstd.cuda_f32(OP)?, dy.cuda_f32(OP)?);
            Ok(launch::layer_norm_backward(&dev, x, w, mean, rstd, dy, cols, dx, dw, db)?)
        })?;
        let column = |g: CudaStorage| Tensor::from_cuda(g, &[cols]);
        Ok((dx, dw.map(column).transpose()?, db.map(column).transpose()?))
    }
}
