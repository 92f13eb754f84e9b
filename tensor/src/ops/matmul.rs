//! Batched matrix multiply with broadcasting batch dimensions and free transposes.
//!
//! PyTorch equivalent: `torch.matmul` for operands of rank ≥ 2.

use kernels::cpu::matmul::{matmul, GemmDims, MatRef, Store};

use crate::shape::broadcast_shapes;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// `self[..., m, k] · rhs[..., k, n]`; batch dimensions broadcast. Strided operands
    /// (e.g. `w.transpose(0, 1)`) are read in place, never copied (on a GPU, where cuBLAS
    /// can take the view). GPU products run in the precision set by
    /// `tensor::cuda::set_matmul_precision` (f32 unless bf16 mixed precision is on).
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.same_device("matmul", rhs)?;
        let mismatch = || Error::ShapeMismatch { op: "matmul", lhs: self.shape.clone(), rhs: rhs.shape.clone() };
        if self.rank() < 2 || rhs.rank() < 2 {
            return Err(mismatch());
        }
        let (m, k) = (self.shape[self.rank() - 2], self.shape[self.rank() - 1]);
        let (k2, n) = (rhs.shape[rhs.rank() - 2], rhs.shape[rhs.rank() - 1]);
        if k != k2 {
            return Err(mismatch());
        }
        let batch = broadcast_shapes("matmul", &self.shape[..self.rank() - 2], &rhs.shape[..rhs.rank() - 2])
            .map_err(|_| mismatch())?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::matmul(self, rhs, &batch, (m, k, n));
        }
        let lhs = self.expand(&[batch.as_slice(), &[m, k]].concat())?;
        let rhs = rhs.expand(&[batch.as_slice(), &[k, n]].concat())?;
        let batches: usize = batch.iter().product();
        let mut out = crate::pool::buffer(batches * m * n);
        let (lhs_data, rhs_data) = (lhs.f32_storage("matmul")?, rhs.f32_storage("matmul")?);
        for b in 0..batches {
            let (l, r) = (operand(&lhs, lhs_data, b, &batch), operand(&rhs, rhs_data, b, &batch));
            matmul(&mut out, b * m * n, l, r, GemmDims { m, n, k }, Store::Overwrite);
        }
        Tensor::from_vec(out, &[batch.as_slice(), &[m, n]].concat())
    }
}

/// Matrix `b` of the batch of an expanded `[batch..., rows, cols]` view, as a gemm operand.
fn operand<'a>(t: &Tensor, data: &'a [f32], b: usize, batch: &[usize]) -> MatRef<'a> {
    let rank = t.rank();
    MatRef {
        data,
        offset: t.offset + batch_offset(b, batch, &t.strides[..rank - 2]),
        row_stride: t.strides[rank - 2] as isize,
        col_stride: t.strides[rank - 1] as isize,
    }
}

/// Storage offset of flat batch index `b` for a view with `strides` over `batch` dims.
fn batch_offset(mut b: usize, batch: &[usize], strides: &[usize]) -> usize {
    let mut offset = 0;
    for d in (0..batch.len()).rev() {
        offset += (b % batch[d]) * strides[d];
        b /= batch[d];
    }
    offset
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_broadcast_and_transposed() {
        let a = Tensor::from_vec((0..12).map(|i| i as f32).collect(), &[2, 2, 3]).unwrap();
        let w = Tensor::from_vec((0..6).map(|i| i as f32 * 0.5).collect(), &[2, 3]).unwrap();
        // a · wᵀ with w broadcast over the batch.
        let y = a.matmul(&w.transpose(0, 1).unwrap()).unwrap();
        assert_eq!(y.shape(), &[2, 2, 2]);
        let a0 = [0.0, 1.0, 2.0];
        let w1 = [1.5, 2.0, 2.5];
        let expected: f32 = a0.iter().zip(w1).map(|(x, y)| x * y).sum();
        assert_eq!(y.to_vec()[1], expected);
        assert!(a.matmul(&w).is_err());
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/matmul.rs` (one cuBLAS product per batch matrix, strided views
    //! read in place where cuBLAS can take them) and the process-wide matmul precision.

    use std::sync::atomic::{AtomicBool, Ordering};

    use kernels::cpu::matmul::{GemmDims, Store};
    use kernels::cuda::blas::{self as launch, DeviceMat};
    use kernels::cuda::{DeviceBuffer, DeviceScalar};

    use crate::cuda::output;
    use crate::{DType, Error, Result, Tensor};

    /// The operand type of every matmul on a GPU (see [`set_matmul_precision`]).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub enum MatmulPrecision {
        /// f32 operands and f32 compute: agrees with the CPU to rounding (the default).
        #[default]
        F32,
        /// Autocast-style mixed precision, as used for training: tensors (master weights,
        /// activations, gradients) stay f32; each product converts both operands to bf16 on
        /// the device and runs a tensor-core GEMM that accumulates and writes f32. About 8
        /// significant bits per operand, so results differ from f32 by ~1e-2 relative.
        Bf16,
    }

    /// Whether [`MatmulPrecision::Bf16`] is on.
    static BF16: AtomicBool = AtomicBool::new(false);

    /// Sets the precision of every later matmul on a GPU, forward and backward, in the whole
    /// process (PyTorch's `torch.autocast(dtype=torch.bfloat16)` for GEMMs). CPU matmuls are
    /// always f32.
    pub fn set_matmul_precision(precision: MatmulPrecision) {
        BF16.store(precision == MatmulPrecision::Bf16, Ordering::Relaxed);
    }

    /// The precision [`set_matmul_precision`] last set ([`MatmulPrecision::F32`] until then).
    pub fn matmul_precision() -> MatmulPrecision {
        if BF16.load(Ordering::Relaxed) {
            MatmulPrecision::Bf16
        } else {
            MatmulPrecision::F32
        }
    }

    /// `lhs[..., m, k] · rhs[..., k, n]` with both batch shapes broadcast to `batch` (already
    /// checked by the caller).
    pub(crate) fn matmul(
        lhs: &Tensor,
        rhs: &Tensor,
        batch: &[usize],
        (m, k, n): (usize, usize, usize),
    ) -> Result<Tensor> {
        const OP: &str = "matmul";
        let dev = lhs.cuda_device(OP)?;
        for t in [lhs, rhs] {
            if t.dtype() != DType::F32 {
                return Err(Error::DTypeMismatch { op: OP, expected: DType::F32, got: t.dtype() });
            }
        }
        let out_shape = [batch, &[m, n]].concat();
        if k == 0 {
            // An empty sum: zeros (cuBLAS is not asked to scale an uninitialised output).
            return Tensor::zeros_on(&out_shape, lhs.device);
        }
        let (lhs, rhs) = (gemm_view(lhs, m, k)?, gemm_view(rhs, k, n)?);
        let bf16 = matmul_precision() == MatmulPrecision::Bf16;
        let (lhs, rhs) = if bf16 { (to_bf16(&lhs)?, to_bf16(&rhs)?) } else { (lhs, rhs) };
        let lhs = lhs.expand(&[batch, &[m, k]].concat())?;
        let rhs = rhs.expand(&[batch, &[k, n]].concat())?;
        let batches: usize = batch.iter().product();
        let (l_storage, r_storage) = (storage_of(&lhs)?, storage_of(&rhs)?);
        output(&dev, OP, &out_shape, |out| {
            for b in 0..batches {
                let at = b * m * n;
                if bf16 {
                    let (l, r) = (l_storage.bf16_buffer(OP)?, r_storage.bf16_buffer(OP)?);
                    let (l, r) = (operand(&lhs, l, b, batch), operand(&rhs, r, b, batch));
                    launch::matmul_bf16(&dev, out, at, l, r, GemmDims { m, n, k }, Store::Overwrite)?;
                } else {
                    let (l, r) = (l_storage.f32_buffer(OP)?, r_storage.f32_buffer(OP)?);
                    let (l, r) = (operand(&lhs, l, b, batch), operand(&rhs, r, b, batch));
                    launch::matmul(&dev, out, at, l, r, GemmDims { m, n, k }, Store::Overwrite)?;
                }
            }
            Ok(())
        })
    }

    /// `t` itself when cuBLAS can read its last two dimensions (`rows × cols`) in place, as
    /// `kernels::cuda::blas` accepts them: one unit stride and a leading dimension at least the
    /// other extent (a single row or column takes any stride). Otherwise a dense copy
    /// (broadcast or overlapping rows).
    fn gemm_view(t: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
        let rank = t.rank();
        let (row_stride, col_stride) = (t.strides[rank - 2], t.strides[rank - 1]);
        let (r, c) = (rows.max(1), cols.max(1));
        let as_rows = (col_stride == 1 || c == 1) && (r == 1 || row_stride >= c);
        let as_columns = (row_stride == 1 || r == 1) && (c == 1 || col_stride >= r);
        if as_rows || as_columns {
            Ok(t.clone())
        } else {
            t.dense()
        }
    }

    /// The same view over the bf16 copy of the storage (made once per storage and shared:
    /// `CudaStorage::bf16_copy`). The whole buffer is converted when it holds no more
    /// elements than the view (the usual case: a weight or its transpose, an activation);
    /// otherwise only the view's elements, made dense first.
    fn to_bf16(t: &Tensor) -> Result<Tensor> {
        let storage = t.cuda_storage().ok_or(Error::UnsupportedDevice { op: "matmul", device: t.device })?;
        if storage.len() > t.numel() {
            return to_bf16(&t.dense()?);
        }
        Ok(Tensor { storage: storage.bf16_copy()?, ..t.clone() })
    }

    /// The device storage behind `t`.
    fn storage_of(t: &Tensor) -> Result<&crate::cuda::CudaStorage> {
        t.cuda_storage().ok_or(Error::UnsupportedDevice { op: "matmul", device: t.device })
    }

    /// Matrix `b` of the batch of an expanded `[batch..., rows, cols]` view over `buffer`.
    fn operand<'a, T: DeviceScalar>(
        t: &Tensor,
        buffer: &'a DeviceBuffer<T>,
        b: usize,
        batch: &[usize],
    ) -> DeviceMat<'a, T> {
        let rank = t.rank();
        let mut offset = t.offset;
        let mut rest = b;
        for d in (0..batch.len()).rev() {
            offset += (rest % batch[d]) * t.strides[d];
            rest /= batch[d];
        }
        DeviceMat { buffer, offset, row_stride: t.strides[rank - 2], col_stride: t.strides[rank - 1] }
    }
}
