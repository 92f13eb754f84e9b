//! Softmax and log-softmax over the last axis, rows of `cols` (x is `[N, C]`, N = len / C).
//!
//! softmax(x)_j = e^(x_j − m) / Σ_k e^(x_k − m), m = max_k x_k (the shift keeps e^· ≤ 1);
//! log_softmax(x)_j = x_j − m − ln Σ_k e^(x_k − m).
//!
//! PyTorch equivalents: `torch.softmax(x, -1)` and `torch.log_softmax(x, -1)`. The backward
//! reads only the saved output `y` and writes `dx = ...` (the crate's contract, see `lib.rs`).

use wide::f32x8;

use super::parallel;
use super::reduce::{dot, slice_max, slice_sum};
use super::simd::{exp8, load, store, LANES};

/// Rough cost of one element (an exponential and a few multiply-adds).
const WORK_PER_ELEMENT: usize = 8;

/// Sizes of one softmax or log-softmax call, shared by the CPU and CUDA kernels: every
/// operand is `[rows, cols]`. [`SoftmaxDims::of`] and [`SoftmaxDims::check`] are the one
/// validation both devices run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftmaxDims {
    /// Rows, each normalised on its own.
    pub rows: usize,
    /// The normalised width.
    pub cols: usize,
}

impl SoftmaxDims {
    /// The rows of `len` elements in rows of `cols`; the error says why they are not whole
    /// rows (no rows when both are 0).
    pub fn of(len: usize, cols: usize) -> Result<SoftmaxDims, String> {
        if cols == 0 && len > 0 {
            return Err("zero columns".into());
        }
        if cols > 0 && !len.is_multiple_of(cols) {
            return Err(format!("length {len} is not a multiple of cols {cols}"));
        }
        Ok(SoftmaxDims { rows: len.checked_div(cols).unwrap_or(0), cols })
    }

    /// Whether the other operands (name and length) have `rows·cols` elements each.
    pub fn check(&self, operands: &[(&str, usize)]) -> Result<(), String> {
        let want = self.rows * self.cols;
        match operands.iter().find(|&&(_, len)| len != want) {
            Some((name, len)) => Err(format!("{name} has {len} elements, expected {want}")),
            None => Ok(()),
        }
    }
}

/// y = softmax(x) over rows of `cols`.
pub fn softmax_forward(x: &[f32], cols: usize, y: &mut [f32]) {
    check("softmax_forward", (x.len(), cols), &[("y", y.len())]);
    parallel::for_each_row_block_mut(y, cols, cols * WORK_PER_ELEMENT, |first, block| {
        for (r, y) in block.chunks_mut(cols).enumerate() {
            let x = &x[(first + r) * cols..][..cols];
            let total = exp_shifted(x, slice_max(x), y);
            scale(y, 1.0 / total);
        }
    });
}

/// dx = y ⊙ (dy − Σ dy⊙y)
pub fn softmax_backward(y: &[f32], dy: &[f32], cols: usize, dx: &mut [f32]) {
    check("softmax_backward", (y.len(), cols), &[("dy", dy.len()), ("dx", dx.len())]);
    // d/dx_j Σ_i dy_i·y_i = y_j·(dy_j − Σ_i dy_i·y_i)
    parallel::for_each_row_block_mut(dx, cols, cols * 4, |first, block| {
        for (r, dx) in block.chunks_mut(cols).enumerate() {
            let at = (first + r) * cols;
            let (y, dy) = (&y[at..][..cols], &dy[at..][..cols]);
            let inner = dot(dy, y);
            let simd_end = cols - cols % LANES;
            for i in (0..simd_end).step_by(LANES) {
                store(load(&y[i..]) * (load(&dy[i..]) - inner), &mut dx[i..]);
            }
            for i in simd_end..cols {
                dx[i] = y[i] * (dy[i] - inner);
            }
        }
    });
}

/// y = log_softmax(x) over rows of `cols`.
pub fn log_softmax_forward(x: &[f32], cols: usize, y: &mut [f32]) {
    check("log_softmax_forward", (x.len(), cols), &[("y", y.len())]);
    parallel::for_each_row_block_mut(y, cols, cols * WORK_PER_ELEMENT, |first, block| {
        for (r, y) in block.chunks_mut(cols).enumerate() {
            let x = &x[(first + r) * cols..][..cols];
            let max = slice_max(x);
            let log_total = max + sum_exp(x, max).ln();
            let simd_end = cols - cols % LANES;
            for i in (0..simd_end).step_by(LANES) {
                store(load(&x[i..]) - log_total, &mut y[i..]);
            }
            for i in simd_end..cols {
                y[i] = x[i] - log_total;
            }
        }
    });
}

/// dx = dy − exp(y)·Σ dy
pub fn log_softmax_backward(y: &[f32], dy: &[f32], cols: usize, dx: &mut [f32]) {
    check("log_softmax_backward", (y.len(), cols), &[("dy", dy.len()), ("dx", dx.len())]);
    // d/dx_j Σ_i dy_i·(x_i − lse) = dy_j − softmax_j·Σ_i dy_i,  softmax = e^y
    parallel::for_each_row_block_mut(dx, cols, cols * WORK_PER_ELEMENT, |first, block| {
        for (r, dx) in block.chunks_mut(cols).enumerate() {
            let at = (first + r) * cols;
            let (y, dy) = (&y[at..][..cols], &dy[at..][..cols]);
            let total = slice_sum(dy);
            let simd_end = cols - cols % LANES;
            for i in (0..simd_end).step_by(LANES) {
                store(load(&dy[i..]) - exp8(load(&y[i..])) * total, &mut dx[i..]);
            }
            for i in simd_end..cols {
                dx[i] = dy[i] - y[i].exp() * total;
            }
        }
    });
}

/// Scalar reference softmax (tests and benches).
pub fn softmax_reference(x: &[f32], cols: usize) -> Vec<f32> {
    x.chunks(cols)
        .flat_map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
            let total: f32 = exps.iter().sum();
            exps.into_iter().map(move |e| e / total)
        })
        .collect()
}

/// Scalar reference log-softmax (tests and benches).
pub fn log_softmax_reference(x: &[f32], cols: usize) -> Vec<f32> {
    x.chunks(cols)
        .flat_map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
            row.iter().map(move |v| v - lse)
        })
        .collect()
}

/// Σ_j e^(x_j − shift); with `shift = max x` every term is in (0, 1]. Also used by the fused
/// cross-entropy.
pub fn sum_exp(x: &[f32], shift: f32) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = f32x8::ZERO;
    for i in (0..simd_end).step_by(LANES) {
        acc += exp8(load(&x[i..]) - shift);
    }
    acc.reduce_add() + x[simd_end..].iter().map(|v| (v - shift).exp()).sum::<f32>()
}

/// y_j = e^(x_j − shift); returns Σ y_j.
fn exp_shifted(x: &[f32], shift: f32, y: &mut [f32]) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = f32x8::ZERO;
    for i in (0..simd_end).step_by(LANES) {
        let e = exp8(load(&x[i..]) - shift);
        store(e, &mut y[i..]);
        acc += e;
    }
    let mut total = acc.reduce_add();
    for i in simd_end..x.len() {
        y[i] = (x[i] - shift).exp();
        total += y[i];
    }
    total
}

fn scale(y: &mut [f32], factor: f32) {
    let simd_end = y.len() - y.len() % LANES;
    for i in (0..simd_end).step_by(LANES) {
        store(load(&y[i..]) * factor, &mut y[i..]);
    }
    for v in &mut y[simd_end..] {
        *v *= factor;
    }
}

/// Panics naming `op` unless the input (`len` elements in rows of `cols`) is whole rows
/// ([`SoftmaxDims::of`]) and the other operands match it ([`SoftmaxDims::check`]).
fn check(op: &str, (len, cols): (usize, usize), operands: &[(&str, usize)]) {
    if let Err(message) = SoftmaxDims::of(len, cols).and_then(|dims| dims.check(operands)) {
        panic!("{op}: {message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, assert_within, gradient, oracle, Dtype, Tolerance};
    use proptest::prelude::*;

    fn row_values(len: usize, seed: u32) -> Vec<f32> {
        (0..len).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 * 0.01 - 5.0).collect()
    }

    proptest! {
        #[test]
        fn fast_paths_match_reference(rows in 1usize..5, cols in 1usize..70, seed in 0u32..100) {
            let x = row_values(rows * cols, seed);
            let mut y = vec![0.0; x.len()];
            softmax_forward(&x, cols, &mut y);
            assert_close("softmax", &y, &softmax_reference(&x, cols), Tolerance::uniform(1e-6));
            let mut log_y = vec![0.0; x.len()];
            log_softmax_forward(&x, cols, &mut log_y);
            assert_close("log_softmax", &log_y, &log_softmax_reference(&x, cols), Tolerance::uniform(1e-6));

            let dy = row_values(x.len(), seed + 7);
            // Stale (NaN) contents: the backward overwrites every element.
            let mut dx = vec![f32::NAN; x.len()];
            softmax_backward(&y, &dy, cols, &mut dx);
            for (r, row) in dx.chunks(cols).enumerate() {
                let (yr, dyr) = (&y[r * cols..][..cols], &dy[r * cols..][..cols]);
                let inner: f32 = yr.iter().zip(dyr).map(|(a, b)| a * b).sum();
                let want: Vec<f32> = yr.iter().zip(dyr).map(|(a, b)| a * (b - inner)).collect();
                assert_close("d softmax", row, &want, Tolerance::uniform(1e-5));
            }
            let mut dx = vec![f32::NAN; x.len()];
            log_softmax_backward(&log_y, &dy, cols, &mut dx);
            for (r, row) in dx.chunks(cols).enumerate() {
                let (yr, dyr) = (&log_y[r * cols..][..cols], &dy[r * cols..][..cols]);
                let total: f32 = dyr.iter().sum();
                let want: Vec<f32> = yr.iter().zip(dyr).map(|(a, b)| b - a.exp() * total).collect();
                assert_close("d log_softmax", row, &want, Tolerance::uniform(1e-5));
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let cols = 11;
        let x = row_values(cols, 3);
        let dy = row_values(cols, 9);
        let dy64 = oracle::widen(&dy);
        let loss = |x: &[f64], log: bool| -> f64 {
            let y = if log { oracle::log_softmax(x, cols) } else { oracle::softmax(x, cols) };
            oracle::dot(&y, &dy64)
        };
        for log in [false, true] {
            let mut y = vec![0.0; cols];
            let mut dx = vec![0.0; cols];
            if log {
                log_softmax_forward(&x, cols, &mut y);
                log_softmax_backward(&y, &dy, cols, &mut dx);
            } else {
                softmax_forward(&x, cols, &mut y);
                softmax_backward(&y, &dy, cols, &mut dx);
            }
            let numeric = gradient(&oracle::widen(&x), Dtype::F64, |x| loss(x, log));
            let what = if log { "d log_softmax" } else { "d softmax" };
            assert_within(what, oracle::widen(&dx), numeric, Dtype::F64.table().gradient);
        }
    }

    #[test]
    fn large_logits_and_many_rows() {
        let (rows, cols) = (300, 257);
        let x: Vec<f32> = row_values(rows * cols, 5).iter().map(|v| v * 40.0).collect();
        let mut y = vec![0.0; x.len()];
        softmax_forward(&x, cols, &mut y);
        assert_close("softmax", &y, &softmax_reference(&x, cols), Tolerance::uniform(1e-6));
        for row in y.chunks(cols) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        log_softmax_forward(&x, cols, &mut y);
        // y = x − lse cancels: the error scale is an ulp of x or lse, not of y.
        let want = log_softmax_reference(&x, cols);
        for (v, (a, b)) in x.iter().zip(y.iter().zip(&want)) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + v.abs() + b.abs()), "{v}: {a} vs {b}");
        }
        assert!(y.iter().all(|v| v.is_finite()));
    }
}
