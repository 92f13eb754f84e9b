//! Matrix products through cuBLAS, in the row-major convention of the CPU kernels.
//!
//! cuBLAS is column-major. A row-major `X[r×c]` with row stride `ld` is the column-major
//! `Xᵀ[c×r]` with the same leading dimension, so the row-major `C = op(A)·op(B)` is computed
//! as the column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`: operands swapped, `m` and `n` swapped.
//!
//! [`matmul`] mirrors `cpu::matmul::matmul` (`dst (+)= lhs·rhs` with strided operands, one
//! of whose strides must be 1 on the GPU). f32 products run in full f32 (cuBLAS's default
//! math mode, no TF32), so they agree with the CPU to rounding. [`matmul_bf16`] is the same
//! product with bf16 operands on tensor cores, accumulated and written in f32.

use std::ffi::c_void;

use cudarc::cublas::{result as cublas, sys};

use half::bf16;

use super::allocator::{DeviceBuffer, DeviceScalar};
use super::counters::GemmKind;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::to_i32;
pub use crate::cpu::matmul::GemmDims;
use crate::cpu::matmul::Store;

/// One operand of a row-major product: `ptr` is element (0, 0) of the stored matrix, `ld`
/// its row stride, and `trans` says the stored matrix is the transpose of the operand.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    /// Device address of the stored matrix's first element.
    pub ptr: u64,
    /// Row stride of the stored (row-major) matrix, in elements.
    pub ld: usize,
    /// Whether the operand is the transpose of the stored matrix.
    pub trans: bool,
}

impl Operand {
    /// A row-major operand read as stored.
    pub(crate) fn rows(ptr: u64, ld: usize) -> Operand {
        Operand { ptr, ld, trans: false }
    }

    /// The transpose of a row-major stored matrix.
    pub(crate) fn transposed(ptr: u64, ld: usize) -> Operand {
        Operand { ptr, ld, trans: true }
    }

    fn op(self) -> sys::cublasOperation_t {
        if self.trans {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    }
}

/// Element types of [`gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Precision {
    /// f32 operands, f32 output, f32 compute.
    F32,
    /// bf16 operands, f32 output, f32 accumulate (tensor cores).
    Bf16,
    /// bf16 operands, f32 accumulate (tensor cores), bf16 output (rounded to nearest even
    /// once, from the f32 sum; overwrite only): a product saved for a backward, as autocast's.
    Bf16Out,
}

impl Precision {
    /// The cuBLAS function a single product of this precision calls.
    fn function(self) -> &'static str {
        match self {
            Precision::F32 => "cublasSgemm",
            Precision::Bf16 | Precision::Bf16Out => "cublasGemmEx",
        }
    }

    fn kind(self) -> GemmKind {
        match self {
            Precision::F32 => GemmKind::F32Simt,
            Precision::Bf16 | Precision::Bf16Out => GemmKind::Bf16TensorCore,
        }
    }

    /// FLOPs and bytes referenced of `batch` products `m×n×k` (the output read too when
    /// `beta` is not 0), for the device counters.
    fn cost(self, (m, n, k): (usize, usize, usize), beta: f32, batch: usize) -> (u64, u64) {
        let (operand_bytes, output_bytes) = match self {
            Precision::F32 => (4, 4),
            Precision::Bf16 => (2, 4),
            Precision::Bf16Out => (2, 2),
        };
        let output_passes = if beta == 0.0 { 1 } else { 2 };
        let bytes = (m * k + k * n) * operand_bytes + m * n * output_bytes * output_passes;
        ((2 * m * n * k * batch) as u64, (bytes * batch) as u64)
    }
}

/// BLAS's β of a [`Store`]: 0 overwrites `C`, 1 adds onto it.
fn beta(store: Store) -> f32 {
    if store.reads_dst() {
        1.0
    } else {
        0.0
    }
}

/// Row-major `C[m×n] = op(A)[m×k]·op(B)[k×n]` (`+=` with [`Store::Accumulate`]: BLAS's α = 1
/// and β = 0 or 1) with `C`'s row stride `ldc`.
pub(crate) fn gemm(
    dev: &CudaDevice,
    precision: Precision,
    dims: GemmDims,
    a: Operand,
    b: Operand,
    store: Store,
    (c, ldc): (u64, usize),
) -> Result<()> {
    const OP: &str = "gemm";
    let (GemmDims { m, n, k }, alpha, beta) = (dims, 1.0f32, beta(store));
    ensure(precision != Precision::Bf16Out || beta == 0.0, OP, || "a bf16 output is overwritten, not added to".into())?;
    // An empty product leaves C as it is when accumulating (cuBLAS would scale it by beta).
    if m == 0 || n == 0 || (k == 0 && beta == 1.0) {
        return Ok(());
    }
    let (mi, ni, ki) = (to_i32(OP, "m", m)?, to_i32(OP, "n", n)?, to_i32(OP, "k", k)?);
    let (lda, ldb, ldc) = (to_i32(OP, "lda", a.ld.max(1))?, to_i32(OP, "ldb", b.ld.max(1))?, to_i32(OP, "ldc", ldc)?);
    let cost = precision.cost((m, n, k), beta, 1);
    dev.cublas_call(precision.function(), precision.kind(), cost, || {
        let Some(gpu) = dev.driver() else {
            return emulated(dev, precision, (n, m, k), (b, 0), (a, 0), store, (c, ldc as usize, 0), 1);
        };
        gpu.bind()?;
        let handle = *gpu.blas().handle();
        // Column-major Cᵀ[n×m] = op(B)ᵀ[n×k]·op(A)ᵀ[k×m]: B first, then A.
        // SAFETY: callers pass addresses of device buffers that hold the m×k, k×n and m×n
        // operands at the given strides (checked by the public launchers); alpha and beta
        // are host scalars, cuBLAS's default pointer mode.
        let status = unsafe {
            match precision {
                Precision::F32 => cublas::sgemm(
                    handle,
                    b.op(),
                    a.op(),
                    ni,
                    mi,
                    ki,
                    &alpha,
                    b.ptr as *const f32,
                    ldb,
                    a.ptr as *const f32,
                    lda,
                    &beta,
                    c as *mut f32,
                    ldc,
                ),
                Precision::Bf16 | Precision::Bf16Out => cublas::gemm_ex(
                    handle,
                    b.op(),
                    a.op(),
                    ni,
                    mi,
                    ki,
                    &alpha as *const f32 as *const c_void,
                    b.ptr as *const c_void,
                    sys::cudaDataType::CUDA_R_16BF,
                    ldb,
                    a.ptr as *const c_void,
                    sys::cudaDataType::CUDA_R_16BF,
                    lda,
                    &beta as *const f32 as *const c_void,
                    c as *mut c_void,
                    if precision == Precision::Bf16Out {
                        sys::cudaDataType::CUDA_R_16BF
                    } else {
                        sys::cudaDataType::CUDA_R_32F
                    },
                    ldc,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                ),
            }
        };
        status.map_err(|e| CudaError::blas(format!("{precision:?} gemm {m}×{n}×{k}"), e))
    })
}

/// `batch` row-major f32 products `C_i = op(A_i)·op(B_i)` (`+=` with [`Store::Accumulate`]),
/// where operand `i` starts `i·stride` elements after the first (a stride of 0 shares one
/// matrix): one cuBLAS call (the convolutions' products, one per image of a chunk).
pub(crate) fn gemm_strided_batched(
    dev: &CudaDevice,
    dims: GemmDims,
    (a, stride_a): (Operand, usize),
    (b, stride_b): (Operand, usize),
    store: Store,
    (c, ldc, stride_c): (u64, usize, usize),
    batch: usize,
) -> Result<()> {
    const OP: &str = "gemm_strided_batched";
    let (GemmDims { m, n, k }, alpha, beta) = (dims, 1.0f32, beta(store));
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let (mi, ni, ki) = (to_i32(OP, "m", m)?, to_i32(OP, "n", n)?, to_i32(OP, "k", k)?);
    let (lda, ldb, ldc) = (to_i32(OP, "lda", a.ld.max(1))?, to_i32(OP, "ldb", b.ld.max(1))?, to_i32(OP, "ldc", ldc)?);
    let batch_i = to_i32(OP, "batch", batch)?;
    let precision = Precision::F32;
    let cost = precision.cost((m, n, k), beta, batch);
    dev.cublas_call("cublasSgemmStridedBatched", precision.kind(), cost, || {
        let Some(gpu) = dev.driver() else {
            let c = (c, ldc as usize, stride_c);
            return emulated(dev, precision, (n, m, k), (b, stride_b), (a, stride_a), store, c, batch);
        };
        gpu.bind()?;
        let handle = *gpu.blas().handle();
        let (stride_a, stride_b, stride_c) = (stride_a as i64, stride_b as i64, stride_c as i64);
        // SAFETY: as in `gemm`, for each of the `batch` products at the given strides.
        let status = unsafe {
            cublas::sgemm_strided_batched(
                handle,
                b.op(),
                a.op(),
                ni,
                mi,
                ki,
                &alpha,
                b.ptr as *const f32,
                ldb,
                stride_b,
                a.ptr as *const f32,
                lda,
                stride_a,
                &beta,
                c as *mut f32,
                ldc,
                stride_c,
                batch_i,
            )
        };
        status.map_err(|e| CudaError::blas(format!("f32 batched gemm {batch}×({m}×{n}×{k})"), e))
    })
}

/// The column-major cuBLAS call above (`first` is cuBLAS's A: our B; `dims` column-major,
/// `(n, m, k)`) on the emulated device: run now, or recorded by a capture.
#[allow(clippy::too_many_arguments)]
fn emulated(
    dev: &CudaDevice,
    precision: Precision,
    dims: (usize, usize, usize),
    (first, stride_first): (Operand, usize),
    (second, stride_second): (Operand, usize),
    store: Store,
    c: (u64, usize, usize),
    batch: usize,
) -> Result<()> {
    #[cfg(feature = "cuda-emu")]
    {
        use super::emu::blas::{gemm, ColMajor, Operands};
        let col = |x: Operand| ColMajor { ptr: x.ptr, ld: x.ld.max(1), trans: x.trans };
        let (call, operands) = match (precision, batch) {
            (Precision::F32, 1) => ("cublasSgemm", Operands::F32),
            (Precision::F32, _) => ("cublasSgemmStridedBatched", Operands::F32),
            (Precision::Bf16, _) => ("cublasGemmEx", Operands::Bf16),
            (Precision::Bf16Out, _) => ("cublasGemmEx", Operands::Bf16Out),
        };
        let (a, b) = ((col(first), stride_first), (col(second), stride_second));
        let addresses = || vec![first.ptr, second.ptr, c.0];
        dev.emulate(call, addresses, move |_| gemm(call, operands, dims, 1.0, a, b, beta(store), c, batch))
    }
    #[cfg(not(feature = "cuda-emu"))]
    {
        let _ = (dev, precision, dims, first, stride_first, second, stride_second, store, c, batch);
        Err(CudaError::Unavailable("no cuBLAS handle on this device".to_string()))
    }
}

/// A strided operand on the device, as `cpu::matmul::MatRef`: element (i, j) is
/// `buffer[offset + i·row_stride + j·col_stride]`. One of the strides must be 1. f32 for
/// [`matmul`], bf16 for [`matmul_bf16`].
#[derive(Clone, Copy, Debug)]
pub struct DeviceMat<'a, T: DeviceScalar = f32> {
    /// The buffer holding the matrix.
    pub buffer: &'a DeviceBuffer<T>,
    /// Element (0, 0).
    pub offset: usize,
    /// Step between rows.
    pub row_stride: usize,
    /// Step between columns.
    pub col_stride: usize,
}

impl<T: DeviceScalar> DeviceMat<'_, T> {
    /// Checks bounds and converts to a cuBLAS operand of `rows × cols`.
    fn operand(&self, dev: &CudaDevice, dims: GemmDims, what: &str) -> Result<Operand> {
        dev.check_owner("matmul", self.buffer)?;
        let (len, strides) = (self.buffer.len(), (self.row_stride, self.col_stride));
        let (fits, rows, cols) = if what == "lhs" {
            (dims.check_lhs(len, self.offset, strides), dims.m, dims.k)
        } else {
            (dims.check_rhs(len, self.offset, strides), dims.k, dims.n)
        };
        fits.map_err(|message| CudaError::shape("matmul", message))?;
        let at = self.buffer.ptr_at(self.offset.min(self.buffer.len()));
        // cuBLAS needs one unit stride and rows that do not overlap (leading dimension at
        // least the other extent); a single row or column may have any stride.
        let (r, c) = (rows.max(1), cols.max(1));
        if (self.col_stride == 1 || c == 1) && (r == 1 || self.row_stride >= c) {
            Ok(Operand::rows(at, if r == 1 { c } else { self.row_stride }))
        } else if (self.row_stride == 1 || r == 1) && (c == 1 || self.col_stride >= r) {
            Ok(Operand::transposed(at, if c == 1 { r } else { self.col_stride }))
        } else {
            Err(CudaError::shape("matmul", format!("{what} needs a unit stride and non-overlapping rows on the GPU")))
        }
    }
}

/// `dst[m×n] = lhs[m×k]·rhs[k×n]` (`+=` with [`Store::Accumulate`], BLAS's β = 1), `dst`
/// row-major contiguous at `dst_offset`; mirrors `cpu::matmul::matmul`.
pub fn matmul(
    dev: &CudaDevice,
    dst: &mut DeviceBuffer<f32>,
    dst_offset: usize,
    lhs: DeviceMat,
    rhs: DeviceMat,
    dims: GemmDims,
    store: Store,
) -> Result<()> {
    product(dev, Precision::F32, (dst, dst_offset), lhs, rhs, dims, store)
}

/// [`matmul`] with bf16 operands: tensor-core products accumulated and written in f32
/// (mixed precision; the caller converts its f32 operands with `elementwise::to_bf16`).
pub fn matmul_bf16(
    dev: &CudaDevice,
    dst: &mut DeviceBuffer<f32>,
    dst_offset: usize,
    lhs: DeviceMat<bf16>,
    rhs: DeviceMat<bf16>,
    dims: GemmDims,
    store: Store,
) -> Result<()> {
    product(dev, Precision::Bf16, (dst, dst_offset), lhs, rhs, dims, store)
}

/// [`matmul_bf16`] writing its output in bf16 (rounded to nearest even once, from the f32
/// sums; overwrite only): a product saved for its backward, as autocast stores it.
pub fn matmul_bf16_out(
    dev: &CudaDevice,
    dst: &mut DeviceBuffer<bf16>,
    lhs: DeviceMat<bf16>,
    rhs: DeviceMat<bf16>,
    dims: GemmDims,
) -> Result<()> {
    product(dev, Precision::Bf16Out, (dst, 0), lhs, rhs, dims, Store::Overwrite)
}

/// The body of [`matmul`], [`matmul_bf16`] and [`matmul_bf16_out`]: checks `dst` and both
/// operands, then one gemm.
fn product<T: DeviceScalar, D: DeviceScalar>(
    dev: &CudaDevice,
    precision: Precision,
    (dst, dst_offset): (&mut DeviceBuffer<D>, usize),
    lhs: DeviceMat<T>,
    rhs: DeviceMat<T>,
    dims: GemmDims,
    store: Store,
) -> Result<()> {
    dev.check_owner("matmul", dst)?;
    dims.check_dst(dst.len(), dst_offset).map_err(|message| CudaError::shape("matmul", message))?;
    if dims.is_empty() {
        return Ok(());
    }
    let (a, b) = (lhs.operand(dev, dims, "lhs")?, rhs.operand(dev, dims, "rhs")?);
    gemm(dev, precision, dims, a, b, store, (dst.ptr_at(dst_offset), dims.n))
}
