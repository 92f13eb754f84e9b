//! Elementwise binary ops with broadcasting, plus the gradient-accumulation primitives
//! (`add_assign`, `axpy`) and `select`.
//!
//! PyTorch equivalents: `torch.add`, `sub`, `mul`, `div`, `maximum`, `minimum` (NaN
//! propagates, as in PyTorch), `torch.where(cond, a, b)`, and `dst.add_(src, alpha=α)`.
//!
//! Broadcasting is expressed with strides: an operand dimension of stride 0 repeats. The
//! output is contiguous. Dimensions of size 1 are dropped and neighbouring dimensions that
//! are contiguous in both operands are merged, so most calls collapse to one of:
//! - a single run: both operands contiguous (SIMD zip), or one of them a scalar;
//! - rows whose inner run is contiguous or constant in each operand: a bias `[C]` over
//!   `[N, C]`, or a per-row `[N, 1]` over `[N, C]`;
//! - anything else: an odometer over the outer dimensions with a strided inner loop.
//!
//! The backward of these ops lives in autograd (it is sums and products of these same
//! kernels); `add_assign` and `axpy` accumulate gradients: `dst += src`.

use wide::{f32x8, CmpEq};

use super::parallel;
use super::simd::{load, store, LANES};

/// An elementwise binary operator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a − b`.
    Sub,
    /// `a · b`.
    Mul,
    /// `a / b`.
    Div,
    /// `max(a, b)`.
    Maximum,
    /// `min(a, b)`.
    Minimum,
}

/// Scalar reference for one element: `a op b`.
pub fn binary_reference(op: Binary, a: f32, b: f32) -> f32 {
    match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::Maximum => maximum(a, b),
        Binary::Minimum => minimum(a, b),
    }
}

fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        a + b
    } else {
        a.max(b)
    }
}

fn minimum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        a + b
    } else {
        a.min(b)
    }
}

fn maximum8(a: f32x8, b: f32x8) -> f32x8 {
    (a.is_nan() | b.is_nan()).blend(a + b, a.max(b))
}

fn minimum8(a: f32x8, b: f32x8) -> f32x8 {
    (a.is_nan() | b.is_nan()).blend(a + b, a.min(b))
}

/// Runs `$body` with `$f8` (SIMD) and `$f1` (scalar) bound to the operator, so every kernel
/// below is compiled once per operator with the operator inlined into its loop.
macro_rules! with_op {
    ($op:expr, |$f8:ident, $f1:ident| $body:expr) => {
        match $op {
            Binary::Add => {
                let ($f8, $f1) = (|x: f32x8, y: f32x8| x + y, |x: f32, y: f32| x + y);
                $body
            }
            Binary::Sub => {
                let ($f8, $f1) = (|x: f32x8, y: f32x8| x - y, |x: f32, y: f32| x - y);
                $body
            }
            Binary::Mul => {
                let ($f8, $f1) = (|x: f32x8, y: f32x8| x * y, |x: f32, y: f32| x * y);
                $body
            }
            Binary::Div => {
                let ($f8, $f1) = (|x: f32x8, y: f32x8| x / y, |x: f32, y: f32| x / y);
                $body
            }
            Binary::Maximum => {
                let ($f8, $f1) = (maximum8, maximum);
                $body
            }
            Binary::Minimum => {
                let ($f8, $f1) = (minimum8, minimum);
                $body
            }
        }
    };
}

/// out (contiguous, shape out_shape) [idx] = a[a_offset + Σ idx_d·a_strides[d]] op b[...]; stride 0 = broadcast dim.
#[allow(clippy::too_many_arguments)]
pub fn binary_forward(
    op: Binary,
    a: &[f32],
    a_offset: usize,
    a_strides: &[usize],
    b: &[f32],
    b_offset: usize,
    b_strides: &[usize],
    out_shape: &[usize],
    out: &mut [f32],
) {
    let numel: usize = out_shape.iter().product();
    assert_eq!(out.len(), numel, "binary_forward: out has the wrong length");
    assert!(
        a_strides.len() == out_shape.len() && b_strides.len() == out_shape.len(),
        "binary_forward: strides and shape differ in rank"
    );
    if numel == 0 {
        return;
    }
    assert!(reach(a_offset, out_shape, a_strides) < a.len(), "binary_forward: a too short");
    assert!(reach(b_offset, out_shape, b_strides) < b.len(), "binary_forward: b too short");
    let dims = coalesce(out_shape, a_strides, b_strides);
    let (a, b) = (&a[a_offset..], &b[b_offset..]);
    with_op!(op, |f8, f1| match dims.split_last() {
        None => out[0] = f1(a[0], b[0]),
        Some((&inner, [])) => run_parallel(a, b, inner, out, f8, f1),
        Some((&inner, outer)) => rows(a, b, outer, inner, out, f8, f1),
    })
}

/// out[i] = x[i] op s
pub fn scalar_forward(op: Binary, x: &[f32], s: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "scalar_forward: x and out differ in length");
    let inner = Dim { size: x.len(), a: 1, b: 0 };
    with_op!(op, |f8, f1| run_parallel(x, &[s], inner, out, f8, f1))
}

/// dst[i] += src[i]   (gradient accumulation)
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    axpy(1.0, src, dst);
}

/// dst[i] += alpha * src[i]
pub fn axpy(alpha: f32, src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "axpy: src and dst differ in length");
    parallel::for_each_chunk_mut(dst, 1, |start, dst| {
        let src = &src[start..start + dst.len()];
        let simd_end = dst.len() - dst.len() % LANES;
        for i in (0..simd_end).step_by(LANES) {
            store(load(&src[i..]).mul_add(f32x8::splat(alpha), load(&dst[i..])), &mut dst[i..]);
        }
        for i in simd_end..dst.len() {
            dst[i] += alpha * src[i];
        }
    });
}

/// out[i] = if cond[i] != 0.0 { a[i] } else { b[i] } (a NaN condition is true).
pub fn select(cond: &[f32], a: &[f32], b: &[f32], out: &mut [f32]) {
    let n = out.len();
    assert!(cond.len() == n && a.len() == n && b.len() == n, "select: cond, a, b and out differ in length");
    parallel::for_each_chunk_mut(out, 1, |start, out| {
        let end = start + out.len();
        let (cond, a, b) = (&cond[start..end], &a[start..end], &b[start..end]);
        let simd_end = out.len() - out.len() % LANES;
        for i in (0..simd_end).step_by(LANES) {
            // `cond == 0` picks b, so a NaN condition counts as true, as in the scalar tail
            // and the GPU kernel (an ordered `cmp_ne` would call NaN false).
            let chosen = load(&cond[i..]).cmp_eq(f32x8::ZERO).blend(load(&b[i..]), load(&a[i..]));
            store(chosen, &mut out[i..]);
        }
        for i in simd_end..out.len() {
            out[i] = if cond[i] != 0.0 { a[i] } else { b[i] };
        }
    });
}

/// One output dimension with the stride each operand walks it with.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Dim {
    size: usize,
    a: usize,
    b: usize,
}

/// Largest index the strided view reaches (shape must be non-empty in every dimension).
fn reach(offset: usize, shape: &[usize], strides: &[usize]) -> usize {
    offset + shape.iter().zip(strides).map(|(&n, &s)| (n - 1) * s).sum::<usize>()
}

/// Drops size-1 dimensions and merges each dimension into its inner neighbour when both
/// operands step over it contiguously (or both broadcast it), outermost first.
fn coalesce(shape: &[usize], a_strides: &[usize], b_strides: &[usize]) -> Vec<Dim> {
    let mut dims: Vec<Dim> = Vec::with_capacity(shape.len());
    for ((&size, &a), &b) in shape.iter().zip(a_strides).zip(b_strides) {
        if size == 1 {
            continue;
        }
        let dim = Dim { size, a, b };
        match dims.last_mut() {
            Some(prev) if prev.a == a * size && prev.b == b * size => {
                *prev = Dim { size: prev.size * size, a, b };
            }
            _ => dims.push(dim),
        }
    }
    dims
}

/// A single strided run split across threads.
fn run_parallel<F8, F1>(a: &[f32], b: &[f32], inner: Dim, out: &mut [f32], f8: F8, f1: F1)
where
    F8: Fn(f32x8, f32x8) -> f32x8 + Copy + Sync + Send,
    F1: Fn(f32, f32) -> f32 + Copy + Sync + Send,
{
    parallel::for_each_chunk_mut(out, 1, |start, out| {
        let (a, b) = (&a[start * inner.a..], &b[start * inner.b..]);
        run(a, b, Dim { size: out.len(), ..inner }, out, f8, f1);
    });
}

/// Rows over the `outer` dimensions (walked with an odometer), one run of `inner` each.
fn rows<F8, F1>(a: &[f32], b: &[f32], outer: &[Dim], inner: Dim, out: &mut [f32], f8: F8, f1: F1)
where
    F8: Fn(f32x8, f32x8) -> f32x8 + Copy + Sync + Send,
    F1: Fn(f32, f32) -> f32 + Copy + Sync + Send,
{
    parallel::for_each_row_block_mut(out, inner.size, inner.size, |first_row, block| {
        // Decompose the first row's index, then step the odometer row by row.
        let mut index = vec![0; outer.len()];
        let (mut a_at, mut b_at, mut rest) = (0, 0, first_row);
        for (d, dim) in outer.iter().enumerate().rev() {
            index[d] = rest % dim.size;
            rest /= dim.size;
            a_at += index[d] * dim.a;
            b_at += index[d] * dim.b;
        }
        for out_row in block.chunks_mut(inner.size) {
            run(&a[a_at..], &b[b_at..], inner, out_row, f8, f1);
            for (d, dim) in outer.iter().enumerate().rev() {
                index[d] += 1;
                a_at += dim.a;
                b_at += dim.b;
                if index[d] < dim.size {
                    break;
                }
                index[d] = 0;
                a_at -= dim.a * dim.size;
                b_at -= dim.b * dim.size;
            }
        }
    });
}

/// `out[i] = a[i·dim.a] op b[i·dim.b]` for `i < out.len()`: SIMD when each stride is 0 or 1.
fn run<F8, F1>(a: &[f32], b: &[f32], dim: Dim, out: &mut [f32], f8: F8, f1: F1)
where
    F8: Fn(f32x8, f32x8) -> f32x8,
    F1: Fn(f32, f32) -> f32,
{
    let n = out.len();
    let simd_end = n - n % LANES;
    match (dim.a, dim.b) {
        (1, 1) => {
            for i in (0..simd_end).step_by(LANES) {
                store(f8(load(&a[i..]), load(&b[i..])), &mut out[i..]);
            }
            for i in simd_end..n {
                out[i] = f1(a[i], b[i]);
            }
        }
        (1, 0) => {
            let (s, s8) = (b[0], f32x8::splat(b[0]));
            for i in (0..simd_end).step_by(LANES) {
                store(f8(load(&a[i..]), s8), &mut out[i..]);
            }
            for i in simd_end..n {
                out[i] = f1(a[i], s);
            }
        }
        (0, 1) => {
            let (s, s8) = (a[0], f32x8::splat(a[0]));
            for i in (0..simd_end).step_by(LANES) {
                store(f8(s8, load(&b[i..])), &mut out[i..]);
            }
            for i in simd_end..n {
                out[i] = f1(s, b[i]);
            }
        }
        (sa, sb) => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f1(a[i * sa], b[i * sb]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: [Binary; 6] = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum];

    /// Row-major strides of `shape`, with broadcast dimensions (`keep[d] == false`) at 0.
    fn strides(shape: &[usize], keep: &[bool]) -> (Vec<usize>, usize) {
        let mut strides = vec![0; shape.len()];
        let mut len = 1;
        for d in (0..shape.len()).rev() {
            if keep[d] {
                strides[d] = len;
                len *= shape[d];
            }
        }
        (strides, len)
    }

    /// Naive reference: every output index decomposed independently.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        op: Binary,
        a: &[f32],
        a_offset: usize,
        a_strides: &[usize],
        b: &[f32],
        b_offset: usize,
        b_strides: &[usize],
        shape: &[usize],
    ) -> Vec<f32> {
        let numel: usize = shape.iter().product();
        (0..numel)
            .map(|flat| {
                let (mut rest, mut ia, mut ib) = (flat, a_offset, b_offset);
                for d in (0..shape.len()).rev() {
                    let i = rest % shape[d];
                    rest /= shape[d];
                    ia += i * a_strides[d];
                    ib += i * b_strides[d];
                }
                binary_reference(op, a[ia], b[ib])
            })
            .collect()
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 7 + seed * 13) % 23) as f32 * 0.5 - 5.25).collect()
    }

    proptest! {
        #[test]
        fn broadcasting_matches_naive(
            shape in prop::collection::vec(1usize..6, 0..5),
            keep_a in prop::collection::vec(any::<bool>(), 5),
            keep_b in prop::collection::vec(any::<bool>(), 5),
            op_index in 0usize..6,
            a_offset in 0usize..3,
        ) {
            let op = ALL[op_index];
            let (a_strides, a_len) = strides(&shape, &keep_a);
            let (b_strides, b_len) = strides(&shape, &keep_b);
            let a = values(a_len + a_offset, 1);
            let b = values(b_len, 2);
            let expected = naive(op, &a, a_offset, &a_strides, &b, 0, &b_strides, &shape);
            let mut out = vec![0.0; expected.len()];
            binary_forward(op, &a, a_offset, &a_strides, &b, 0, &b_strides, &shape, &mut out);
            prop_assert_eq!(out, expected);
        }

        #[test]
        fn contiguous_and_scalar_runs_match(len in 1usize..70, op_index in 0usize..6) {
            let op = ALL[op_index];
            let (a, b) = (values(len, 3), values(len, 4));
            let mut out = vec![0.0; len];
            binary_forward(op, &a, 0, &[1], &b, 0, &[1], &[len], &mut out);
            prop_assert_eq!(&out, &naive(op, &a, 0, &[1], &b, 0, &[1], &[len]));
            scalar_forward(op, &a, 1.5, &mut out);
            prop_assert_eq!(&out, &naive(op, &a, 0, &[1], &[1.5], 0, &[0], &[len]));
            binary_forward(op, &[2.5], 0, &[0], &b, 0, &[1], &[len], &mut out);
            prop_assert_eq!(&out, &naive(op, &[2.5], 0, &[0], &b, 0, &[1], &[len]));
        }

        #[test]
        fn accumulate_and_select_match_scalar(len in 1usize..70, alpha in -2.0f32..2.0) {
            let (src, cond) = (values(len, 5), values(len, 6));
            let mut dst = values(len, 7);
            let expected: Vec<f32> = dst.iter().zip(&src).map(|(d, s)| d + alpha * s).collect();
            axpy(alpha, &src, &mut dst);
            for (got, want) in dst.iter().zip(&expected) {
                prop_assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()));
            }
            let mut out = vec![0.0; len];
            select(&cond, &src, &expected, &mut out);
            for i in 0..len {
                prop_assert_eq!(out[i], if cond[i] != 0.0 { src[i] } else { expected[i] });
            }
        }
    }

    #[test]
    fn large_bias_and_row_broadcasts_match_naive() {
        let (n, c) = (3001, 67);
        let x = values(n * c, 1);
        let bias = values(c, 2);
        let per_row = values(n, 3);
        let mut out = vec![0.0; n * c];
        binary_forward(Binary::Add, &x, 0, &[c, 1], &bias, 0, &[0, 1], &[n, c], &mut out);
        assert_eq!(out, naive(Binary::Add, &x, 0, &[c, 1], &bias, 0, &[0, 1], &[n, c]));
        binary_forward(Binary::Div, &per_row, 0, &[1, 0], &x, 0, &[c, 1], &[n, c], &mut out);
        assert_eq!(out, naive(Binary::Div, &per_row, 0, &[1, 0], &x, 0, &[c, 1], &[n, c]));
        // A transposed operand goes through the strided fallback.
        binary_forward(Binary::Sub, &x, 0, &[1, c], &x, 0, &[1, c], &[c, n], &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        let mut acc = x.clone();
        add_assign(&mut acc, &x);
        assert!(acc.iter().zip(&x).all(|(a, b)| *a == 2.0 * b));
    }

    #[test]
    fn maximum_and_minimum_propagate_nan() {
        let a = [f32::NAN, 1.0, 2.0, -1.0, 5.0, 0.0, 3.0, 4.0, f32::NAN];
        let b = [0.0, f32::NAN, 3.0, -2.0, 5.0, 1.0, 2.0, 9.0, 1.0];
        let mut out = [0.0; 9];
        binary_forward(Binary::Maximum, &a, 0, &[1], &b, 0, &[1], &[9], &mut out);
        assert!(out[0].is_nan() && out[1].is_nan() && out[8].is_nan());
        assert_eq!(&out[2..8], &[3.0, -1.0, 5.0, 1.0, 3.0, 9.0]);
        binary_forward(Binary::Minimum, &a, 0, &[1], &b, 0, &[1], &[9], &mut out);
        assert!(out[0].is_nan() && out[1].is_nan() && out[8].is_nan());
        assert_eq!(&out[2..8], &[2.0, -2.0, 5.0, 0.0, 2.0, 4.0]);
    }

    #[test]
    fn select_treats_nan_as_true_in_vector_and_scalar_lanes() {
        let n = 19; // two 8-wide vectors and a scalar tail of 3
        let cond: Vec<f32> = (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    f32::NAN
                } else if i % 3 == 1 {
                    0.0
                } else {
                    -1.0
                }
            })
            .collect();
        let (a, b) = (vec![1.0; n], vec![2.0; n]);
        let mut out = vec![0.0; n];
        select(&cond, &a, &b, &mut out);
        let expected: Vec<f32> = cond.iter().map(|&c| if c != 0.0 { 1.0 } else { 2.0 }).collect();
        assert_eq!(out, expected);
    }
}
