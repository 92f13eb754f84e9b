//! Batched matrix multiply with broadcasting batch dimensions and free transposes, and its
//! accumulating form (`C + A·B`, written into `C` by the GEMM on a GPU: summed gradients).
//!
//! PyTorch equivalent: `torch.matmul` for operands of rank ≥ 2, `torch.addmm`.

use kernels::cpu::matmul::{matmul, GemmDims, MatRef, Store};

use crate::shape::broadcast_shapes;
use crate::{Error, Result, Tensor};

/// The shape of a product `lhs[..., m, k]·rhs[..., k, n]`: the batch dimensions of both
/// broadcast together, and the size of each matrix product.
struct Product {
    batch: Vec<usize>,
    dims: GemmDims,
}

impl Product {
    /// Checks that `lhs` and `rhs` can be multiplied (same device, rank ≥ 2, inner sizes
    /// equal, batch dimensions broadcastable); `op` names the caller in errors.
    fn of(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<Product> {
        lhs.same_device(op, rhs)?;
        let mismatch = || Error::ShapeMismatch { op, lhs: lhs.shape.clone(), rhs: rhs.shape.clone() };
        if lhs.rank() < 2 || rhs.rank() < 2 {
            return Err(mismatch());
        }
        let (m, k) = (lhs.shape[lhs.rank() - 2], lhs.shape[lhs.rank() - 1]);
        let (k2, n) = (rhs.shape[rhs.rank() - 2], rhs.shape[rhs.rank() - 1]);
        if k != k2 {
            return Err(mismatch());
        }
        let batch =
            broadcast_shapes(op, &lhs.shape[..lhs.rank() - 2], &rhs.shape[..rhs.rank() - 2]).map_err(|_| mismatch())?;
        Ok(Product { batch, dims: GemmDims { m, n, k } })
    }

    /// The shape of the result, `[batch..., m, n]`.
    fn shape(&self) -> Vec<usize> {
        [self.batch.as_slice(), &[self.dims.m, self.dims.n]].concat()
    }

    /// Number of matrix products (the batch dimensions' product).
    fn batches(&self) -> usize {
        self.batch.iter().product()
    }
}

impl Tensor {
    /// `self[..., m, k] · rhs[..., k, n]`; batch dimensions broadcast. Strided operands
    /// (e.g. `w.transpose(0, 1)`) are read in place, never copied (on a GPU, where cuBLAS
    /// can take the view). GPU products run in the precision set by
    /// `tensor::cuda::set_matmul_precision` (f32 unless bf16 mixed precision is on).
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let product = Product::of("matmul", self, rhs)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::matmul(self, rhs, &product);
        }
        let mut out = crate::pool::buffer(product.shape().iter().product());
        cpu_products(&mut out, self, rhs, &product)?;
        Tensor::from_vec(out, &product.shape())
    }

    /// `self + lhs·rhs` ([`Tensor::matmul`]'s product, which must have `self`'s shape), for
    /// a gradient that several products add to. On a GPU, when `self` is the only owner of a
    /// dense f32 buffer holding exactly its elements, cuBLAS adds the product into that
    /// buffer (BLAS's β = 1: no separate add, no new buffer) and the write drops the
    /// buffer's bf16 copy (cuBLAS writes f32 only). Otherwise, and always on the CPU, the
    /// product goes to a new buffer and [`Tensor::accumulate`] adds the two: the CPU's `gemm`
    /// would add `self` into its sum before the later blocks of `k`, which changes the bits
    /// of the sum, where cuBLAS adds β·`self` after the whole product, as a separate add
    /// does. PyTorch: `torch.addmm(self, lhs, rhs)`.
    pub fn add_matmul(self, lhs: &Tensor, rhs: &Tensor) -> Result<Tensor> {
        const OP: &str = "add_matmul";
        self.same_device(OP, lhs)?;
        let product = Product::of(OP, lhs, rhs)?;
        if product.shape() != self.shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape.clone(), rhs: product.shape() });
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let mut sum = self;
            if cuda::add_matmul_in_place(&mut sum, lhs, rhs, &product)? {
                return Ok(sum);
            }
            return sum.accumulate(lhs.matmul(rhs)?);
        }
        self.accumulate(lhs.matmul(rhs)?)
    }
}

/// The CPU products of `lhs·rhs` into `out` (row-major `[batch..., m, n]`).
fn cpu_products(out: &mut [f32], lhs: &Tensor, rhs: &Tensor, product: &Product) -> Result<()> {
    let Product { batch, dims } = product;
    let lhs = lhs.expand(&[batch.as_slice(), &[dims.m, dims.k]].concat())?;
    let rhs = rhs.expand(&[batch.as_slice(), &[dims.k, dims.n]].concat())?;
    let (lhs_data, rhs_data) = (lhs.f32_storage("matmul")?, rhs.f32_storage("matmul")?);
    for b in 0..product.batches() {
        let (l, r) = (operand(&lhs, lhs_data, b, batch), operand(&rhs, rhs_data, b, batch));
        matmul(out, b * dims.m * dims.n, l, r, *dims, Store::Overwrite);
    }
    Ok(())
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

    #[test]
    fn add_matmul_is_the_sum_with_the_product() {
        let mut rng = crate::Rng::new(5);
        let (dy, w) =
            (Tensor::rand_normal(&[6, 4], 0.0, 1.0, &mut rng), Tensor::rand_normal(&[4, 5], 0.0, 1.0, &mut rng));
        let sum = Tensor::rand_normal(&[6, 5], 0.0, 1.0, &mut rng);
        let want = sum.clone().accumulate(dy.matmul(&w).unwrap()).unwrap().to_vec();
        // The sole owner of its buffer, and a buffer shared with `sum` (left as it was).
        let owned = Tensor::from_vec(sum.to_vec(), &[6, 5]).unwrap();
        assert_eq!(owned.add_matmul(&dy, &w).unwrap().to_vec(), want);
        let before = sum.to_vec();
        assert_eq!(sum.clone().add_matmul(&dy, &w).unwrap().to_vec(), want);
        assert_eq!(sum.to_vec(), before);
        // The product must have the sum's shape.
        assert!(sum.add_matmul(&dy, &w.narrow(1, 0, 4).unwrap()).is_err());
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/matmul.rs` (one cuBLAS product per batch matrix, strided views
    //! read in place where cuBLAS can take them; added onto a gradient's buffer by β = 1 for
    //! `Tensor::add_matmul`) and the process-wide matmul precision.

    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use kernels::cpu::matmul::{GemmDims, Store};
    use kernels::cuda::blas::{self as launch, DeviceMat};
    use kernels::cuda::{CudaDevice, DeviceBuffer, DeviceScalar};

    use super::Product;
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

    /// `lhs[..., m, k] · rhs[..., k, n]` of `product`'s shape (already checked by the caller).
    pub(super) fn matmul(lhs: &Tensor, rhs: &Tensor, product: &Product) -> Result<Tensor> {
        const OP: &str = "matmul";
        let dev = lhs.cuda_device(OP)?;
        check_f32(OP, lhs, rhs)?;
        if product.dims.k == 0 {
            // An empty sum: zeros (cuBLAS is not asked to scale an uninitialised output).
            return Tensor::zeros_on(&product.shape(), lhs.device);
        }
        output(&dev, OP, &product.shape(), |out| products(&dev, lhs, rhs, product, out, Store::Overwrite))
    }

    /// `dst += lhs·rhs` by the GEMMs themselves (BLAS's β = 1) when `dst` solely owns a dense
    /// f32 buffer of exactly its elements (`product`'s shape, checked by the caller); `false`
    /// when it does not, and the caller adds the product another way. The write forgets the
    /// buffer's bf16 copy (`CudaStorage::f32_buffer_mut`): cuBLAS writes f32 only.
    pub(super) fn add_matmul_in_place(dst: &mut Tensor, lhs: &Tensor, rhs: &Tensor, product: &Product) -> Result<bool> {
        const OP: &str = "add_matmul";
        if dst.dtype() != DType::F32 {
            return Ok(false);
        }
        let dev = dst.cuda_device(OP)?;
        check_f32(OP, lhs, rhs)?;
        let Some(storage) = dst.sole_dense_cuda_storage() else { return Ok(false) };
        if product.dims.k == 0 {
            // Nothing to add.
            return Ok(true);
        }
        products(&dev, lhs, rhs, product, storage.f32_buffer_mut(OP)?, Store::Accumulate)?;
        Ok(true)
    }

    /// Errors unless both operands are f32 tensors (bf16 products read their bf16 copies).
    fn check_f32(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
        for t in [lhs, rhs] {
            if t.dtype() != DType::F32 {
                return Err(Error::DTypeMismatch { op, expected: DType::F32, got: t.dtype() });
            }
        }
        Ok(())
    }

    /// One cuBLAS product per batch matrix of the f32 `lhs·rhs` into `out` (row-major,
    /// `product`'s shape), written or added onto it as `store` says; `k` is not 0.
    fn products(
        dev: &Arc<CudaDevice>,
        lhs: &Tensor,
        rhs: &Tensor,
        product: &Product,
        out: &mut DeviceBuffer<f32>,
        store: Store,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let (batch, dims) = (product.batch.as_slice(), product.dims);
        let GemmDims { m, n, k } = dims;
        let (lhs, rhs) = (gemm_view(lhs, m, k)?, gemm_view(rhs, k, n)?);
        let bf16 = matmul_precision() == MatmulPrecision::Bf16;
        let (lhs, rhs) = if bf16 { (to_bf16(&lhs)?, to_bf16(&rhs)?) } else { (lhs, rhs) };
        let lhs = lhs.expand(&[batch, &[m, k]].concat())?;
        let rhs = rhs.expand(&[batch, &[k, n]].concat())?;
        let (l_storage, r_storage) = (storage_of(&lhs)?, storage_of(&rhs)?);
        for b in 0..product.batches() {
            let at = b * m * n;
            if bf16 {
                let (l, r) = (l_storage.bf16_buffer(OP)?, r_storage.bf16_buffer(OP)?);
                let (l, r) = (operand(&lhs, l, b, batch), operand(&rhs, r, b, batch));
                launch::matmul_bf16(dev, out, at, l, r, dims, store)?;
            } else {
                let (l, r) = (l_storage.f32_buffer(OP)?, r_storage.f32_buffer(OP)?);
                let (l, r) = (operand(&lhs, l, b, batch), operand(&rhs, r, b, batch));
                launch::matmul(dev, out, at, l, r, dims, store)?;
            }
        }
        Ok(())
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
    /// elements than the view (the usual case: a weight or its transpose, an activation); a
    /// view of a larger buffer reads the buffer's own copy when it has one (a block of columns
    /// of a gradient written with its bf16 twin), and otherwise only the view's elements are
    /// converted, made dense first.
    fn to_bf16(t: &Tensor) -> Result<Tensor> {
        let storage = t.cuda_storage().ok_or(Error::UnsupportedDevice { op: "matmul", device: t.device })?;
        if storage.len() > t.numel() && !storage.has_own_bf16_copy() {
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
