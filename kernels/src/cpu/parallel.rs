//! When and how the CPU kernels use threads: one threshold and a few row-blocking helpers.
//!
//! Work is measured in element operations (≈ one multiply-add or one load of an f32).
//! Below [`MIN_PARALLEL_WORK`] a kernel runs on the calling thread, because waking the
//! rayon pool costs a few microseconds, more than a small loop. Above it the rows are cut
//! into blocks of about [`TASK_WORK`] each.
//!
//! Blocks are cut the same way whether they then run in parallel or one after another, and
//! partial results come back in block order, so a reduction over blocks gives bit-identical
//! results on any thread count.
//!
//! PyTorch equivalent: `at::parallel_for(begin, end, grain_size, f)` with
//! `at::internal::GRAIN_SIZE`.

use std::ops::Range;

use rayon::prelude::*;

/// An enumerated block of three outputs zipped together (`(index, ((a, b), c))`), as both
/// `rayon` and `std` iterators hand it out.
pub type Zip3<'a> = (usize, ((&'a mut [f32], &'a mut [f32]), &'a mut [f32]));

/// Total work below which a kernel stays on the calling thread.
pub const MIN_PARALLEL_WORK: usize = 1 << 15;

/// Work handed to one rayon task: large enough to amortise scheduling, small enough for
/// work stealing to even out rows of unequal cost.
pub const TASK_WORK: usize = 1 << 14;

/// Width of an `f32x8` register: element blocks are cut at multiples of it so that only the
/// last block has a scalar tail.
const LANES: usize = 8;

/// Whether a kernel doing `work` element operations should spread over the rayon pool.
pub fn should_parallelise(work: usize) -> bool {
    work >= MIN_PARALLEL_WORK && rayon::current_num_threads() > 1
}

/// Rows per block when each row costs `work_per_row`: about [`TASK_WORK`] per block, at
/// least one row.
pub fn rows_per_task(work_per_row: usize) -> usize {
    TASK_WORK.div_ceil(work_per_row.max(1))
}

/// Calls `f(first_row, block)` on consecutive blocks of whole rows of `out` (rows of `cols`
/// elements), in parallel when the total work is large enough.
pub fn for_each_row_block_mut<F>(out: &mut [f32], cols: usize, work_per_row: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    map_row_blocks_mut(out, cols, work_per_row, f);
}

/// Like [`for_each_row_block_mut`], but each block returns a value; the values come back in
/// row order (used for per-block partial sums such as a norm's weight gradient).
pub fn map_row_blocks_mut<T, F>(out: &mut [f32], cols: usize, work_per_row: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, &mut [f32]) -> T + Sync + Send,
{
    if cols == 0 || out.is_empty() {
        return Vec::new();
    }
    let rows = out.len() / cols;
    let block_rows = rows_per_task(work_per_row);
    let call = |(i, block): (usize, &mut [f32])| f(i * block_rows, block);
    if should_parallelise(rows.saturating_mul(work_per_row)) {
        out.par_chunks_mut(block_rows * cols).enumerate().map(call).collect()
    } else {
        out.chunks_mut(block_rows * cols).enumerate().map(call).collect()
    }
}

/// Calls `f(start, chunk)` on consecutive chunks of an elementwise output, each chunk a
/// multiple of the SIMD width except the last, in parallel when `out` is long enough.
pub fn for_each_chunk_mut<F>(out: &mut [f32], work_per_element: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    if out.is_empty() {
        return;
    }
    let chunk = rows_per_task(work_per_element).next_multiple_of(LANES);
    let call = |(i, part): (usize, &mut [f32])| f(i * chunk, part);
    if should_parallelise(out.len().saturating_mul(work_per_element)) {
        out.par_chunks_mut(chunk).enumerate().for_each(call);
    } else {
        out.chunks_mut(chunk).enumerate().for_each(call);
    }
}

/// [`for_each_chunk_mut`] over two equally long outputs cut at the same offsets (a parameter
/// and its momentum buffer).
pub fn for_each_chunk2_mut<F>(a: &mut [f32], b: &mut [f32], work_per_element: usize, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
{
    assert_eq!(a.len(), b.len(), "for_each_chunk2_mut: outputs differ in length");
    if a.is_empty() {
        return;
    }
    let chunk = rows_per_task(work_per_element).next_multiple_of(LANES);
    let call = |(i, (a, b)): (usize, (&mut [f32], &mut [f32]))| f(i * chunk, a, b);
    if should_parallelise(a.len().saturating_mul(work_per_element)) {
        a.par_chunks_mut(chunk).zip(b.par_chunks_mut(chunk)).enumerate().for_each(call);
    } else {
        a.chunks_mut(chunk).zip(b.chunks_mut(chunk)).enumerate().for_each(call);
    }
}

/// [`for_each_chunk_mut`] over three equally long outputs cut at the same offsets (a
/// parameter and its two Adam moments).
pub fn for_each_chunk3_mut<F>(a: &mut [f32], b: &mut [f32], c: &mut [f32], work_per_element: usize, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync + Send,
{
    assert!(a.len() == b.len() && a.len() == c.len(), "for_each_chunk3_mut: outputs differ in length");
    if a.is_empty() {
        return;
    }
    let chunk = rows_per_task(work_per_element).next_multiple_of(LANES);
    let call = |(i, ((a, b), c)): Zip3<'_>| f(i * chunk, a, b, c);
    if should_parallelise(a.len().saturating_mul(work_per_element)) {
        let ab = a.par_chunks_mut(chunk).zip(b.par_chunks_mut(chunk));
        ab.zip(c.par_chunks_mut(chunk)).enumerate().for_each(call);
    } else {
        let ab = a.chunks_mut(chunk).zip(b.chunks_mut(chunk));
        ab.zip(c.chunks_mut(chunk)).enumerate().for_each(call);
    }
}

/// Maps consecutive ranges of `0..rows` to values returned in order, for kernels that only
/// read (reductions); same blocking rule as [`map_row_blocks_mut`].
pub fn map_row_ranges<T, F>(rows: usize, work_per_row: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(Range<usize>) -> T + Sync + Send,
{
    let block_rows = rows_per_task(work_per_row);
    let blocks = rows.div_ceil(block_rows);
    let call = |i: usize| f(i * block_rows..((i + 1) * block_rows).min(rows));
    if should_parallelise(rows.saturating_mul(work_per_row)) {
        (0..blocks).into_par_iter().map(call).collect()
    } else {
        (0..blocks).map(call).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_cover_every_row_once_in_order() {
        for (rows, cols, work) in [(0, 3, 3), (1, 5, 5), (1000, 7, 7), (100_000, 3, 3)] {
            let mut out = vec![0.0f32; rows * cols];
            let firsts = map_row_blocks_mut(&mut out, cols, work, |first, block| {
                for (r, row) in block.chunks_mut(cols).enumerate() {
                    row.fill((first + r) as f32 + 1.0);
                }
                first
            });
            assert!(firsts.windows(2).all(|w| w[0] < w[1]));
            for (r, row) in out.chunks(cols).enumerate() {
                assert!(row.iter().all(|&v| v == (r + 1) as f32));
            }
        }
    }

    #[test]
    fn chunks_are_simd_aligned_and_cover_everything() {
        let mut out = vec![0.0f32; 100_003];
        for_each_chunk_mut(&mut out, 1, |start, part| {
            assert_eq!(start % LANES, 0);
            for (i, v) in part.iter_mut().enumerate() {
                *v += (start + i) as f32;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &v)| v == i as f32));
    }

    #[test]
    fn ranges_partition_rows() {
        let ranges = map_row_ranges(100_001, 1, |r| r);
        assert_eq!(ranges.first().map(|r| r.start), Some(0));
        assert_eq!(ranges.last().map(|r| r.end), Some(100_001));
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        assert!(map_row_ranges(0, 1, |r| r).is_empty());
    }
}
