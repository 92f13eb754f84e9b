//! Products of small in-cache tiles, `c[m×n] = alpha·a[m×k]·b[k×n] (+ c)`, on the calling
//! thread with no packing: the inner loop of flash attention (score tiles `Q·Kᵀ`, `P·V` and
//! their backward products), where a `gemm` call per 64 × 64 × 32 tile spent more time
//! dispatching and packing than multiplying.
//!
//! Register blocking: 6 rows × 16 columns of `c` live in twelve `f32x8` accumulators; each
//! step of `k` loads two vectors of a row of `b` and broadcasts one element of `a` per row.
//! So `a` may have any strides (a transposed tile costs nothing) while `b` needs unit
//! column stride (rows of `b` are contiguous runs). Columns past the last multiple of 8 run
//! as scalar dot products. On a CPU with AVX-512F (checked at run time) the columns up to
//! the last multiple of 16 run first through [`avx512`]'s 8 × 32 kernel, twice the width.
//!
//! PyTorch equivalent: `torch.addmm(c, a, b, alpha=alpha)` on tiles.

use wide::f32x8;

use super::matmul::{GemmDims, Store};
use super::simd::LANES;

/// Row tile of the micro-kernel.
const MR: usize = 6;

/// `a(i, p) = data[offset + i·row_stride + p·col_stride]`: any layout.
#[derive(Clone, Copy, Debug)]
pub struct TileA<'a> {
    /// The storage the operand is a view of.
    pub data: &'a [f32],
    /// Where a(0, 0) is in `data`.
    pub offset: usize,
    /// Step in `data` from one row `i` to the next.
    pub row_stride: usize,
    /// Step in `data` from one column `p` to the next.
    pub col_stride: usize,
}

/// `b(p, j) = data[offset + p·row_stride + j]`: rows are contiguous runs.
#[derive(Clone, Copy, Debug)]
pub struct TileB<'a> {
    /// The storage the operand is a view of.
    pub data: &'a [f32],
    /// Where b(0, 0) is in `data`.
    pub offset: usize,
    /// Step in `data` from one row `p` to the next (a row's elements are adjacent).
    pub row_stride: usize,
}

/// `c[i·c_stride + j] = alpha·Σ_p a(i, p)·b(p, j)` (`+=` with [`Store::Accumulate`]) for
/// `i < m`, `j < n` of `dims`. Panics if an operand is too short for its strides.
pub fn tile_gemm(c: &mut [f32], c_stride: usize, a: TileA, b: TileB, dims: GemmDims, alpha: f32, store: Store) {
    let GemmDims { m, n, k } = dims;
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * c_stride + n <= c.len(), "tile_gemm: c too short");
    if k == 0 {
        if store == Store::Overwrite {
            (0..m).for_each(|i| c[i * c_stride..][..n].fill(0.0));
        }
        return;
    }
    // The bounds checks of every product (rows of b are contiguous: column stride 1).
    let fits = dims.check_lhs(a.data.len(), a.offset, (a.row_stride, a.col_stride));
    if let Err(message) = fits.and(dims.check_rhs(b.data.len(), b.offset, (b.row_stride, 1))) {
        panic!("tile_gemm: {message}");
    }
    columns_from(leading_wide_columns(c, c_stride, a, b, dims, alpha, store), (c, c_stride), a, b, dims, alpha, store);
}

/// Runs the AVX-512 kernel over the leading columns where the CPU has it; returns how many
/// columns of `c` it wrote (0 without AVX-512).
fn leading_wide_columns(
    c: &mut [f32],
    c_stride: usize,
    a: TileA,
    b: TileB,
    dims: GemmDims,
    alpha: f32,
    store: Store,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F, and tile_gemm asserted the operands' bounds.
        return unsafe { avx512::leading_columns(c, c_stride, a, b, dims, alpha, store) };
    }
    0
}

/// Columns `j0..n` of `c` (row stride `c_stride`) with 8-wide vectors, then scalar dot
/// products past the last multiple of 8. The caller has checked the operands' bounds.
fn columns_from(
    j0: usize,
    (c, c_stride): (&mut [f32], usize),
    a: TileA,
    b: TileB,
    dims: GemmDims,
    alpha: f32,
    store: Store,
) {
    let GemmDims { m, n, k } = dims;
    let vector_end = j0.max(n - n % LANES);
    let mut j = j0;
    while j < vector_end {
        let wide = vector_end - j >= 2 * LANES;
        let mut i = 0;
        while i < m {
            let rows = MR.min(m - i);
            // SAFETY: rows i..i + rows < m and columns j..j + 8·NV ≤ vector_end ≤ n of c, a
            // and b are within the bounds asserted above; c is exclusively borrowed.
            unsafe {
                let c_at = c.as_mut_ptr().add(i * c_stride + j);
                let a_at = a.data.as_ptr().add(a.offset + i * a.row_stride);
                let b_at = b.data.as_ptr().add(b.offset + j);
                let tile = Tile { c: c_at, c_stride, a: a_at, a_rs: a.row_stride, a_cs: a.col_stride, b: b_at };
                match (rows, wide) {
                    (6, true) => micro::<6, 2>(tile, b.row_stride, k, alpha, store),
                    (5, true) => micro::<5, 2>(tile, b.row_stride, k, alpha, store),
                    (4, true) => micro::<4, 2>(tile, b.row_stride, k, alpha, store),
                    (3, true) => micro::<3, 2>(tile, b.row_stride, k, alpha, store),
                    (2, true) => micro::<2, 2>(tile, b.row_stride, k, alpha, store),
                    (_, true) => micro::<1, 2>(tile, b.row_stride, k, alpha, store),
                    (6, false) => micro::<6, 1>(tile, b.row_stride, k, alpha, store),
                    (5, false) => micro::<5, 1>(tile, b.row_stride, k, alpha, store),
                    (4, false) => micro::<4, 1>(tile, b.row_stride, k, alpha, store),
                    (3, false) => micro::<3, 1>(tile, b.row_stride, k, alpha, store),
                    (2, false) => micro::<2, 1>(tile, b.row_stride, k, alpha, store),
                    (_, false) => micro::<1, 1>(tile, b.row_stride, k, alpha, store),
                }
            }
            i += rows;
        }
        j += if wide { 2 * LANES } else { LANES };
    }
    for i in 0..m {
        for j in vector_end..n {
            let dot: f32 = (0..k)
                .map(|p| {
                    a.data[a.offset + i * a.row_stride + p * a.col_stride] * b.data[b.offset + p * b.row_stride + j]
                })
                .sum();
            let out = &mut c[i * c_stride + j];
            *out = alpha * dot + if store.reads_dst() { *out } else { 0.0 };
        }
    }
}

/// The 16-lane kernel: 8 rows × 32 columns of `c` in sixteen `__m512` accumulators (of the
/// 32 registers AVX-512 has), the same loop as [`micro`] at twice the width.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{__m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps};
    use std::arch::x86_64::{_mm512_setzero_ps, _mm512_storeu_ps};

    use super::{GemmDims, Store, Tile, TileA, TileB};

    const LANES: usize = 16;
    const MR: usize = 8;

    /// Columns `0..n - n % 16` of `c`; returns that count.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, and the operands must pass `tile_gemm`'s bounds checks.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn leading_columns(
        c: &mut [f32],
        c_stride: usize,
        a: TileA,
        b: TileB,
        dims: GemmDims,
        alpha: f32,
        store: Store,
    ) -> usize {
        let GemmDims { m, n, k } = dims;
        let end = n - n % LANES;
        let mut j = 0;
        while j < end {
            let wide = end - j >= 2 * LANES;
            let mut i = 0;
            while i < m {
                let rows = MR.min(m - i);
                let c_at = c.as_mut_ptr().add(i * c_stride + j);
                let a_at = a.data.as_ptr().add(a.offset + i * a.row_stride);
                let b_at = b.data.as_ptr().add(b.offset + j);
                let t = Tile { c: c_at, c_stride, a: a_at, a_rs: a.row_stride, a_cs: a.col_stride, b: b_at };
                let s = b.row_stride;
                match (rows, wide) {
                    (8, true) => micro::<8, 2>(t, s, k, alpha, store),
                    (7, true) => micro::<7, 2>(t, s, k, alpha, store),
                    (6, true) => micro::<6, 2>(t, s, k, alpha, store),
                    (5, true) => micro::<5, 2>(t, s, k, alpha, store),
                    (4, true) => micro::<4, 2>(t, s, k, alpha, store),
                    (3, true) => micro::<3, 2>(t, s, k, alpha, store),
                    (2, true) => micro::<2, 2>(t, s, k, alpha, store),
                    (_, true) => micro::<1, 2>(t, s, k, alpha, store),
                    (8, false) => micro::<8, 1>(t, s, k, alpha, store),
                    (7, false) => micro::<7, 1>(t, s, k, alpha, store),
                    (6, false) => micro::<6, 1>(t, s, k, alpha, store),
                    (5, false) => micro::<5, 1>(t, s, k, alpha, store),
                    (4, false) => micro::<4, 1>(t, s, k, alpha, store),
                    (3, false) => micro::<3, 1>(t, s, k, alpha, store),
                    (2, false) => micro::<2, 1>(t, s, k, alpha, store),
                    (_, false) => micro::<1, 1>(t, s, k, alpha, store),
                }
                i += rows;
            }
            j += if wide { 2 * LANES } else { LANES };
        }
        end
    }

    /// One `R × 16·NV` tile of `c`, all of `k`.
    ///
    /// # Safety
    /// As `super::micro`, with 16-float rows, on a CPU with AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro<const R: usize, const NV: usize>(t: Tile, b_stride: usize, k: usize, alpha: f32, store: Store) {
        let mut acc: [[__m512; NV]; R] = [[_mm512_setzero_ps(); NV]; R];
        for p in 0..k {
            let b_row = t.b.add(p * b_stride);
            let mut bv: [__m512; NV] = [_mm512_setzero_ps(); NV];
            for (v, b) in bv.iter_mut().enumerate() {
                *b = _mm512_loadu_ps(b_row.add(v * LANES));
            }
            let a_col = t.a.add(p * t.a_cs);
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let s = _mm512_set1_ps(*a_col.add(r * t.a_rs));
                for (acc, &b) in acc_row.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(s, b, *acc);
                }
            }
        }
        let alpha = _mm512_set1_ps(alpha);
        for (r, acc_row) in acc.iter().enumerate() {
            for (v, &sum) in acc_row.iter().enumerate() {
                let at = t.c.add(r * t.c_stride + v * LANES);
                let out = if store.reads_dst() {
                    _mm512_fmadd_ps(sum, alpha, _mm512_loadu_ps(at))
                } else {
                    _mm512_mul_ps(sum, alpha)
                };
                _mm512_storeu_ps(at, out);
            }
        }
    }
}

/// Raw corners of one register tile.
#[derive(Clone, Copy)]
struct Tile {
    c: *mut f32,
    c_stride: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
}

/// One `R × 8·NV` tile of `c`, all of `k`.
///
/// # Safety
/// `t.c` must be valid for `R` rows of `8·NV` elements `t.c_stride` apart (exclusively
/// borrowed), `t.a` for `R × k` reads with its strides, `t.b` for `k` rows of `8·NV`
/// elements `b_stride` apart.
#[inline(always)]
unsafe fn micro<const R: usize, const NV: usize>(t: Tile, b_stride: usize, k: usize, alpha: f32, store: Store) {
    let mut acc = [[f32x8::ZERO; NV]; R];
    for p in 0..k {
        let b_row = t.b.add(p * b_stride);
        let bv: [f32x8; NV] = std::array::from_fn(|v| load_raw(b_row.add(v * LANES)));
        let a_col = t.a.add(p * t.a_cs);
        for (r, acc_row) in acc.iter_mut().enumerate() {
            let s = f32x8::splat(*a_col.add(r * t.a_rs));
            for (acc, &b) in acc_row.iter_mut().zip(&bv) {
                *acc = s.mul_add(b, *acc);
            }
        }
    }
    let alpha = f32x8::splat(alpha);
    for (r, acc_row) in acc.iter().enumerate() {
        for (v, &sum) in acc_row.iter().enumerate() {
            let at = t.c.add(r * t.c_stride + v * LANES);
            let out = if store.reads_dst() { sum.mul_add(alpha, load_raw(at)) } else { sum * alpha };
            (at as *mut [f32; LANES]).write_unaligned(out.to_array());
        }
    }
}

/// Eight consecutive floats at `p`.
///
/// # Safety
/// `p` must be valid for reading 8 `f32`s.
#[inline(always)]
unsafe fn load_raw(p: *const f32) -> f32x8 {
    f32x8::from((p as *const [f32; LANES]).read_unaligned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &TileA, b: &TileB, m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        a.data[a.offset + i * a.row_stride + p * a.col_stride] as f64
                            * b.data[b.offset + p * b.row_stride + j] as f64
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn matches_reference_for_every_edge() {
        for (m, n, k) in [(1, 1, 1), (6, 16, 5), (7, 17, 3), (13, 40, 33), (64, 64, 32), (5, 7, 9), (20, 24, 0)] {
            let a_data: Vec<f32> = (0..3 + m * k * 2).map(|i| ((i * 7) % 11) as f32 * 0.25 - 1.0).collect();
            let b_data: Vec<f32> = (0..2 + k * (n + 3)).map(|i| ((i * 5) % 13) as f32 * 0.5 - 3.0).collect();
            // a transposed and padded (row stride 1, column stride 2m), b with padded rows.
            let a = TileA { data: &a_data, offset: 3, row_stride: 1, col_stride: 2 * m };
            let b = TileB { data: &b_data, offset: 2, row_stride: n + 3 };
            let want = reference(&a, &b, m, n, k);
            let c_stride = n + 1;
            let mut c = vec![1.0f32; m * c_stride];
            tile_gemm(&mut c, c_stride, a, b, GemmDims { m, n, k }, 0.5, Store::Accumulate);
            for i in 0..m {
                for j in 0..n {
                    let expected = 1.0 + 0.5 * want[i * n + j];
                    assert!((c[i * c_stride + j] as f64 - expected).abs() < 1e-4, "{m}×{n}×{k} at ({i}, {j})");
                }
                if n < c_stride {
                    assert_eq!(c[i * c_stride + n], 1.0, "wrote past column n");
                }
            }
            tile_gemm(&mut c, c_stride, a, b, GemmDims { m, n, k }, 2.0, Store::Overwrite);
            for i in 0..m {
                for j in 0..n {
                    assert!((c[i * c_stride + j] as f64 - 2.0 * want[i * n + j]).abs() < 1e-4);
                }
            }
            // The 8-wide kernel alone over every column (what a CPU without AVX-512 runs).
            if k > 0 {
                columns_from(0, (&mut c, c_stride), a, b, GemmDims { m, n, k }, 2.0, Store::Overwrite);
                for i in 0..m {
                    for j in 0..n {
                        assert!((c[i * c_stride + j] as f64 - 2.0 * want[i * n + j]).abs() < 1e-4, "portable");
                    }
                }
            }
        }
    }
}
