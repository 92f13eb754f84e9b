//! Matrix multiply through the `gemm` crate: `dst = lhs · rhs`, or `dst += lhs · rhs` with
//! [`Store::Accumulate`].
//!
//! Operands are described by row and column strides, so transposed operands cost nothing:
//! `Aᵀ` is `A` with its strides swapped. [`Store::Accumulate`] (BLAS's β = 1) is for
//! building blocks that sum several products into one buffer, such as the convolution's
//! weight gradient over the images of a run; gradients themselves are written (`lib.rs`).
//! (`gemm` adds a read `dst` into its sum before its later blocks of k, so `dst + A·B` here
//! need not have the bits of `A·B` added to `dst` after.)
//!
//! PyTorch equivalent: `torch.addmm(dst, lhs, rhs)`.

use gemm::Parallelism;
use rayon::prelude::*;

/// A strided matrix operand: `data[offset + i·row_stride + j·col_stride]` is element (i, j).
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The storage the matrix is a view of.
    pub data: &'a [f32],
    /// Where element (0, 0) is in `data`.
    pub offset: usize,
    /// Step in `data` from one row to the next (negative for a reversed view).
    pub row_stride: isize,
    /// Step in `data` from one column to the next.
    pub col_stride: isize,
}

/// Sizes of one product `dst[m×n] = lhs[m×k]·rhs[k×n]`, shared by the CPU kernels
/// ([`matmul`], `tile_gemm`) and the GPU products (`cuda::blas`, which take the same struct).
/// [`GemmDims::check_dst`], [`GemmDims::check_lhs`] and [`GemmDims::check_rhs`] are the
/// bounds checks both devices run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmDims {
    /// Rows of `dst` and of `lhs`.
    pub m: usize,
    /// Columns of `dst` and of `rhs`.
    pub n: usize,
    /// The inner dimension: columns of `lhs`, rows of `rhs`.
    pub k: usize,
}

impl GemmDims {
    /// True when the output has no elements.
    pub fn is_empty(&self) -> bool {
        self.m == 0 || self.n == 0
    }

    /// Whether `len` elements hold the row-major contiguous `m×n` output from `offset`; the
    /// error says what does not.
    pub fn check_dst(&self, len: usize, offset: usize) -> Result<(), String> {
        let GemmDims { m, n, .. } = *self;
        if len >= offset + m * n {
            Ok(())
        } else {
            Err(format!("dst too short for {m}×{n} at {offset}"))
        }
    }

    /// Whether `lhs` (`m×k`, element (i, p) at `offset + i·strides.0 + p·strides.1`) stays
    /// inside its `len` elements.
    pub fn check_lhs(&self, len: usize, offset: usize, strides: (usize, usize)) -> Result<(), String> {
        operand_fits("lhs", (self.m, self.k), len, offset, strides)
    }

    /// Whether `rhs` (`k×n`, element (p, j) at `offset + p·strides.0 + j·strides.1`) stays
    /// inside its `len` elements.
    pub fn check_rhs(&self, len: usize, offset: usize, strides: (usize, usize)) -> Result<(), String> {
        operand_fits("rhs", (self.k, self.n), len, offset, strides)
    }
}

/// Whether a strided `rows×cols` operand named `what` stays inside its `len` elements.
fn operand_fits(
    what: &str,
    (rows, cols): (usize, usize),
    len: usize,
    offset: usize,
    strides: (usize, usize),
) -> Result<(), String> {
    let last = offset + rows.saturating_sub(1) * strides.0 + cols.saturating_sub(1) * strides.1;
    if rows == 0 || cols == 0 || last < len {
        Ok(())
    } else {
        Err(format!("{what} out of bounds"))
    }
}

/// Below this many multiply-adds a single thread is faster than waking the pool.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// Rows (or columns) of `dst` per task when the output is cut into blocks.
const OUT_BLOCK: usize = 512;

/// Depth per task when the inner dimension is cut (weight gradients: `Xᵀ·dY` over tokens).
/// A 16 × 256-token batch is then two tasks: measured on the llama-tiny weight gradients
/// (2 threads), 2048 is 8-15 % faster than 1024 (fewer `gemm` calls and partial sums).
const DEPTH_BLOCK: usize = 2048;

/// How one product is cut into independent single-threaded `gemm` calls.
///
/// The cut depends only on the shape, never on the thread count, so results are
/// bit-identical on any number of threads (each output element is always computed by the
/// same calls in the same order). Tasks run on the rayon pool with work stealing: on a
/// machine shared with other processes a descheduled thread's blocks are taken over by the
/// other, where `gemm`'s own threading splits the work once, evenly, and waits for the
/// slowest thread (measured: 10-35 % faster on the llama-tiny shapes with 2 threads).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Split {
    /// One call.
    None,
    /// Blocks of `OUT_BLOCK` rows of `dst`.
    Rows,
    /// Blocks of `OUT_BLOCK` columns of `dst`.
    Columns,
    /// Blocks of `DEPTH_BLOCK` along k, each into its own `m × n` buffer, summed in order.
    Depth,
}

fn split_for(m: usize, n: usize, k: usize) -> Split {
    if m * n * k < PARALLEL_MIN_FLOPS {
        Split::None
    } else if k >= 2 * DEPTH_BLOCK && k >= 4 * m.max(n) {
        Split::Depth
    } else if m > OUT_BLOCK && m >= n {
        Split::Rows
    } else if n > OUT_BLOCK {
        Split::Columns
    } else {
        Split::None
    }
}

/// What a product does with its destination: overwrite it (`C = A·B`, BLAS's β = 0), or add
/// onto it (`C += A·B`, β = 1) in a building block that sums several products into one
/// buffer (the convolution's weight gradient over a run of images, attention's tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// `C = A·B`: the destination's contents are ignored.
    Overwrite,
    /// `C += A·B`.
    Accumulate,
}

impl Store {
    /// Whether the destination's old contents are read (BLAS's β = 1).
    pub(crate) fn reads_dst(self) -> bool {
        self == Store::Accumulate
    }
}

/// `dst[m×n] = lhs[m×k] · rhs[k×n]` (or `+=` with [`Store::Accumulate`]), with `dst`
/// row-major contiguous at `dst_offset`.
///
/// Panics if an operand's strides reach outside its slice: callers (the tensor crate)
/// check shapes and return errors before calling.
pub fn matmul(dst: &mut [f32], dst_offset: usize, lhs: MatRef, rhs: MatRef, dims: GemmDims, store: Store) {
    let Some(dst) = checked_dst(dst, dst_offset, &lhs, &rhs, dims, store) else {
        return;
    };
    let GemmDims { m, n, k } = dims;
    let parallel = m * n * k >= PARALLEL_MIN_FLOPS && rayon::current_num_threads() > 1;
    match split_for(m, n, k) {
        Split::None => {
            let parallelism =
                if parallel { Parallelism::Rayon(rayon::current_num_threads()) } else { Parallelism::None };
            // SAFETY: dst is an exclusively borrowed m×n row-major block; lhs and rhs were
            // bounds-checked above for m×k and k×n.
            unsafe { gemm_block(dst.as_mut_ptr(), n, lhs, rhs, dims, store, parallelism) }
        }
        Split::Rows => {
            let block = |(i, rows): (usize, &mut [f32])| {
                let lhs = MatRef { offset: offset_by(lhs.offset, i * OUT_BLOCK, lhs.row_stride), ..lhs };
                // SAFETY: `rows` is this task's own run of whole dst rows (row stride n);
                // the lhs rows it reads lie inside the m×k block checked above.
                unsafe {
                    gemm_block(
                        rows.as_mut_ptr(),
                        n,
                        lhs,
                        rhs,
                        GemmDims { m: rows.len() / n, ..dims },
                        store,
                        Parallelism::None,
                    )
                }
            };
            if parallel {
                dst.par_chunks_mut(OUT_BLOCK * n).enumerate().for_each(block);
            } else {
                dst.chunks_mut(OUT_BLOCK * n).enumerate().for_each(block);
            }
        }
        Split::Columns => {
            let dst = SendPtr(dst.as_mut_ptr());
            let block = |j: usize| {
                let cols = OUT_BLOCK.min(n - j * OUT_BLOCK);
                let rhs = MatRef { offset: offset_by(rhs.offset, j * OUT_BLOCK, rhs.col_stride), ..rhs };
                // SAFETY: task j writes only columns j·OUT_BLOCK .. + cols of the m×n dst,
                // which no other task touches; the rhs columns lie inside the checked block.
                unsafe {
                    let at = dst.get().add(j * OUT_BLOCK);
                    gemm_block(at, n, lhs, rhs, GemmDims { n: cols, ..dims }, store, Parallelism::None)
                }
            };
            let blocks = n.div_ceil(OUT_BLOCK);
            if parallel {
                (0..blocks).into_par_iter().for_each(block);
            } else {
                (0..blocks).for_each(block);
            }
        }
        Split::Depth => {
            // Part p = lhs[:, p·D..] · rhs[p·D.., :]; part 0 goes (or adds) straight into dst.
            let part = |p: usize, out: &mut [f32], store: Store| {
                let depth = DEPTH_BLOCK.min(k - p * DEPTH_BLOCK);
                let lhs = MatRef { offset: offset_by(lhs.offset, p * DEPTH_BLOCK, lhs.col_stride), ..lhs };
                let rhs = MatRef { offset: offset_by(rhs.offset, p * DEPTH_BLOCK, rhs.row_stride), ..rhs };
                // SAFETY: `out` is an exclusively borrowed m×n buffer; the operands' depth
                // slices lie inside the m×k and k×n blocks checked above.
                unsafe {
                    gemm_block(out.as_mut_ptr(), n, lhs, rhs, GemmDims { k: depth, ..dims }, store, Parallelism::None)
                }
            };
            let parts = k.div_ceil(DEPTH_BLOCK);
            let mut partials = vec![0.0f32; (parts - 1) * m * n];
            let run = |(p, out): (usize, &mut [f32])| part(p + 1, out, Store::Overwrite);
            if parallel {
                rayon::join(|| part(0, dst, store), || partials.par_chunks_mut(m * n).enumerate().for_each(run));
            } else {
                part(0, dst, store);
                partials.chunks_mut(m * n).enumerate().for_each(run);
            }
            for partial in partials.chunks(m * n) {
                super::binary::add_assign(dst, partial);
            }
        }
    }
}

/// [`matmul`] on the calling thread alone, for callers that already run one task per block
/// of rows (the fused gated projection multiplies each block while the block's gate pass
/// waits for it in cache).
pub fn matmul_serial(dst: &mut [f32], dst_offset: usize, lhs: MatRef, rhs: MatRef, dims: GemmDims, store: Store) {
    if let Some(dst) = checked_dst(dst, dst_offset, &lhs, &rhs, dims, store) {
        // SAFETY: dst is an exclusively borrowed m×n row-major block; lhs and rhs were
        // bounds-checked for m×k and k×n.
        unsafe { gemm_block(dst.as_mut_ptr(), dims.n, lhs, rhs, dims, store, Parallelism::None) }
    }
}

/// Checks the operands and returns the `m×n` block of `dst`, or `None` when there is nothing
/// left to multiply (an empty output, or `k = 0`, which zeroes `dst` unless accumulating).
fn checked_dst<'a>(
    dst: &'a mut [f32],
    dst_offset: usize,
    lhs: &MatRef,
    rhs: &MatRef,
    dims: GemmDims,
    store: Store,
) -> Option<&'a mut [f32]> {
    if dims.is_empty() {
        return None;
    }
    let GemmDims { m, n, k } = dims;
    if let Err(message) = dims.check_dst(dst.len(), dst_offset) {
        panic!("matmul: {message}");
    }
    check_bounds(&dims, lhs, "lhs");
    check_bounds(&dims, rhs, "rhs");
    let dst = &mut dst[dst_offset..dst_offset + m * n];
    if k == 0 {
        if store == Store::Overwrite {
            dst.fill(0.0);
        }
        return None;
    }
    Some(dst)
}

/// A raw output pointer handed to tasks that write disjoint parts of it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used for column blocks that never overlap (see `Split::Columns`).
unsafe impl Send for SendPtr {}
// SAFETY: as above; tasks write disjoint elements.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `offset + index·stride` for a non-negative stride (checked in `check_bounds`).
fn offset_by(offset: usize, index: usize, stride: isize) -> usize {
    offset + index * stride as usize
}

/// One `gemm` call: `dst = lhs·rhs` (`+=` with [`Store::Accumulate`]) for an `m×n` block of a row-major buffer with row
/// stride `dst_stride`.
///
/// # Safety
/// `dst` must be valid for writes of the `m×n` block (rows `dst_stride` apart) and not
/// aliased by another thread; `lhs` and `rhs` must cover `m×k` and `k×n` elements from
/// their offsets with their strides.
unsafe fn gemm_block(
    dst: *mut f32,
    dst_stride: usize,
    lhs: MatRef,
    rhs: MatRef,
    GemmDims { m, n, k }: GemmDims,
    store: Store,
    parallelism: Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_stride as isize,
        store.reads_dst(),
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

/// [`GemmDims::check_lhs`] or [`GemmDims::check_rhs`] (`what`), after the CPU's own
/// condition: non-negative strides.
fn check_bounds(dims: &GemmDims, mat: &MatRef, what: &str) {
    assert!(mat.row_stride >= 0 && mat.col_stride >= 0, "matmul: negative stride in {what}");
    let fits = if what == "lhs" { GemmDims::check_lhs } else { GemmDims::check_rhs };
    if let Err(message) = fits(dims, mat.data.len(), mat.offset, (mat.row_stride as usize, mat.col_stride as usize)) {
        panic!("matmul: {message}");
    }
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
        matmul(&mut dst, 0, contiguous(&a, k), contiguous(&b, n), GemmDims { m, n, k }, Store::Overwrite);
        assert_eq!(dst, expected);
        matmul(&mut dst, 0, contiguous(&a, k), contiguous(&b, n), GemmDims { m, n, k }, Store::Accumulate);
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
        matmul(&mut dst, 0, contiguous(&a, k), rhs, GemmDims { m, n, k }, Store::Overwrite);
        assert_eq!(dst, expected);
    }

    /// Small integers keep every product exact, so any summation order gives the same bits.
    fn exact_operands(m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let a = (0..m * k).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let b = (0..k * n).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        (a, b)
    }

    #[test]
    fn every_split_matches_the_reference_and_accumulates() {
        // (m, n, k) → Rows, Columns, Depth (k = 2·DEPTH_BLOCK + 40, a short last part), None.
        for (m, n, k, split) in [
            (OUT_BLOCK * 2 + 37, 24, 33, Split::Rows),
            (20, OUT_BLOCK + 9, 40, Split::Columns),
            (30, 17, 2 * DEPTH_BLOCK + 40, Split::Depth),
            (40, 40, 40, Split::None),
        ] {
            assert_eq!(split_for(m, n, k), split, "{m}×{n}×{k}");
            let (a, b) = exact_operands(m, n, k);
            // Transposed lhs (as in a weight gradient Xᵀ·dY) and an offset into dst.
            let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            let lhs = MatRef { data: &at, offset: 0, row_stride: 1, col_stride: m as isize };
            let expected = matmul_reference(&a, &b, m, n, k);
            let mut dst = vec![1.0; 3 + m * n];
            matmul(&mut dst, 3, lhs, contiguous(&b, n), GemmDims { m, n, k }, Store::Overwrite);
            assert_eq!(dst[3..], expected[..], "{split:?}");
            matmul(&mut dst, 3, lhs, contiguous(&b, n), GemmDims { m, n, k }, Store::Accumulate);
            let doubled: Vec<f32> = expected.iter().map(|x| 2.0 * x).collect();
            assert_eq!(dst[3..], doubled[..], "{split:?} accumulate");
            assert_eq!(dst[..3], [1.0; 3], "{split:?} wrote before dst_offset");
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (m, n, k) = (300, 40, 2 * DEPTH_BLOCK + 100);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 1000) as f32 / 991.0 - 0.5).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut dst = vec![0.0; m * n];
            pool.install(|| {
                matmul(&mut dst, 0, contiguous(&a, k), contiguous(&b, n), GemmDims { m, n, k }, Store::Overwrite)
            });
            dst
        };
        assert_eq!(run(1), run(3));
    }
}
