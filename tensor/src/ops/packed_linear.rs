//! Several bias-free linear projections of one input as one product, forward and backward:
//! `y = x·[W_1; …; W_k]ᵀ`, `[..., Σ out_i]`, projection i's outputs in its own block of
//! columns (LLaMA's gate and up projections, whose SwiGLU reads the two halves of each row).
//! No autograd here: `autograd`'s `Var::packed_linear` wires these two functions into the graph.
//!
//! The point is the GPU under bf16 products: the GEMM reads the weights' shared packed bf16
//! copy (`CudaStorage::share_packed_bf16_copy`, which AdamW rewrites in place), so the forward
//! is one GEMM where the projections took k, and so are the input gradient
//! `dx = dy·[W_1; …; W_k]` and the weights' gradients `[dW_1; …; dW_k] = dyᵀ·x` (each weight's
//! gradient a view of its rows). Otherwise (the CPU, f32 products) the same values come from
//! the plain ops: one product of the weights stacked (a copy of the weights), the input
//! gradient summed projection by projection, and each weight's gradient its own product.

use crate::{with_last_dim, Error, Result, Tensor};

const OP: &str = "packed_linear";

/// How [`Tensor::packed_linear`] stores its output on a GPU under bf16 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductOutput {
    /// f32 values (for a consumer that reads f32).
    F32,
    /// Their bf16 rounding, from the GEMM's f32 sums, as autocast stores a product (for a
    /// consumer that reads bf16: SwiGLU over the halves, RoPE of the packed QKV product):
    /// half the bytes written, read and saved for the backward. Still f32 elsewhere (the
    /// CPU, f32 products).
    Bf16,
}

/// `(rows, in)` of `x: [..., in]` and the `out_i` of each `weights[i]: [out_i, in]`, checked.
fn dims(x: &Tensor, weights: &[&Tensor]) -> Result<(usize, usize, Vec<usize>)> {
    let d_in = x.shape().last().copied().unwrap_or(0);
    if weights.is_empty() || d_in == 0 {
        return Err(Error::InvalidShape {
            op: OP,
            shape: x.shape().to_vec(),
            reason: "needs at least one weight and an input width above 0".into(),
        });
    }
    let mut outs = Vec::with_capacity(weights.len());
    for w in weights {
        x.same_device(OP, w)?;
        match w.shape() {
            &[out, i] if i == d_in && out > 0 => outs.push(out),
            _ => return Err(Error::ShapeMismatch { op: OP, lhs: x.shape().to_vec(), rhs: w.shape().to_vec() }),
        }
    }
    Ok((x.numel() / d_in, d_in, outs))
}

impl Tensor {
    /// Whether [`Tensor::packed_linear`] of `self` is one GEMM of the packed weights (a GPU
    /// under bf16 products), which is what it is for: elsewhere it computes the same values
    /// with the plain ops, measured 3% slower than the projections one by one for llama-tiny
    /// on the CPU (the weights' copy, and SwiGLU over the halves row by row).
    pub fn packed_linear_is_one_product(&self) -> bool {
        #[cfg(feature = "cuda")]
        return cuda::uses_packed_product(self);
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// `self: [..., in]` projected by each of `weights` (`[out_i, in]`), the results side by
    /// side: `[..., Σ out_i]`, the same values as `cat([self·W_iᵀ], -1)` (rounded to bf16
    /// when `output` says so and the product is one GEMM).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn packed_linear(&self, weights: &[&Tensor], output: ProductOutput) -> Result<Tensor> {
        let (rows, d_in, outs) = dims(self, weights)?;
        let total: usize = outs.iter().sum();
        #[cfg(feature = "cuda")]
        if cuda::uses_packed_product(self) {
            let x = self.contiguous()?.reshape(&[rows, d_in])?;
            return cuda::forward(&x, weights, total, output)?.reshape(&with_last_dim(self.shape(), total));
        }

        // One product of the weights stacked as rows (a copy of the weights, not of the output).
        let stacked = Tensor::cat(weights, 0)?;
        self.reshape(&[rows, d_in])?.matmul(&stacked.transpose(0, 1)?)?.reshape(&with_last_dim(self.shape(), total))
    }

    /// The backward of [`Tensor::packed_linear`] of `x` for the output gradient `dy`:
    /// `[dx, dW_1, …, dW_k]`. With `dx_so_far` (the gradient `x` has from the other ops that
    /// read it), the first entry is that plus this product's `dx`, added by the GEMMs
    /// themselves (β = 1) when it is the only owner of its buffer.
    pub fn packed_linear_backward(
        x: &Tensor,
        weights: &[&Tensor],
        dy: &Tensor,
        dx_so_far: Option<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let (rows, d_in, outs) = dims(x, weights)?;
        let total: usize = outs.iter().sum();
        if dy.shape() != with_last_dim(x.shape(), total) {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: with_last_dim(x.shape(), total),
                rhs: dy.shape().to_vec(),
            });
        }
        let x_rows = x.reshape(&[rows, d_in])?;
        let dy_rows = dy.contiguous()?.reshape(&[rows, total])?;
        let so_far = dx_so_far.map(|so_far| so_far.reshape(&[rows, d_in])).transpose()?;
        #[cfg(feature = "cuda")]
        if cuda::uses_packed_product(x) {
            // dx = dy·[W_1; …; W_k]: one GEMM over the packed weight. [dW_1; …; dW_k] = dyᵀ·x:
            // one GEMM, each weight's gradient a view of its rows (the optimizer reads it in
            // place).
            let dx = cuda::input_grad(&dy_rows, weights, so_far)?;
            let stacked = dy_rows.transpose(0, 1)?.matmul(&x_rows)?;
            let mut grads = vec![dx.reshape(x.shape())?];
            grads.extend(runs(&stacked, 0, &outs)?);
            return Ok(grads);
        }
        let blocks = runs(&dy_rows, 1, &outs)?;
        let dx = summed_input_grad(&blocks, weights, so_far)?;
        let mut grads = vec![dx.reshape(x.shape())?];
        for block in &blocks {
            // dW_i = dy_iᵀ·x, in W's own layout; dy_i is read in place.
            grads.push(block.transpose(0, 1)?.matmul(&x_rows)?);
        }
        Ok(grads)
    }
}

/// `t`'s consecutive runs of `lengths` along `dim`, as views: projection i's block of a packed
/// product's columns, or of a stacked gradient's rows.
fn runs(t: &Tensor, dim: usize, lengths: &[usize]) -> Result<Vec<Tensor>> {
    let mut at = 0;
    lengths
        .iter()
        .map(|&len| {
            let run = t.narrow(dim, at, len);
            at += len;
            run
        })
        .collect()
}

/// `dx = so_far + Σ_i dy_i·W_i`, projection by projection (each added by its GEMM when it can).
fn summed_input_grad(blocks: &[Tensor], weights: &[&Tensor], so_far: Option<Tensor>) -> Result<Tensor> {
    let mut dx = so_far;
    for (block, w) in blocks.iter().zip(weights) {
        dx = Some(match dx {
            Some(sum) => sum.add_matmul(block, w)?,
            None => block.matmul(w)?,
        });
    }
    Ok(dx.expect("at least one weight (checked by dims)"))
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/packed_linear.rs` under bf16 products: one GEMM over the
    //! weights' packed bf16 copy for the output and one for the input gradient.

    use std::sync::Arc;

    use half::bf16;
    use kernels::cpu::matmul::{GemmDims, Store};
    use kernels::cuda::blas::{matmul_bf16, matmul_bf16_out, DeviceMat};
    use kernels::cuda::elementwise::pack_bf16;
    use kernels::cuda::{CudaDevice, DeviceBuffer, ValuesMut};

    use super::ProductOutput;
    use crate::cuda::{matmul_precision, output, CudaStorage, MatmulPrecision};
    use crate::{DType, Error, Result, Tensor};

    const OP: &str = "packed_linear";

    /// Whether `x`'s products take the packed path: a GPU tensor under bf16 products.
    pub(crate) fn uses_packed_product(x: &Tensor) -> bool {
        x.cuda_storage().is_some() && matmul_precision() == MatmulPrecision::Bf16
    }

    /// The packed bf16 `[W_1; …; W_k]` of `weights`: their shared bf16 copy when they have
    /// one, else packed now (one launch) and made their shared copy, which AdamW rewrites in
    /// place at each step (`CudaStorage::f32_buffer_mut_for_update`).
    fn packed_weight(dev: &CudaDevice, weights: &[&Tensor]) -> Result<Arc<DeviceBuffer<bf16>>> {
        let dense: Vec<Tensor> = weights.iter().map(|w| w.to_dtype(DType::F32)?.dense()).collect::<Result<_>>()?;
        let members: Vec<&CudaStorage> = dense.iter().map(storage_of).collect::<Result<_>>()?;
        if let Some(packed) = CudaStorage::shared_packed_bf16_copy(&members) {
            return Ok(packed);
        }
        let buffers: Vec<_> = dense.iter().map(|w| w.cuda_f32(OP)).collect::<Result<_>>()?;
        let packed = Arc::new(pack_bf16(dev, &buffers).map_err(|e| crate::cuda::cuda_error(OP, e))?);
        CudaStorage::share_packed_bf16_copy(&members, &packed);
        Ok(packed)
    }

    /// The device storage of a GPU tensor.
    fn storage_of(t: &Tensor) -> Result<&CudaStorage> {
        t.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: t.device })
    }

    /// The bf16 buffer of `t` as a dense bf16 tensor (its storage's copy when it keeps one).
    fn bf16_of(t: &Tensor) -> Result<Tensor> {
        t.to_dtype(DType::BF16)?.dense()
    }

    /// `x·[W_1; …; W_k]ᵀ` for `x: [rows, in]` (contiguous): `[rows, total]`, f32 or held as
    /// its bf16 rounding as `output` says.
    pub(crate) fn forward(x: &Tensor, weights: &[&Tensor], total: usize, output: ProductOutput) -> Result<Tensor> {
        let dev = x.cuda_device(OP)?;
        let (rows, d_in) = (x.shape()[0], x.shape()[1]);
        let packed = packed_weight(&dev, weights)?;
        let x_bf16 = bf16_of(x)?;
        let x_buffer = storage_of(&x_bf16)?.bf16_buffer(OP)?;
        let lhs = DeviceMat { buffer: x_buffer, offset: 0, row_stride: d_in, col_stride: 1 };
        // [W_1; …; W_k]ᵀ: element (i, j) is packed[j·in + i].
        let rhs = DeviceMat { buffer: &*packed, offset: 0, row_stride: 1, col_stride: d_in };
        let dims = GemmDims { m: rows, n: total, k: d_in };
        let mut out = CudaStorage::alloc_values(&dev, rows * total, output == ProductOutput::Bf16)?;
        match out.values_mut(OP)? {
            ValuesMut::F32(out) => matmul_bf16(&dev, out, 0, lhs, rhs, dims, Store::Overwrite),
            ValuesMut::Bf16(out) => matmul_bf16_out(&dev, out, lhs, rhs, dims),
        }
        .map_err(|e| crate::cuda::cuda_error(OP, e))?;
        Tensor::from_cuda(out, &[rows, total])
    }

    /// `so_far + dy·[W_1; …; W_k]` for `dy: [rows, total]` (contiguous): `[rows, in]`, added
    /// onto `so_far`'s buffer by the GEMM (β = 1) when this is its only owner; without
    /// `so_far`, in bf16 alone.
    pub(crate) fn input_grad(dy: &Tensor, weights: &[&Tensor], so_far: Option<Tensor>) -> Result<Tensor> {
        let dev = dy.cuda_device(OP)?;
        let (rows, total) = (dy.shape()[0], dy.shape()[1]);
        let d_in = weights[0].shape()[1];
        let packed = packed_weight(&dev, weights)?;
        let dy_bf16 = bf16_of(dy)?;
        let dy_buffer = storage_of(&dy_bf16)?.bf16_buffer(OP)?;
        let lhs = DeviceMat { buffer: dy_buffer, offset: 0, row_stride: total, col_stride: 1 };
        let rhs = DeviceMat { buffer: &*packed, offset: 0, row_stride: d_in, col_stride: 1 };
        let dims = GemmDims { m: rows, n: d_in, k: total };
        let product = |out: &mut DeviceBuffer<f32>, store| {
            matmul_bf16(&dev, out, 0, lhs, rhs, dims, store).map_err(|e| crate::cuda::cuda_error(OP, e))
        };
        let mut so_far = so_far;
        let in_place = so_far.as_mut().filter(|sum| sum.dtype() == DType::F32 && sum.shape() == [rows, d_in]);
        if let Some(storage) = in_place.and_then(Tensor::sole_dense_cuda_storage) {
            product(storage.f32_buffer_mut(OP)?, Store::Accumulate)?;
            return Ok(so_far.expect("added onto in place"));
        }
        let Some(sum) = so_far else {
            // The input's only gradient: in bf16 alone, as autocast keeps a bf16 product
            // input's gradient (its readers, RMSNorm's, SwiGLU's and attention's backward,
            // read bf16; any other widens it on demand).
            let mut dx = CudaStorage::alloc_values(&dev, rows * d_in, true)?;
            match dx.values_mut(OP)? {
                ValuesMut::Bf16(out) => matmul_bf16_out(&dev, out, lhs, rhs, dims),
                ValuesMut::F32(out) => matmul_bf16(&dev, out, 0, lhs, rhs, dims, Store::Overwrite),
            }
            .map_err(|e| crate::cuda::cuda_error(OP, e))?;
            return Tensor::from_cuda(dx, &[rows, d_in]);
        };
        sum.accumulate(output(&dev, OP, &[rows, d_in], |out| product(out, Store::Overwrite))?)
    }
}
