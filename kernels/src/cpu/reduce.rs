//! Reductions over one axis of a contiguous tensor viewed as `[outer, n, inner]`, the squared
//! norm used for gradient clipping, and the SIMD row reductions other kernels share
//! ([`slice_sum`], [`slice_max`], [`dot`]).
//!
//! PyTorch equivalents: `x.sum(dim)`, `x.max(dim)` (values and first index of the maximum;
//! NaN counts as the maximum, as in PyTorch), and `torch.linalg.vector_norm(x)²`.
//!
//! Long sums are blocked (f32 SIMD inside a block, then f64 or f32 across blocks) so the
//! rounding error grows with the number of blocks rather than with `n`. These are forward
//! kernels; the backward of a sum is a broadcast, done with `binary`.

use rayon::prelude::*;
use wide::f32x8;

use super::parallel;
use super::simd::{load, LANES};

/// Elements summed in f32 before the running total takes over.
const SUM_BLOCK: usize = 1 << 12;
/// Rows added into a partial buffer before it is folded into the column totals.
const ROW_BLOCK: usize = 64;
/// Columns of `inner` per task at least: a 64-byte cache line.
const MIN_COLUMNS: usize = 16;

/// x viewed as [outer, n, inner] (contiguous); out[o*inner + i] = Σ_j x[(o*n + j)*inner + i]. out.len() == outer*inner.
pub fn sum_axis(x: &[f32], outer: usize, n: usize, inner: usize, out: &mut [f32]) {
    assert_eq!(x.len(), outer * n * inner, "sum_axis: x has the wrong length");
    assert_eq!(out.len(), outer * inner, "sum_axis: out has the wrong length");
    if inner == 1 {
        parallel::for_each_row_block_mut(out, 1, n, |first, block| {
            for (r, o) in block.iter_mut().enumerate() {
                *o = long_sum(&x[(first + r) * n..][..n]);
            }
        });
        return;
    }
    let work = n.min(parallel::TASK_WORK / MIN_COLUMNS);
    parallel::for_each_chunk_mut(out, work, |start, chunk| {
        for (o, i0, range) in segments(start, chunk.len(), inner) {
            let segment = &mut chunk[range];
            segment.fill(0.0);
            let mut partial = vec![0.0; segment.len()];
            for rows in (0..n).step_by(ROW_BLOCK) {
                partial.fill(0.0);
                for j in rows..(rows + ROW_BLOCK).min(n) {
                    add_into(&mut partial, &x[(o * n + j) * inner + i0..]);
                }
                add_into(segment, &partial);
            }
        }
    });
}

/// same layout; max and the index j of the first maximum.
pub fn max_axis(x: &[f32], outer: usize, n: usize, inner: usize, out: &mut [f32], argmax: &mut [usize]) {
    assert_eq!(x.len(), outer * n * inner, "max_axis: x has the wrong length");
    assert_eq!(out.len(), outer * inner, "max_axis: out has the wrong length");
    assert_eq!(argmax.len(), out.len(), "max_axis: argmax has the wrong length");
    assert!(n > 0 || out.is_empty(), "max_axis: empty axis");
    if out.is_empty() {
        return;
    }
    let chunk = parallel::rows_per_task(n).max(MIN_COLUMNS);
    let body = |(c, (out, argmax)): (usize, (&mut [f32], &mut [usize]))| {
        for (o, i0, range) in segments(c * chunk, out.len(), inner) {
            let (out, argmax) = (&mut out[range.clone()], &mut argmax[range]);
            if inner == 1 {
                let row = &x[o * n..][..n];
                argmax[0] = first_max_index(row);
                out[0] = row[argmax[0]];
                continue;
            }
            out.copy_from_slice(&x[o * n * inner + i0..][..out.len()]);
            argmax.fill(0);
            for j in 1..n {
                let row = &x[(o * n + j) * inner + i0..][..out.len()];
                for ((best, index), &v) in out.iter_mut().zip(argmax.iter_mut()).zip(row) {
                    if v > *best || (v.is_nan() && !best.is_nan()) {
                        *best = v;
                        *index = j;
                    }
                }
            }
        }
    };
    if parallel::should_parallelise(x.len()) {
        out.par_chunks_mut(chunk).zip(argmax.par_chunks_mut(chunk)).enumerate().for_each(body);
    } else {
        out.chunks_mut(chunk).zip(argmax.chunks_mut(chunk)).enumerate().for_each(body);
    }
}

/// Σ x[i]² accumulated in f64 (for global grad-norm clipping)
pub fn sum_squares(x: &[f32]) -> f64 {
    let blocks = parallel::map_row_ranges(x.len().div_ceil(SUM_BLOCK), SUM_BLOCK, |range| {
        let block = &x[range.start * SUM_BLOCK..(range.end * SUM_BLOCK).min(x.len())];
        // Four independent accumulators keep the f64 adds from serialising.
        let mut acc = [0.0f64; 4];
        let mut quads = block.chunks_exact(4);
        for q in &mut quads {
            for (a, &v) in acc.iter_mut().zip(q) {
                *a += f64::from(v) * f64::from(v);
            }
        }
        let tail: f64 = quads.remainder().iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        acc.iter().sum::<f64>() + tail
    });
    blocks.iter().sum()
}

/// Σ x[i] with f32x8 lanes (for short rows; see [`sum_axis`] for long ones).
pub fn slice_sum(x: &[f32]) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = f32x8::ZERO;
    for i in (0..simd_end).step_by(LANES) {
        acc += load(&x[i..]);
    }
    acc.reduce_add() + x[simd_end..].iter().sum::<f32>()
}

/// max x[i], or −∞ for an empty slice (a NaN may or may not win).
pub fn slice_max(x: &[f32]) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = f32x8::splat(f32::NEG_INFINITY);
    for i in (0..simd_end).step_by(LANES) {
        acc = acc.max(load(&x[i..]));
    }
    let simd_max = acc.to_array().into_iter().fold(f32::NEG_INFINITY, f32::max);
    x[simd_end..].iter().copied().fold(simd_max, f32::max)
}

/// Σ a[i]·b[i] with f32x8 lanes.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: a and b differ in length");
    let simd_end = a.len() - a.len() % LANES;
    let mut acc = f32x8::ZERO;
    for i in (0..simd_end).step_by(LANES) {
        acc = load(&a[i..]).mul_add(load(&b[i..]), acc);
    }
    let tail: f32 = a[simd_end..].iter().zip(&b[simd_end..]).map(|(x, y)| x * y).sum();
    acc.reduce_add() + tail
}

/// Sum of a long row: f32 SIMD per block of [`SUM_BLOCK`], blocks combined in f64 (in
/// parallel for very long rows, in a fixed order).
fn long_sum(row: &[f32]) -> f32 {
    let blocks = parallel::map_row_ranges(row.len().div_ceil(SUM_BLOCK), SUM_BLOCK, |range| {
        let block = &row[range.start * SUM_BLOCK..(range.end * SUM_BLOCK).min(row.len())];
        block.chunks(SUM_BLOCK).map(|b| f64::from(slice_sum(b))).sum::<f64>()
    });
    blocks.iter().sum::<f64>() as f32
}

/// `acc[i] += row[i]` for `i < acc.len()`.
fn add_into(acc: &mut [f32], row: &[f32]) {
    let simd_end = acc.len() - acc.len() % LANES;
    for i in (0..simd_end).step_by(LANES) {
        let sum = load(&acc[i..]) + load(&row[i..]);
        acc[i..i + LANES].copy_from_slice(sum.as_array_ref());
    }
    for i in simd_end..acc.len() {
        acc[i] += row[i];
    }
}

/// Splits the output range `start..start + len` (flat over `[outer, inner]`) into pieces
/// within one `o`: yields `(o, first i, range within the chunk)`.
fn segments(start: usize, len: usize, inner: usize) -> impl Iterator<Item = (usize, usize, std::ops::Range<usize>)> {
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= start + len {
            return None;
        }
        let (o, i0) = (at / inner, at % inner);
        let end = (at + inner - i0).min(start + len);
        let piece = (o, i0, at - start..end - start);
        at = end;
        Some(piece)
    })
}

/// Index of the first maximum, the first NaN if there is one.
fn first_max_index(row: &[f32]) -> usize {
    if let Some(nan) = row.iter().position(|v| v.is_nan()) {
        return nan;
    }
    let max = slice_max(row);
    row.iter().position(|&v| v == max).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(x: &[f32], outer: usize, n: usize, inner: usize) -> (Vec<f64>, Vec<f32>, Vec<usize>) {
        let mut sums = vec![0.0; outer * inner];
        let mut maxs = vec![f32::NEG_INFINITY; outer * inner];
        let mut args = vec![0; outer * inner];
        for o in 0..outer {
            for j in 0..n {
                for i in 0..inner {
                    let v = x[(o * n + j) * inner + i];
                    sums[o * inner + i] += v as f64;
                    if v > maxs[o * inner + i] || (v.is_nan() && !maxs[o * inner + i].is_nan()) {
                        maxs[o * inner + i] = v;
                        args[o * inner + i] = j;
                    }
                }
            }
        }
        (sums, maxs, args)
    }

    fn values(len: usize) -> Vec<f32> {
        // Repeated values so "first maximum" is exercised.
        (0..len).map(|i| ((i * 37) % 11) as f32 - 5.0).collect()
    }

    fn check(outer: usize, n: usize, inner: usize) {
        let x = values(outer * n * inner);
        let (sums, maxs, args) = reference(&x, outer, n, inner);
        let mut out = vec![0.0; outer * inner];
        sum_axis(&x, outer, n, inner, &mut out);
        for (got, want) in out.iter().zip(&sums) {
            assert!((*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{got} vs {want}");
        }
        let mut argmax = vec![0; outer * inner];
        max_axis(&x, outer, n, inner, &mut out, &mut argmax);
        assert_eq!(out, maxs);
        assert_eq!(argmax, args);
    }

    proptest! {
        #[test]
        fn axes_match_reference(outer in 1usize..5, n in 1usize..40, inner in 1usize..20) {
            check(outer, n, inner);
        }

        #[test]
        fn row_helpers_match_scalar(len in 0usize..70) {
            let x = values(len);
            let y: Vec<f32> = x.iter().map(|v| v * 0.5 + 1.0).collect();
            prop_assert_eq!(slice_sum(&x), x.iter().sum::<f32>());
            prop_assert_eq!(slice_max(&x), x.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let want: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
            prop_assert!((dot(&x, &y) - want).abs() <= 1e-5 * (1.0 + want.abs()));
            let squares: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
            prop_assert_eq!(sum_squares(&x), squares);
        }
    }

    #[test]
    fn large_axes_match_reference() {
        check(1, 100_000, 1);
        check(3, 5000, 40);
        check(2000, 3, 17);
        check(1, 20_000, 300);
    }

    #[test]
    fn nan_is_the_maximum() {
        let x = [1.0, f32::NAN, 3.0, f32::NAN];
        let (mut out, mut arg) = ([0.0], [0]);
        max_axis(&x, 1, 4, 1, &mut out, &mut arg);
        assert!(out[0].is_nan());
        assert_eq!(arg[0], 1);
    }

    #[test]
    fn long_sums_stay_accurate() {
        let x = vec![0.1f32; 1 << 20];
        let mut out = [0.0];
        sum_axis(&x, 1, x.len(), 1, &mut out);
        let want = 0.1f32 as f64 * x.len() as f64;
        assert!((out[0] as f64 - want).abs() < 1e-5 * want);
        let squares = 0.1f32 as f64 * 0.1f32 as f64 * x.len() as f64;
        assert!((sum_squares(&x) - squares).abs() < 1e-12 * squares);
    }
}
