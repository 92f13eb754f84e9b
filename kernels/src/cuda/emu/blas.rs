//! The cuBLAS calls of `cuda/blas.rs`, done on the CPU with cuBLAS's semantics: column-major
//! operands, `op(X)` = X or Xᵀ, leading dimensions (checked as cuBLAS checks them, then every
//! touched element against its buffer), `C = alpha·op(A)·op(B) + beta·C` where beta = 0 does
//! not read C and beta·C is added once the whole sum over k is done (cuBLAS's epilogue), and
//! bf16 operands widened exactly to f32 and accumulated in f32.

use gemm::Parallelism;
use half::bf16;

use super::memory::containing;
use crate::cuda::error::{CudaError, Result};

/// One column-major operand as cuBLAS receives it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ColMajor {
    /// Device address of element (0, 0) of the stored matrix.
    pub ptr: u64,
    /// Leading dimension (elements between columns of the stored matrix).
    pub ld: usize,
    /// Whether cuBLAS is told to transpose it (`CUBLAS_OP_T`).
    pub trans: bool,
}

/// Element types of the A and B operands and of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operands {
    /// f32 A, B and C.
    F32,
    /// bf16 A and B, f32 C.
    Bf16,
    /// bf16 A, B and C (the f32 sum rounded to nearest even once; beta 0).
    Bf16Out,
}

fn blas_error(call: &str, message: String) -> CudaError {
    CudaError::Blas { context: format!("{call} (emulated)"), message }
}

/// Checks that the stored `rows × cols` column-major matrix at `ptr` with `ld` lies inside
/// one live buffer of `elem_bytes` elements.
fn check_extent(
    call: &str,
    what: &str,
    ptr: u64,
    ld: usize,
    rows: usize,
    cols: usize,
    elem_bytes: usize,
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    if ld < rows.max(1) {
        return Err(blas_error(call, format!("CUBLAS_STATUS_INVALID_VALUE: ld{what} = {ld} < {rows} rows of {what}")));
    }
    let last = ptr + (((cols - 1) * ld + rows - 1) * elem_bytes) as u64;
    let buffer =
        containing(ptr).ok_or_else(|| blas_error(call, format!("{what} at {ptr:#x} is in no device buffer")))?;
    if buffer.elem_bytes != elem_bytes {
        return Err(blas_error(
            call,
            format!("{what} is a {} buffer, expected {elem_bytes}-byte elements", buffer.describe()),
        ));
    }
    if !buffer.holds(last, elem_bytes) {
        let past = (last - buffer.ptr) / elem_bytes as u64 + 1 - buffer.len() as u64;
        return Err(blas_error(
            call,
            format!("{what}'s last element is {past} elements past the end of its {}", buffer.describe()),
        ));
    }
    Ok(())
}

/// `op(X)` of a stored operand as strides of the `rows × cols` operand: (row, col) strides.
fn strides(x: ColMajor) -> (isize, isize) {
    if x.trans {
        (x.ld as isize, 1)
    } else {
        (1, x.ld as isize)
    }
}

/// The stored shape of an operand whose `op` is `rows × cols`.
fn stored(x: ColMajor, rows: usize, cols: usize) -> (usize, usize) {
    if x.trans {
        (cols, rows)
    } else {
        (rows, cols)
    }
}

/// Reads the stored matrix of a bf16 operand into f32 (exact), keeping its layout.
///
/// # Safety
/// `x` must cover its stored `rows × cols` matrix (checked by [`check_extent`]).
unsafe fn widen(x: ColMajor, rows: usize, cols: usize) -> Vec<f32> {
    let (r, c) = stored(x, rows, cols);
    let len = if r == 0 || c == 0 { 0 } else { (c - 1) * x.ld + r };
    let src = std::slice::from_raw_parts(x.ptr as *const bf16, len);
    src.iter().map(|v| v.to_f32()).collect()
}

/// `batch` products `C_i = alpha·op(A_i)[m×k]·op(B_i)[k×n] + beta·C_i` (column-major),
/// operand `i` `stride` elements after operand `i − 1` (`cublasSgemmStridedBatched`,
/// `cublasGemmEx` for one product).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    call: &str,
    operands: Operands,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, stride_a): (ColMajor, usize),
    (b, stride_b): (ColMajor, usize),
    beta: f32,
    (c, ldc, stride_c): (u64, usize, usize),
    batch: usize,
) -> Result<()> {
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let (elem, c_elem) = match operands {
        Operands::F32 => (4, 4),
        Operands::Bf16 => (2, 4),
        Operands::Bf16Out => (2, 2),
    };
    if operands == Operands::Bf16Out && beta != 0.0 {
        return Err(blas_error(call, "a bf16 C is overwritten (beta 0)".to_string()));
    }
    for i in 0..batch {
        let (ai, bi, ci) = (
            ColMajor { ptr: a.ptr + (i * stride_a * elem) as u64, ..a },
            ColMajor { ptr: b.ptr + (i * stride_b * elem) as u64, ..b },
            c + (i * stride_c * c_elem) as u64,
        );
        let (ar, ac) = stored(ai, m, k);
        let (br, bc) = stored(bi, k, n);
        check_extent(call, "A", ai.ptr, ai.ld, ar, ac, elem)?;
        check_extent(call, "B", bi.ptr, bi.ld, br, bc, elem)?;
        check_extent(call, "C", ci, ldc, m, n, c_elem)?;
        // SAFETY: every touched element of A, B and C lies in its buffer (checked above);
        // C is not aliased by A or B in the backend's calls.
        unsafe { product(operands, (m, n, k), alpha, ai, bi, beta, ci, ldc) };
    }
    Ok(())
}

/// One checked product.
///
/// # Safety
/// The operands must cover their stored matrices and C its `m × n` columns.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    operands: Operands,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: ColMajor,
    b: ColMajor,
    beta: f32,
    c: u64,
    ldc: usize,
) {
    if operands == Operands::Bf16Out {
        // The f32 product, then each element rounded once (cuBLAS's epilogue).
        let mut product32 = vec![0.0f32; m * n];
        product(Operands::Bf16, (m, n, k), alpha, a, b, 0.0, product32.as_mut_ptr() as u64, m);
        let dst = c as *mut half::bf16;
        for j in 0..n {
            for i in 0..m {
                *dst.add(i + j * ldc) = half::bf16::from_f32(product32[i + j * m]);
            }
        }
        return;
    }
    let dst = c as *mut f32;
    if k == 0 {
        // C = beta·C (cuBLAS scales C even for an empty sum; beta = 0 writes zeros).
        for j in 0..n {
            for i in 0..m {
                let at = dst.add(i + j * ldc);
                *at = if beta == 0.0 { 0.0 } else { beta * *at };
            }
        }
        return;
    }
    let (wide_a, wide_b);
    let (pa, pb) = match operands {
        Operands::F32 => (a.ptr as *const f32, b.ptr as *const f32),
        Operands::Bf16 | Operands::Bf16Out => {
            wide_a = widen(a, m, k);
            wide_b = widen(b, k, n);
            (wide_a.as_ptr(), wide_b.as_ptr())
        }
    };
    let (a_rs, a_cs) = strides(a);
    let (b_rs, b_cs) = strides(b);
    // gemm computes out = alpha_g·out + beta_g·lhs·rhs; here always out = alpha·lhs·rhs (not
    // reading out). It would add a read C into its sum before the later blocks of k, where
    // cuBLAS adds beta·C after the whole sum (its epilogue): so C + A·B gives the bits of
    // A·B written, then added to C (a gradient summed by the GEMM or by a separate add).
    let product_into = |out: *mut f32, ld: usize| {
        gemm::gemm(
            m,
            n,
            k,
            out,
            ld as isize,
            1,
            false,
            pa,
            a_cs,
            a_rs,
            pb,
            b_cs,
            b_rs,
            0.0,
            alpha,
            false,
            false,
            false,
            Parallelism::Rayon(rayon::current_num_threads()),
        )
    };
    if beta == 0.0 {
        product_into(dst, ldc);
        return;
    }
    let mut product = vec![0.0f32; m * n];
    product_into(product.as_mut_ptr(), m);
    for j in 0..n {
        for i in 0..m {
            let at = dst.add(i + j * ldc);
            *at = product[i + j * m] + beta * *at;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaDevice;

    /// Naive column-major `alpha·op(A)·op(B) + beta·C` in f64.
    fn reference(
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, lda, ta): (&[f32], usize, bool),
        (b, ldb, tb): (&[f32], usize, bool),
        beta: f32,
        c: &[f32],
        ldc: usize,
    ) -> Vec<f32> {
        let at = |i: usize, l: usize| if ta { a[l + i * lda] } else { a[i + l * lda] };
        let bt = |l: usize, j: usize| if tb { b[j + l * ldb] } else { b[l + j * ldb] };
        let mut out = c.to_vec();
        for j in 0..n {
            for i in 0..m {
                let dot: f64 = (0..k).map(|l| f64::from(at(i, l)) * f64::from(bt(l, j))).sum();
                let old = if beta == 0.0 { 0.0 } else { f64::from(beta) * f64::from(c[i + j * ldc]) };
                out[i + j * ldc] = (f64::from(alpha) * dot + old) as f32;
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    #[test]
    fn products_follow_cublas_semantics_for_every_transpose_and_stride() {
        let dev = CudaDevice::emulated().unwrap();
        let (m, n, k) = (5, 7, 3);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)] {
                // Leading dimensions one and two past the minimum.
                let lda = if ta { k } else { m } + 1;
                let ldb = if tb { n } else { k } + 2;
                let ldc = m + 1;
                let a = values(lda * if ta { m } else { k }, 1);
                let b = values(ldb * if tb { k } else { n }, 2);
                let mut c = values(ldc * n, 3);
                if beta == 0.0 {
                    c[0] = f32::NAN; // beta = 0 must not read C
                }
                let want = reference((m, n, k), alpha, (&a, lda, ta), (&b, ldb, tb), beta, &c, ldc);
                let (ga, gb, gc) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap(), dev.upload(&c).unwrap());
                let op = |buffer: &crate::cuda::DeviceBuffer<f32>, ld, trans| ColMajor {
                    ptr: buffer.device_ptr(),
                    ld,
                    trans,
                };
                gemm(
                    "test",
                    Operands::F32,
                    (m, n, k),
                    alpha,
                    (op(&ga, lda, ta), 0),
                    (op(&gb, ldb, tb), 0),
                    beta,
                    (gc.device_ptr(), ldc, 0),
                    1,
                )
                .unwrap();
                let got = dev.download(&gc).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{ta} {tb} {alpha} {beta} [{i}]: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn beta_adds_c_after_the_whole_product() {
        // k past the `gemm` crate's depth blocks: C + A·B must be A·B (every block summed)
        // plus C, as a product written and then added to C gives it, bit for bit.
        let dev = CudaDevice::emulated().unwrap();
        let (m, n, k) = (16, 64, 4096);
        let (a, b, c) = (values(m * k, 4), values(k * n, 5), values(m * n, 6));
        let (ga, gb) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        let col = |buffer: &crate::cuda::DeviceBuffer<f32>, ld| ColMajor { ptr: buffer.device_ptr(), ld, trans: false };
        let run = |beta: f32| {
            let gc = dev.upload(&c).unwrap();
            let (a, b) = ((col(&ga, m), 0), (col(&gb, k), 0));
            gemm("test", Operands::F32, (m, n, k), 1.0, a, b, beta, (gc.device_ptr(), m, 0), 1).unwrap();
            dev.download(&gc).unwrap()
        };
        let (sum, product) = (run(1.0), run(0.0));
        let added: Vec<f32> = product.iter().zip(&c).map(|(p, c)| p + c).collect();
        assert_eq!(sum, added);
    }

    #[test]
    fn bad_leading_dimensions_and_short_buffers_are_errors() {
        let dev = CudaDevice::emulated().unwrap();
        let (a, b, c) =
            (dev.upload(&[1.0f32; 6]).unwrap(), dev.upload(&[1.0f32; 6]).unwrap(), dev.upload(&[0.0f32; 4]).unwrap());
        let col = |buffer: &crate::cuda::DeviceBuffer<f32>, ld| ColMajor { ptr: buffer.device_ptr(), ld, trans: false };
        // A is 2×3 with lda 1 < 2 rows.
        let err = gemm(
            "test",
            Operands::F32,
            (2, 2, 3),
            1.0,
            (col(&a, 1), 0),
            (col(&b, 3), 0),
            0.0,
            (c.device_ptr(), 2, 0),
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("INVALID_VALUE"), "{err}");
        // B is 3×3 but holds 6 elements.
        let err = gemm(
            "test",
            Operands::F32,
            (2, 3, 3),
            1.0,
            (col(&a, 2), 0),
            (col(&b, 3), 0),
            0.0,
            (c.device_ptr(), 2, 0),
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("B's last element is 3 elements past the end of its f32[6]"), "{err}");
    }
}
