//! RMSNorm (LLaMA) and LayerNorm over the last axis, each returning the row statistics its
//! backward needs. Kernels: `kernels::cpu::norm` (`kernels::cuda::norm` on the GPU).

use kernels::cpu::norm::{self, NormDims, NormGrads, RowStats};

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::rms_norm`]: `y` and the per-row `1/rms` (`[rows]`, on `y`'s device)
/// saved for backward.
pub struct RmsNormOutput {
    /// The normalised, scaled output (the input's shape).
    pub y: Tensor,
    /// `1/√(mean(x²) + eps)` of every row, `[rows]`.
    pub rstd: Tensor,
}

/// Output of [`Tensor::add_rms_norm`]: the residual stream `sum = x + delta`, its RMSNorm `y`
/// and the per-row `1/rms` of `sum` saved for backward.
pub struct AddRmsNormOutput {
    /// `x + delta` (the input's shape): the next residual stream.
    pub sum: Tensor,
    /// RMSNorm of `sum` (the input's shape).
    pub y: Tensor,
    /// `1/√(mean(sum²) + eps)` of every row, `[rows]`.
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
    pub(super) fn check_weight(&self, op: &'static str, weight: Option<&Tensor>, cols: usize) -> Result<()> {
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
        let dims = NormDims::of(self.numel(), cols, eps);
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::rms_norm(self, weight, &dims);
        }
        let (_, x) = self.rows("rms_norm")?;
        let mut y = crate::pool::buffer(x.numel());
        let mut rstd = vec![0.0; dims.rows];
        norm::rms_norm_forward(x.as_slice()?, weight.contiguous()?.as_slice()?, &dims, &mut y, &mut rstd);
        Ok(RmsNormOutput { y: Tensor::from_vec(y, &self.shape)?, rstd: Tensor::from_vec(rstd, &[dims.rows])? })
    }

    /// A pre-ln LLaMA block's residual add and the next RMSNorm in one pass: `sum = self +
    /// delta` (same shape, no broadcasting) and `sum / sqrt(mean(sum²) + eps) · weight`, bit
    /// for bit as [`Tensor::add`] then [`Tensor::rms_norm`]. The backward is
    /// [`Tensor::rms_norm_backward`] of `sum`.
    pub fn add_rms_norm(&self, delta: &Tensor, weight: &Tensor, eps: f32) -> Result<AddRmsNormOutput> {
        const OP: &str = "add_rms_norm";
        let cols = self.last_dim(OP)?;
        self.check_like(OP, delta)?;
        self.check_weight(OP, Some(weight), cols)?;
        let dims = NormDims::of(self.numel(), cols, eps);
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::add_rms_norm(self, delta, weight, &dims);
        }
        let ((_, x), (_, delta)) = (self.rows(OP)?, delta.rows(OP)?);
        let (mut sum, mut y) = (crate::pool::buffer(x.numel()), crate::pool::buffer(x.numel()));
        let mut rstd = vec![0.0; dims.rows];
        let w = weight.contiguous()?;
        norm::add_rms_norm_forward(
            x.as_slice()?,
            delta.as_slice()?,
            w.as_slice()?,
            &dims,
            (&mut sum, &mut y),
            &mut rstd,
        );
        Ok(AddRmsNormOutput {
            sum: Tensor::from_vec(sum, &self.shape)?,
            y: Tensor::from_vec(y, &self.shape)?,
            rstd: Tensor::from_vec(rstd, &[dims.rows])?,
        })
    }

    /// `(dx, dweight)` of [`Tensor::rms_norm`] from its input, weight and saved `rstd`:
    /// `dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy))`, `dweight = Σ_rows dy⊙x̂`, with `x̂ = x·rstd`.
    /// `residual`, when given, is the gradient already reaching `x` by another path (a pre-ln
    /// LLaMA block's residual stream, [`Tensor::add_rms_norm`]): `dx` is then `residual +` the
    /// above, added in the same pass. Under bf16 products on the GPU `dx` comes with its bf16
    /// copy either way (as the engine's in-place sum of gradients writes it): the projections'
    /// backward products read it next.
    pub fn rms_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let dims = x.rms_norm_backward_dims(OP, weight, rstd, dy, residual)?;
        let cols = dims.cols;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::rms_norm_backward(x, weight, rstd, (dy, residual), &dims);
        }
        let (_, x) = x.rows(OP)?;
        let (w, rstd) = (weight.contiguous()?, rstd.contiguous()?);
        let residual = residual.map(Tensor::contiguous).transpose()?;
        let (mut dx, mut dw) = (crate::pool::buffer(x.numel()), crate::pool::buffer(cols));
        norm::rms_norm_backward(
            x.as_slice()?,
            w.as_slice()?,
            rstd.as_slice()?,
            (dy.contiguous()?.as_slice()?, residual.as_ref().map(Tensor::as_slice).transpose()?),
            &dims,
            NormGrads { dx: &mut dx, dweight: Some(&mut dw), dbias: None },
        );
        Ok((Tensor::from_vec(dx, &x.shape)?, Tensor::from_vec(dw, &w.shape)?))
    }

    /// Checks the operands of RMSNorm's backward of `self` (its input, or the sum a residual
    /// add normalised) once, for either device's kernels: `weight [cols]`, `dy` and `residual`
    /// shaped like `self`, a saved `rstd` per row; returns the sizes.
    pub(super) fn rms_norm_backward_dims(
        &self,
        op: &'static str,
        weight: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<NormDims> {
        let cols = self.last_dim(op)?;
        self.check_weight(op, Some(weight), cols)?;
        self.check_like(op, dy)?;
        if let Some(residual) = residual {
            self.check_like(op, residual)?;
        }
        // Backward reads the saved rstd: eps is not used.
        let dims = NormDims::of(self.numel(), cols, 0.0);
        self.check_row_stats(op, rstd, dims.rows)?;
        Ok(dims)
    }

    /// LayerNorm over the last axis, with optional affine weight and bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<LayerNormOutput> {
        let cols = self.last_dim("layer_norm")?;
        self.check_weight("layer_norm", weight, cols)?;
        self.check_weight("layer_norm", bias, cols)?;
        let dims = NormDims::of(self.numel(), cols, eps);
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::layer_norm(self, weight, bias, &dims);
        }
        let (_, x) = self.rows("layer_norm")?;
        let rows = dims.rows;
        let (mut y, mut mean, mut rstd) = (crate::pool::buffer(x.numel()), vec![0.0; rows], vec![0.0; rows]);
        let weight = weight.map(|w| w.contiguous()).transpose()?;
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        norm::layer_norm_forward(
            x.as_slice()?,
            weight.as_ref().map(|w| w.as_slice()).transpose()?,
            bias.as_ref().map(|b| b.as_slice()).transpose()?,
            &dims,
            &mut y,
            RowStats { mean: &mut mean, rstd: &mut rstd },
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
        // Backward reads the saved rstd: eps is not used.
        let dims = NormDims::of(x.numel(), cols, 0.0);
        x.check_weight(OP, weight, cols)?;
        x.check_like(OP, dy)?;
        x.check_row_stats(OP, mean, dims.rows)?;
        x.check_row_stats(OP, rstd, dims.rows)?;
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::layer_norm_backward(x, weight, RowStats { mean, rstd }, dy, &dims, with_bias);
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
            RowStats { mean: mean.as_slice()?, rstd: rstd.as_slice()? },
            dy.contiguous()?.as_slice()?,
            &dims,
            NormGrads { dx: &mut dx, dweight: dw.as_deref_mut(), dbias: db.as_deref_mut() },
        );
        let column = |g: Vec<f32>| Tensor::from_vec(g, &[cols]);
        Ok((Tensor::from_vec(dx, &x.shape)?, dw.map(column).transpose()?, db.map(column).transpose()?))
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of RMSNorm and LayerNorm in `ops/norm.rs`: forwards that keep their
    //! per-row statistics on the device, and backwards that write fresh gradients.

    use kernels::cuda::norm::{self as launch, NormDims, NormGrads, RmsNormWeightPartials, RowStats};

    use super::{AddRmsNormOutput, LayerNormOutput, RmsNormOutput};
    use crate::cuda::{output, product_input_output, product_only_output, CudaStorage};
    use crate::{Result, Tensor};

    /// RMSNorm of `x` (`dims`) with `weight [cols]`; `rstd` saved per row.
    pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, dims: &NormDims) -> Result<RmsNormOutput> {
        const OP: &str = "rms_norm";
        let dev = x.cuda_device(OP)?;
        let (x, w) = (x.dense()?, weight.dense()?);
        let mut rstd = CudaStorage::alloc(&dev, dims.rows)?;
        // y feeds only the next products (attention, FFN, LM head): bf16 alone under bf16 products.
        let y = product_only_output(&dev, OP, x.shape(), |y| {
            let rstd = rstd.f32_buffer_mut(OP)?;
            Ok(launch::rms_norm_forward(&dev, x.cuda_f32(OP)?, w.cuda_f32(OP)?, dims, (y, None), rstd)?)
        })?;
        Ok(RmsNormOutput { y, rstd: Tensor::from_cuda(rstd, &[dims.rows])? })
    }

    /// The residual add `x + delta` and RMSNorm of the sum with `weight [cols]` in one launch;
    /// `rstd` saved per row.
    pub(crate) fn add_rms_norm(
        x: &Tensor,
        delta: &Tensor,
        weight: &Tensor,
        dims: &NormDims,
    ) -> Result<AddRmsNormOutput> {
        const OP: &str = "add_rms_norm";
        let dev = x.cuda_device(OP)?;
        let (x, delta, w) = (x.dense()?, delta.dense()?, weight.dense()?);
        let (mut sum, mut rstd) = (CudaStorage::alloc(&dev, dims.len())?, CudaStorage::alloc(&dev, dims.rows)?);
        // y feeds only the next products (attention, FFN): bf16 alone under bf16 products.
        let y = product_only_output(&dev, OP, x.shape(), |y| {
            // delta as held: bf16 alone from an output projection that stored it so.
            let inputs = (x.cuda_f32(OP)?, delta.cuda_values(OP)?);
            let (sum, rstd) = (sum.f32_buffer_mut(OP)?, rstd.f32_buffer_mut(OP)?);
            Ok(launch::add_rms_norm_forward(&dev, inputs, w.cuda_f32(OP)?, dims, (sum, y, None), rstd)?)
        })?;
        Ok(AddRmsNormOutput {
            sum: Tensor::from_cuda(sum, x.shape())?,
            y,
            rstd: Tensor::from_cuda(rstd, &[dims.rows])?,
        })
    }

    /// `(dx, dweight)` of RMSNorm from the saved `rstd`, `dx` with `residual` added when
    /// given, with its bf16 copy under bf16 products.
    pub(crate) fn rms_norm_backward(
        x: &Tensor,
        weight: &Tensor,
        rstd: &Tensor,
        grads_of: (&Tensor, Option<&Tensor>),
        dims: &NormDims,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let (dx, partials) = rms_norm_backward_partial(x, weight, rstd, grads_of, dims)?;
        let dev = x.cuda_device(OP)?;
        let mut dw = CudaStorage::alloc(&dev, dims.cols)?;
        partials.finish(&dev, dw.f32_buffer_mut(OP)?)?;
        Ok((dx, Tensor::from_cuda(dw, &[dims.cols])?))
    }

    /// [`rms_norm_backward`]'s `dx` (checked by the caller), with the weight gradient left as
    /// its partial sums for a later launch to finish (its own, or the fused gate's column
    /// sums). `dx` comes with its bf16 copy under bf16 products: the projections' backward
    /// products read it next (a sum of gradients in a residual stream, or the final norm's dx,
    /// the last block's output gradient); dy is read as held (bf16 alone from the bf16
    /// products that read y, under bf16 products).
    pub(crate) fn rms_norm_backward_partial(
        x: &Tensor,
        weight: &Tensor,
        rstd: &Tensor,
        (dy, residual): (&Tensor, Option<&Tensor>),
        dims: &NormDims,
    ) -> Result<(Tensor, RmsNormWeightPartials)> {
        const OP: &str = "rms_norm_backward";
        let dev = x.cuda_device(OP)?;
        let (x, w, rstd, dy) = (x.dense()?, weight.dense()?, rstd.dense()?, dy.dense()?);
        let residual = residual.map(Tensor::dense).transpose()?;
        let mut partials = None;
        let dx = product_input_output(&dev, OP, x.shape(), |dx, dx_bf16| {
            let (x, w, rstd, dy) = (x.cuda_f32(OP)?, w.cuda_f32(OP)?, rstd.cuda_f32(OP)?, dy.cuda_values(OP)?);
            let residual = residual.as_ref().map(|r| r.cuda_f32(OP)).transpose()?;
            let inputs = (x, w, rstd);
            partials = Some(launch::rms_norm_backward_partial(&dev, inputs, (dy, residual), dims, (dx, dx_bf16))?);
            Ok(())
        })?;
        Ok((dx, partials.expect("written by the launch")))
    }

    /// LayerNorm of `x` (`dims`) with optional `weight`/`bias [cols]`; `mean` and `rstd`
    /// saved per row.
    pub(crate) fn layer_norm(
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        dims: &NormDims,
    ) -> Result<LayerNormOutput> {
        const OP: &str = "layer_norm";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        let w = weight.map(Tensor::dense).transpose()?;
        let b = bias.map(Tensor::dense).transpose()?;
        let rows = dims.rows;
        let (mut mean, mut rstd) = (CudaStorage::alloc(&dev, rows)?, CudaStorage::alloc(&dev, rows)?);
        let y = output(&dev, OP, x.shape(), |y| {
            let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
            let b = b.as_ref().map(|b| b.cuda_f32(OP)).transpose()?;
            let stats = RowStats { mean: mean.f32_buffer_mut(OP)?, rstd: rstd.f32_buffer_mut(OP)? };
            Ok(launch::layer_norm_forward(&dev, x.cuda_f32(OP)?, w, b, dims, y, stats)?)
        })?;
        Ok(LayerNormOutput { y, mean: Tensor::from_cuda(mean, &[rows])?, rstd: Tensor::from_cuda(rstd, &[rows])? })
    }

    /// `(dx, dweight, dbias)` of LayerNorm from the saved `mean` and `rstd`; `dweight` when
    /// `weight` is given, `dbias` when `with_bias`.
    pub(crate) fn layer_norm_backward(
        x: &Tensor,
        weight: Option<&Tensor>,
        stats: RowStats<&Tensor>,
        dy: &Tensor,
        dims: &NormDims,
        with_bias: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "layer_norm_backward";
        let cols = dims.cols;
        let dev = x.cuda_device(OP)?;
        let (x, mean, rstd, dy) = (x.dense()?, stats.mean.dense()?, stats.rstd.dense()?, dy.dense()?);
        let w = weight.map(Tensor::dense).transpose()?;
        let mut dw = w.as_ref().map(|_| CudaStorage::alloc(&dev, cols)).transpose()?;
        let mut db = with_bias.then(|| CudaStorage::alloc(&dev, cols)).transpose()?;
        let dx = output(&dev, OP, x.shape(), |dx| {
            let w = w.as_ref().map(|w| w.cuda_f32(OP)).transpose()?;
            let dw = dw.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
            let db = db.as_mut().map(|g| g.f32_buffer_mut(OP)).transpose()?;
            let (x, dy) = (x.cuda_f32(OP)?, dy.cuda_f32(OP)?);
            let stats = RowStats { mean: mean.cuda_f32(OP)?, rstd: rstd.cuda_f32(OP)? };
            let grads = NormGrads { dx, dweight: dw, dbias: db };
            Ok(launch::layer_norm_backward(&dev, x, w, stats, dy, dims, grads)?)
        })?;
        let column = |g: CudaStorage| Tensor::from_cuda(g, &[cols]);
        Ok((dx, dw.map(column).transpose()?, db.map(column).transpose()?))
    }
}
