//! Matrix multiply through the `gemm` crate: `dst = beta·(lhs · rhs) (+ dst if accumulate)`.
//!
//! Operands are described by row and column strides, so transposed operands cost nothing:
//! `Aᵀ` is `A` with its strides swapped. Backward passes use `accumulate = true` to add
//! straight into a gradient buffer (no transposed copies, no alloc-then-add).
//!
//! PyTorch equivalent: `torch.addmm(dst, lhs, rhs)`.

use gemm::Parallelism;

/// A strided matrix operand: `data[offset + i·row_stride + j·col_stride]` is element (i, j).
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub row_stride: isize,
    pub col_stride: isize,
}

/// Below this many multiply-adds a single thread is faster than waking the pool.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `dst[m×n] (+)= lhs[m×k] · rhs[k×n]`, with `dst` row-major contiguous at `dst_offset`.
///
/// Panics if an operand's strides reach outside its slice: callers (the tensor crate)
/// check shapes and return errors before calling.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dst: &mut [f32],
    dst_offset: usize,
    lhs: MatRef,
    rhs: MatRef,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= dst_offset + m * n, "matmul: dst too short");
    check_bounds(&lhs, m, k, "lhs");
    check_bounds(&rhs, k, n, "rhs");
    if k == 0 {
        if !accumulate {
            dst[dst_offset..dst_offset + m * n].fill(0.0);
        }
        return;
    }
    let parallelism = if m * n * k >= PARALLEL_MIN_FLOPS && rayon::current_num_threads() > 1 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: the bounds of every operand were checked above against the largest index
    // the strides can reach; dst is exclusively borrowed and does not alias lhs or rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.col_stride,
            lhs.row_stride,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.col_stride,
            rhs.row_stride,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn check_bounds(mat: &MatRef, rows: usize, cols: usize, what: &str) {
    assert!(mat.row_stride >= 0 && mat.col_stride >= 0, "matmul: negative stride in {what}");
    let last = mat.offset
        + (rows.saturating_sub(1)) * mat.row_stride as usize
        + (cols.saturating_sub(1)) * mat.col_stride as usize;
    assert!(rows == 0 || cols == 0 || last < mat.data.len(), "matmul: {what} out of bounds");
}

/// Naive reference used by tests: `dst = lhs · rhs` for contiguous row-major operands.
pub fn matmul_reference(lhs: &[f32], rhs: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut dst = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let a = lhs[i * k + p];
            for j in 0..n {
                dst[i * n + j] += a * rhs[p * n + j];
            }
        }
    }
    dst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contiguous(data: &[f32], cols: usize) -> MatRef<'_> {
        MatRef { data, offset: 0, row_stride: cols as isize, col_stride: 1 }
    }

    #[test]
    fn matches_reference_and_accumulates() {
        let (m, n, k) = (37, 29, 41);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
        let expected = matmul_reference(&a, &b, m, n, k);
        let mut dst = vec![0.0; m * n];
        matmul(&mut dst, 0, contiguous(&a, k), contiguous(&b, n), m, n, k, false);
        assert_eq!(dst, expected);
        matmul(&mut dst, 0, contiguous(&a, k), contiguous(&b, n), m, n, k, true);
        let doubled: Vec<f32> = expected.iter().map(|x| 2.0 * x).collect();
        assert_eq!(dst, doubled);
    }

    #[test]
    fn transposed_operand_by_strides() {
        let (m, n, k) = (3, 2, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32).collect();
        // bt is n×k; read it as k×n through swapped strides.
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32) * 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|idx| bt[(idx % n) * k + idx / n]).collect();
        let expected = matmul_reference(&a, &b, m, n, k);
        let mut dst = vec![0.0; m * n];
        let rhs = MatRef { data: &bt, offset: 0, row_stride: 1, col_stride: k as isize };
        matmul(&mut dst, 0, contiguous(&a, k), rhs, m, n, k, false);
        assert_eq!(dst, expected);
    }
}
