//! Forward values against reference implementations written here as plain loops in f64:
//! every unary op (including extreme ranges and the SIMD tail), broadcasting binary ops,
//! fused SwiGLU gating, reductions, matmul, softmax/log-softmax, cross-entropy with ignore_index, RMSNorm,
//! LayerNorm, rotary embedding (rotate-half, θ = 10000), embedding, causal attention
//! (explicit masked softmax), cat, views of non-contiguous tensors, bf16/f16 round trips,
//! and the error messages of mismatched shapes.

use autograd::Var;
use proptest::prelude::*;
use tensor::ops::{Binary, Unary};
use tensor::{DType, Tensor};
use transponder_tests::*;

const CASES: u32 = 32;

// ---------------------------------------------------------------------------------------
// Index helpers for the references.

/// Multi-index of flat row-major position `flat` in `shape`.
fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

/// Flat row-major position of `idx` in `shape`.
fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// Flat position in an operand of `shape` read at output index `out_idx` under
/// broadcasting (right-aligned, size-1 dims pinned to 0).
fn broadcast_source(out_idx: &[usize], shape: &[usize]) -> usize {
    let lead = out_idx.len() - shape.len();
    let idx: Vec<usize> = shape.iter().enumerate().map(|(d, &n)| if n == 1 { 0 } else { out_idx[lead + d] }).collect();
    ravel(&idx, shape)
}

// ---------------------------------------------------------------------------------------
// Unary ops.

/// erfc in f64: Taylor series of erf near 0, continued fraction in the tail (both far
/// more accurate than the f32 result under test).
fn erfc(t: f64) -> f64 {
    if t.abs() <= 3.0 {
        let (mut term, mut sum) = (t, t);
        for n in 1..80 {
            term *= -t * t / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        return 1.0 - sum * std::f64::consts::FRAC_2_SQRT_PI;
    }
    let a = t.abs();
    let mut f = a;
    for n in (1..120).rev() {
        f = a + (n as f64 / 2.0) / f;
    }
    let tail = (-a * a).exp() / std::f64::consts::PI.sqrt() / f;
    if t > 0.0 {
        tail
    } else {
        2.0 - tail
    }
}

fn unary_reference(op: Unary, x: f64) -> f64 {
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    match op {
        Unary::Neg => -x,
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Sqrt => x.sqrt(),
        Unary::Rsqrt => 1.0 / x.sqrt(),
        Unary::Abs => x.abs(),
        Unary::Sigmoid => sigmoid(x),
        Unary::Tanh => x.tanh(),
        Unary::Relu => x.max(0.0),
        Unary::Silu => x * sigmoid(x),
        Unary::Gelu => x * 0.5 * erfc(-x * std::f64::consts::FRAC_1_SQRT_2),
        Unary::GeluTanh => {
            let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (sqrt_2_over_pi * (x + 0.044715 * x * x * x)).tanh())
        }
        Unary::Powf(p) => x.powf(p as f64),
        Unary::Square => x * x,
    }
}

/// `n` values `±10^u`, u uniform in `[lo_exp, hi_exp]` (magnitudes over many decades).
fn log_uniform(n: usize, lo_exp: f32, hi_exp: f32, signed: bool) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        (lo_exp..=hi_exp, any::<bool>()).prop_map(move |(u, neg)| {
            let v = 10f32.powf(u);
            if signed && neg {
                -v
            } else {
                v
            }
        }),
        n,
    )
}

/// Every unary op with the range its reference is compared on: wide, saturating ranges
/// (tinygrad's "extreme ranges") and lengths that exercise both the SIMD body and the tail.
fn unary_cases() -> Vec<(Unary, BoxedStrategy<Vec<f32>>)> {
    let len = 1..=40usize;
    let uniform = |lo: f32, hi: f32| len.clone().prop_flat_map(move |n| values(n, lo, hi)).boxed();
    let decades =
        |lo: f32, hi: f32, signed: bool| len.clone().prop_flat_map(move |n| log_uniform(n, lo, hi, signed)).boxed();
    vec![
        (Unary::Neg, uniform(-100.0, 100.0)),
        (Unary::Exp, uniform(-100.0, 88.0)),
        (Unary::Exp, uniform(-1.0, 1.0)),
        (Unary::Log, decades(-30.0, 30.0, false)),
        (Unary::Sqrt, decades(-30.0, 30.0, false)),
        (Unary::Rsqrt, decades(-30.0, 30.0, false)),
        (Unary::Abs, uniform(-100.0, 100.0)),
        (Unary::Sigmoid, uniform(-60.0, 60.0)),
        (Unary::Sigmoid, uniform(-2.0, 2.0)),
        (Unary::Tanh, uniform(-20.0, 20.0)),
        (Unary::Tanh, uniform(-1.0, 1.0)),
        (Unary::Relu, uniform(-100.0, 100.0)),
        (Unary::Silu, uniform(-60.0, 60.0)),
        (Unary::Gelu, uniform(-12.0, 12.0)),
        (Unary::Gelu, uniform(-2.0, 2.0)),
        (Unary::GeluTanh, uniform(-12.0, 12.0)),
        (Unary::Powf(2.0), uniform(-10.0, 10.0)),
        (Unary::Powf(0.5), decades(-6.0, 6.0, false)),
        (Unary::Powf(-1.5), decades(-3.0, 3.0, false)),
        (Unary::Powf(3.0), uniform(-10.0, 10.0)),
        (Unary::Square, uniform(-100.0, 100.0)),
    ]
}

/// The op on `x` against the reference: ~1-2 ulp for the transcendental functions
/// (rtol), an absolute floor for results near 0 (where only absolute error is meaningful).
fn check_unary(op: Unary, x: &[f32]) {
    let t = tensor(x.to_vec(), &[x.len()]);
    let got = ok("unary", t.unary(op)).to_vec();
    let expected: Vec<f64> = x.iter().map(|&v| unary_reference(op, v as f64)).collect();
    assert_close(&format!("{op:?} on {x:?}"), &got, &expected, 4e-6, 1e-6);
}

#[test]
fn unary_ops_match_references() {
    for (op, strategy) in unary_cases() {
        // A fresh runner per op: a runner counts successes across runs, so a reused one
        // would run no cases after the first op.
        let mut runner = proptest::test_runner::TestRunner::new(config(CASES));
        let cases = std::cell::Cell::new(0u32);
        runner
            .run(&strategy, |x| {
                check_unary(op, &x);
                cases.set(cases.get() + 1);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{op:?}: {e}"));
        assert!(cases.get() >= config(CASES).cases, "{op:?}: only {} cases ran", cases.get());
    }
}

#[test]
fn unary_special_values() {
    check_unary(Unary::Log, &[0.0, -1.0, f32::INFINITY, 1.0]);
    check_unary(Unary::Exp, &[89.0, 100.0, f32::NEG_INFINITY, 0.0, -200.0, 88.5, 1.0, 2.0, 3.0]);
    check_unary(Unary::Sqrt, &[0.0, -1.0, 4.0]);
    check_unary(Unary::Sigmoid, &[-1e4, 1e4, 0.0, -90.0, 90.0, 1.0, 2.0, 3.0, 4.0]);
    check_unary(Unary::Tanh, &[-1e4, 1e4, 0.0, 1e-20, -0.625, 0.625, 0.624_999_9, 5.0, 9.0]);
    check_unary(
        Unary::Gelu,
        &[-1e4, 1e4, 0.0, -std::f32::consts::SQRT_2, std::f32::consts::SQRT_2, -30.0, 30.0, 0.5, 9.0],
    );
    check_unary(Unary::Silu, &[-1e4, 1e4, 0.0, -100.0, 100.0, 1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn unary_ops_on_long_vectors_match_the_scalar_path() {
    // Long enough to be split over threads: chunk boundaries must not shift or skip elements.
    let n = 200_003;
    let x = seeded(&[n], -5.0, 5.0, 17);
    let xs = x.to_vec();
    for op in [Unary::Exp, Unary::Tanh, Unary::Gelu, Unary::Relu, Unary::Silu] {
        let got = ok("unary", x.unary(op)).to_vec();
        let expected: Vec<f64> = xs.iter().map(|&v| unary_reference(op, v as f64)).collect();
        assert_close(&format!("{op:?} on {n} values"), &got, &expected, 4e-6, 1e-6);
    }
}

// ---------------------------------------------------------------------------------------
// Binary ops, scalar ops, select.

fn binary_reference(op: Binary, a: f32, b: f32) -> f32 {
    match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::Maximum => a.max(b),
        Binary::Minimum => a.min(b),
    }
}

const BINARY_OPS: [Binary; 6] = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum];

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn binary_ops_broadcast_exactly((a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| (
        tensor_in(sa, Domain::Uniform(-10.0, 10.0)),
        tensor_in(sb, Domain::AwayFromZero(0.1, 10.0)),
    ))) {
        let out_shape = broadcast_shape(a.shape(), b.shape());
        let (av, bv) = (a.to_vec(), b.to_vec());
        for op in BINARY_OPS {
            let y = ok("binary", a.binary(&b, op));
            prop_assert_eq!(y.shape(), out_shape.as_slice());
            let expected: Vec<f32> = (0..numel(&out_shape)).map(|i| {
                let idx = unravel(i, &out_shape);
                binary_reference(op, av[broadcast_source(&idx, a.shape())], bv[broadcast_source(&idx, b.shape())])
            }).collect();
            // IEEE + − × ÷ are correctly rounded: the kernel must agree bit for bit.
            prop_assert_eq!(y.to_vec(), expected, "{:?} {:?} {:?}", op, a.shape(), b.shape());
        }
    }

    #[test]
    fn scalar_ops_are_exact(x in shape().prop_flat_map(|s| tensor_in(s, Domain::Uniform(-10.0, 10.0))), s in -5.0f32..5.0) {
        for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Maximum, Binary::Minimum] {
            let expected: Vec<f32> = x.to_vec().iter().map(|&v| binary_reference(op, v, s)).collect();
            prop_assert_eq!(ok("scalar_op", x.scalar_op(op, s)).to_vec(), expected, "{:?}", op);
        }
    }

    #[test]
    fn select_picks_by_condition((cond, a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| {
        let full = broadcast_shape(&sa, &sb);
        let cond = prop::collection::vec(prop::bool::ANY, numel(&full))
            .prop_map(move |bits| tensor(bits.iter().map(|&c| if c { 2.5 } else { 0.0 }).collect(), &full));
        (cond, tensor_in(sa, Domain::Uniform(-3.0, 3.0)), tensor_in(sb, Domain::Uniform(-3.0, 3.0)))
    })) {
        let y = ok("select", Tensor::select(&cond, &a, &b));
        let shape = cond.shape().to_vec();
        let (c, av, bv) = (cond.to_vec(), a.to_vec(), b.to_vec());
        let expected: Vec<f32> = (0..numel(&shape)).map(|i| {
            let idx = unravel(i, &shape);
            if c[i] != 0.0 { av[broadcast_source(&idx, a.shape())] } else { bv[broadcast_source(&idx, b.shape())] }
        }).collect();
        prop_assert_eq!(y.to_vec(), expected);
    }

    #[test]
    fn sum_to_shape_undoes_broadcasting((a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| {
        let full = broadcast_shape(&sa, &sb);
        (tensor_in(full, Domain::Uniform(-2.0, 2.0)), Just(sa))
    })) {
        let reduced = ok("sum_to_shape", a.sum_to_shape(&b));
        prop_assert_eq!(reduced.shape(), b.as_slice());
        let mut expected = vec![0.0f64; numel(&b)];
        for (i, v) in a.to_vec().iter().enumerate() {
            expected[broadcast_source(&unravel(i, a.shape()), &b)] += *v as f64;
        }
        assert_close("sum_to_shape", &reduced.to_vec(), &expected, 1e-5, 1e-5);
    }
}

#[test]
fn binary_ops_on_long_vectors() {
    let n = 150_001;
    let a = seeded(&[n], -4.0, 4.0, 1);
    let b = seeded(&[1, n], 0.5, 4.0, 2);
    let y = ok("div", a.div(&b));
    assert_eq!(y.shape(), &[1, n]);
    let expected: Vec<f32> = a.to_vec().iter().zip(b.to_vec()).map(|(x, y)| x / y).collect();
    assert_eq!(y.to_vec(), expected);
}

// ---------------------------------------------------------------------------------------
// SwiGLU gating: silu(g) ⊙ u in one op.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn swiglu_matches_silu_times_up((g, u) in shape().prop_flat_map(|s| (
        tensor_in(s.clone(), Domain::Uniform(-60.0, 60.0)),
        tensor_in(s, Domain::Uniform(-4.0, 4.0)),
    ))) {
        let expected: Vec<f64> =
            g.to_vec().iter().zip(u.to_vec()).map(|(&g, u)| unary_reference(Unary::Silu, g as f64) * u as f64).collect();
        let y = ok("swiglu", g.swiglu(&u));
        prop_assert_eq!(y.shape(), g.shape());
        assert_close("swiglu", &y.to_vec(), &expected, 4e-6, 1e-6);
        // Strided views are read like their contiguous copies.
        let strided = ok("swiglu", non_contiguous(&g).swiglu(&non_contiguous(&u)));
        assert_close_f32("swiglu (non-contiguous)", &strided.to_vec(), &y.to_vec(), 0.0, 0.0);
    }
}

#[test]
fn swiglu_special_values_and_long_vectors() {
    // Saturation both ways, in the SIMD body (first 8) and the scalar tail (last one).
    let g = tensor(vec![-1e4, 1e4, 0.0, -100.0, 100.0, -90.0, 90.0, 1.0, -100.0], &[9]);
    let u = tensor(vec![2.0, -3.0, 5.0, 1.5, -0.5, 4.0, 1.0, 2.0, -7.0], &[9]);
    let check = |g: &Tensor, u: &Tensor, what: &str| {
        let expected: Vec<f64> = g
            .to_vec()
            .iter()
            .zip(u.to_vec())
            .map(|(&g, u)| unary_reference(Unary::Silu, g as f64) * u as f64)
            .collect();
        assert_close(what, &ok("swiglu", g.swiglu(u)).to_vec(), &expected, 4e-6, 1e-6);
    };
    check(&g, &u, "swiglu at ±1e4, ±100, ±90");
    // Long enough to be split over threads.
    let n = 200_003;
    check(&seeded(&[n], -8.0, 8.0, 31), &seeded(&[n], -2.0, 2.0, 32), &format!("swiglu on {n} values"));
}

// ---------------------------------------------------------------------------------------
// Reductions.

/// `(outer, n, inner)` around `axis`.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (numel(&shape[..axis]), shape[axis], numel(&shape[axis + 1..]))
}

fn reduced_shape(shape: &[usize], axis: usize, keepdim: bool) -> Vec<usize> {
    let mut s = shape.to_vec();
    if keepdim {
        s[axis] = 1;
    } else {
        s.remove(axis);
    }
    s
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn reductions_match_loops(((shape, axis), keepdim, seed) in (shape_and_axis(), any::<bool>(), any::<u64>())) {
        let x = seeded(&shape, -3.0, 3.0, seed);
        let xs = x.to_vec();
        let (outer, n, inner) = split(&shape, axis);
        let out_shape = reduced_shape(&shape, axis, keepdim);
        let mut sum = vec![0.0f64; outer * inner];
        let mut max = vec![(f32::NEG_INFINITY, 0usize); outer * inner];
        for o in 0..outer {
            for j in 0..n {
                for i in 0..inner {
                    let v = xs[(o * n + j) * inner + i];
                    sum[o * inner + i] += v as f64;
                    if v > max[o * inner + i].0 {
                        max[o * inner + i] = (v, j);
                    }
                }
            }
        }
        let s = ok("sum_axis", x.sum_axis(axis, keepdim));
        prop_assert_eq!(s.shape(), out_shape.as_slice());
        assert_close("sum_axis", &s.to_vec(), &sum, 1e-5, 1e-5);

        let m = ok("mean_axis", x.mean_axis(axis, keepdim));
        prop_assert_eq!(m.shape(), out_shape.as_slice());
        let mean: Vec<f64> = sum.iter().map(|v| v / n as f64).collect();
        assert_close("mean_axis", &m.to_vec(), &mean, 1e-5, 1e-5);

        let (mx, argmax) = ok("max_axis", x.max_axis(axis, keepdim));
        prop_assert_eq!(mx.shape(), out_shape.as_slice());
        prop_assert_eq!(mx.to_vec(), max.iter().map(|p| p.0).collect::<Vec<_>>());
        prop_assert_eq!(argmax, max.iter().map(|p| p.1).collect::<Vec<_>>());

        let all = ok("sum_all", x.sum_all());
        prop_assert_eq!(all.shape(), &[] as &[usize]);
        assert_close("sum_all", &all.to_vec(), &[xs.iter().map(|&v| v as f64).sum()], 1e-5, 1e-4);
    }
}

#[test]
fn max_axis_takes_the_first_of_tied_maxima() {
    let x = tensor(vec![1.0, 4.0, 4.0, -1.0, -1.0, -1.0], &[2, 3]);
    let (m, argmax) = ok("max_axis", x.max_axis(1, true));
    assert_eq!(m.shape(), &[2, 1]);
    assert_eq!(m.to_vec(), vec![4.0, -1.0]);
    assert_eq!(argmax, vec![1, 0]);
}

#[test]
fn long_reductions_keep_f32_accuracy() {
    let n = 100_000;
    let x = seeded(&[3, n], 0.0, 1.0, 8);
    let xs = x.to_vec();
    let expected: Vec<f64> = (0..3).map(|r| xs[r * n..(r + 1) * n].iter().map(|&v| v as f64).sum()).collect();
    assert_close("sum of 1e5 values", &ok("sum_axis", x.sum_axis(1, false)).to_vec(), &expected, 1e-5, 0.0);
}

// ---------------------------------------------------------------------------------------
// Matmul.

/// `a[..., m, k] · b[..., k, n]` with broadcast batch dimensions, in f64.
fn matmul_reference(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let batch = broadcast_shape(&a.shape()[..ra - 2], &b.shape()[..rb - 2]);
    let (av, bv) = (a.to_vec(), b.to_vec());
    let mut out = Vec::new();
    for bi in 0..numel(&batch) {
        let idx = unravel(bi, &batch);
        let oa = broadcast_source(&idx, &a.shape()[..ra - 2]) * m * k;
        let ob = broadcast_source(&idx, &b.shape()[..rb - 2]) * k * n;
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|p| av[oa + i * k + p] as f64 * bv[ob + p * n + j] as f64).sum());
            }
        }
    }
    ([batch.as_slice(), &[m, n]].concat(), out)
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn matmul_matches_loops(((ba, bb), m, k, n, seed, strided) in (
        broadcast_pair_from(shape_with_rank(0..=2)), 1..=6usize, 1..=6usize, 1..=6usize, any::<u64>(), any::<(bool, bool)>(),
    )) {
        let mut a = seeded(&[ba.as_slice(), &[m, k]].concat(), -2.0, 2.0, seed);
        let mut b = seeded(&[bb.as_slice(), &[k, n]].concat(), -2.0, 2.0, seed ^ 7);
        if strided.0 { a = non_contiguous(&a); }
        if strided.1 { b = non_contiguous(&b); }
        let (shape, expected) = matmul_reference(&a, &b);
        let y = ok("matmul", a.matmul(&b));
        prop_assert_eq!(y.shape(), shape.as_slice());
        assert_close("matmul", &y.to_vec(), &expected, 1e-5, 1e-5);
    }
}

#[test]
fn large_matmul_with_transposed_operands() {
    // Big enough for the multi-threaded gemm path.
    let a = seeded(&[2, 96, 64], -1.0, 1.0, 3);
    let w = seeded(&[80, 96], -1.0, 1.0, 4);
    let check = |what: &str, lhs: &Tensor, rhs: &Tensor| {
        let y = ok(what, lhs.matmul(rhs));
        let (shape, expected) = matmul_reference(lhs, rhs);
        assert_eq!(y.shape(), shape.as_slice(), "{what}");
        assert_close(what, &y.to_vec(), &expected, 1e-4, 1e-4);
    };
    for (what, lhs) in [("a", a.clone()), ("non-contiguous a", non_contiguous(&a))] {
        // w · a: a 2-D lhs broadcast over a's batch.
        check(&format!("w · {what}"), &w, &lhs);
        // aᵀ · wᵀ: both operands transposed views, read in place.
        let a_t = ok("transpose", lhs.transpose(1, 2));
        let w_t = ok("transpose", w.transpose(0, 1));
        check(&format!("{what}ᵀ · wᵀ"), &a_t, &w_t);
    }
}

// ---------------------------------------------------------------------------------------
// Softmax family and cross-entropy.

fn log_sum_exp(row: &[f32]) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn softmax_and_log_softmax_match_loops(x in shape().prop_flat_map(|s| tensor_in(s, Domain::Uniform(-30.0, 30.0)))) {
        let cols = *x.shape().last().unwrap();
        let xs = x.to_vec();
        let mut soft = Vec::new();
        let mut log_soft = Vec::new();
        for row in xs.chunks(cols) {
            let lse = log_sum_exp(row);
            for &v in row {
                log_soft.push(v as f64 - lse);
                soft.push((v as f64 - lse).exp());
            }
        }
        let y = ok("softmax", x.softmax());
        prop_assert_eq!(y.shape(), x.shape());
        assert_close("softmax", &y.to_vec(), &soft, 1e-5, 1e-7);
        assert_close("log_softmax", &ok("log_softmax", x.log_softmax()).to_vec(), &log_soft, 1e-5, 1e-5);
    }

    #[test]
    fn cross_entropy_matches_loops((x, targets, ignore) in (1..=6usize, 1..=7usize, 0..3u8).prop_flat_map(|(rows, vocab, mode)| {
        let ignore = [Some(vocab as u32), Some(0), None][mode as usize];
        let target = prop_oneof![3 => 0..vocab as u32, 1 => Just(ignore.unwrap_or(0))];
        (tensor_in(vec![rows, vocab], Domain::Uniform(-8.0, 8.0)), prop::collection::vec(target, rows), Just(ignore))
    })) {
        let vocab = x.shape()[1];
        let xs = x.to_vec();
        let (mut total, mut count, mut lses) = (0.0f64, 0usize, Vec::new());
        for (row, &t) in xs.chunks(vocab).zip(&targets) {
            let lse = log_sum_exp(row);
            lses.push(lse);
            if Some(t) != ignore {
                total += lse - row[t as usize] as f64;
                count += 1;
            }
        }
        let out = ok("cross_entropy", x.cross_entropy(&targets, ignore));
        prop_assert_eq!(out.count, count);
        let expected = if count == 0 { 0.0 } else { total / count as f64 };
        assert_close("cross_entropy loss", &[ok("loss", out.loss_value())], &[expected], 1e-5, 1e-5);
        // The lse of ignored rows is never read; the counted rows' must be right.
        let counted: Vec<usize> = (0..targets.len()).filter(|&r| Some(targets[r]) != ignore).collect();
        let lse = out.lse.to_vec();
        let got: Vec<f32> = counted.iter().map(|&r| lse[r]).collect();
        let want: Vec<f64> = counted.iter().map(|&r| lses[r]).collect();
        assert_close("cross_entropy lse", &got, &want, 1e-5, 1e-5);
    }
}

#[test]
fn softmax_is_stable_for_huge_logits() {
    let x = tensor(vec![1000.0, 0.0, -1000.0, 1e30, 1e30, -1e30], &[2, 3]);
    // (1e30 + ln 2 is 1e30 in f32, so the loss uses moderate logits for its second row.)
    assert_close("softmax", &ok("softmax", x.softmax()).to_vec(), &[1.0, 0.0, 0.0, 0.5, 0.5, 0.0], 1e-6, 1e-7);
    let ls = ok("log_softmax", x.log_softmax()).to_vec();
    assert_close("log_softmax", &ls[..2], &[0.0, -1000.0], 1e-6, 1e-6);
    let y = tensor(vec![1000.0, 0.0, -1000.0, 50.0, 50.0, -50.0], &[2, 3]);
    let ce = ok("cross_entropy", y.cross_entropy(&[1, 0], None));
    assert_close(
        "cross_entropy",
        &[ok("loss", ce.loss_value())],
        &[(1000.0 + std::f64::consts::LN_2) / 2.0],
        1e-6,
        1e-4,
    );
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let x = Tensor::zeros(&[2, 3]);
    let err = x.cross_entropy(&[0, 3], None).err().expect("target 3 of 3 classes must be rejected");
    assert!(err.to_string().contains("cross_entropy"), "{err}");
    assert!(x.cross_entropy(&[0], None).is_err(), "one target for two rows must be rejected");
    assert!(x.cross_entropy(&[0, 3], Some(3)).is_ok(), "an ignored out-of-range target is fine");
}

// ---------------------------------------------------------------------------------------
// Norms.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn rms_norm_matches_loops((x, w) in (shape_with_rank(0..=2), 1..=9usize).prop_flat_map(|(lead, c)| (
        tensor_in([lead.as_slice(), &[c]].concat(), Domain::Uniform(-3.0, 3.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
    ))) {
        let eps = 1e-5;
        let cols = w.numel();
        let (xs, ws) = (x.to_vec(), w.to_vec());
        let (mut y, mut rstd) = (Vec::new(), Vec::new());
        for row in xs.chunks(cols) {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
            let r = 1.0 / (ms + eps as f64).sqrt();
            rstd.push(r);
            y.extend(row.iter().zip(&ws).map(|(&v, &g)| v as f64 * r * g as f64));
        }
        let out = ok("rms_norm", x.rms_norm(&w, eps));
        prop_assert_eq!(out.y.shape(), x.shape());
        assert_close("rms_norm y", &out.y.to_vec(), &y, 1e-5, 1e-5);
        assert_close("rms_norm rstd", &out.rstd.to_vec(), &rstd, 1e-5, 1e-5);
    }

    #[test]
    fn layer_norm_matches_loops((x, w, b, affine) in (shape_with_rank(0..=2), 1..=9usize).prop_flat_map(|(lead, c)| (
        tensor_in([lead.as_slice(), &[c]].concat(), Domain::Uniform(-3.0, 3.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
        any::<(bool, bool)>(),
    ))) {
        let eps = 1e-5;
        let cols = w.numel();
        let (xs, ws, bs) = (x.to_vec(), w.to_vec(), b.to_vec());
        let (mut y, mut means, mut rstds) = (Vec::new(), Vec::new(), Vec::new());
        for row in xs.chunks(cols) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
            let rstd = 1.0 / (var + eps as f64).sqrt();
            means.push(mean);
            rstds.push(rstd);
            for (i, &v) in row.iter().enumerate() {
                let scale = if affine.0 { ws[i] as f64 } else { 1.0 };
                let shift = if affine.1 { bs[i] as f64 } else { 0.0 };
                y.push((v as f64 - mean) * rstd * scale + shift);
            }
        }
        let out = ok("layer_norm", x.layer_norm(affine.0.then_some(&w), affine.1.then_some(&b), eps));
        prop_assert_eq!(out.y.shape(), x.shape());
        // rstd reaches 1/√eps ≈ 316 on constant rows: relative error there is what counts.
        assert_close("layer_norm y", &out.y.to_vec(), &y, 1e-4, 1e-4);
        assert_close("layer_norm mean", &out.mean.to_vec(), &means, 1e-5, 1e-5);
        assert_close("layer_norm rstd", &out.rstd.to_vec(), &rstds, 1e-4, 1e-4);
    }
}

#[test]
fn layer_norm_is_accurate_for_rows_with_a_large_mean() {
    // A one-pass E[x²] − E[x]² variance in f32 cancels catastrophically here; PyTorch and
    // llm.c subtract the mean first.
    let (rows, cols) = (4, 16);
    let noise = seeded(&[rows, cols], -1.0, 1.0, 12).to_vec();
    let xs: Vec<f32> = noise.iter().map(|v| 1000.0 + v).collect();
    let x = tensor(xs.clone(), &[rows, cols]);
    let out = ok("layer_norm", x.layer_norm(None, None, 1e-5));
    let mut expected = Vec::new();
    for row in xs.chunks(cols) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
        expected.extend(row.iter().map(|&v| (v as f64 - mean) / (var + 1e-5).sqrt()));
    }
    assert_close("layer_norm of 1000 + noise", &out.y.to_vec(), &expected, 1e-3, 1e-3);
}

#[test]
fn norms_reject_wrong_weight_shapes() {
    let x = Tensor::ones(&[2, 4]);
    let err = x.rms_norm(&Tensor::ones(&[3]), 1e-5).err().expect("weight [3] for rows of 4");
    assert!(err.to_string().contains("rms_norm") && err.to_string().contains("[3]"), "{err}");
    assert!(x.layer_norm(None, Some(&Tensor::ones(&[5])), 1e-5).is_err());
}

// ---------------------------------------------------------------------------------------
// Rotary embedding, embedding lookup, causal attention.

/// Rotate-half RoPE (HF LLaMA): pairs (i, i + D/2) rotate by (pos_offset + t)·θ^(−2i/D).
fn rope_reference(x: &Tensor, theta: f64, pos_offset: usize) -> Vec<f64> {
    let (s, xs) = (x.shape().to_vec(), x.to_vec());
    let (b, t, h, d) = (s[0], s[1], s[2], s[3]);
    let half = d / 2;
    let mut y = vec![0.0; xs.len()];
    for bi in 0..b {
        for ti in 0..t {
            let pos = (pos_offset + ti) as f64;
            for hi in 0..h {
                let base = ((bi * t + ti) * h + hi) * d;
                for i in 0..half {
                    let angle = pos * theta.powf(-2.0 * i as f64 / d as f64);
                    let (x1, x2) = (xs[base + i] as f64, xs[base + i + half] as f64);
                    y[base + i] = x1 * angle.cos() - x2 * angle.sin();
                    y[base + i + half] = x2 * angle.cos() + x1 * angle.sin();
                }
            }
        }
    }
    y
}

/// softmax(q·kᵀ·scale, masked to keys at or before each query's position)·v, queries
/// being the last Tq of Tk positions. Returns the output and the per-query lse `[B, H, Tq]`.
fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (qs, ks, vs) = (q.to_vec(), k.to_vec(), v.to_vec());
    let (b, tq, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let tk = k.shape()[1];
    let mut out = vec![0.0; qs.len()];
    let mut lses = vec![0.0; b * h * tq];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..tq {
                let qi = ((bi * tq + i) * h + hi) * d;
                let visible = tk - tq + i + 1;
                let scores: Vec<f64> = (0..visible)
                    .map(|j| {
                        let kj = ((bi * tk + j) * h + hi) * d;
                        (0..d).map(|c| qs[qi + c] as f64 * ks[kj + c] as f64).sum::<f64>() * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                lses[(bi * h + hi) * tq + i] = m + z.ln();
                for (j, s) in scores.iter().enumerate() {
                    let p = (s - m).exp() / z;
                    let vj = ((bi * tk + j) * h + hi) * d;
                    for c in 0..d {
                        out[qi + c] += p * vs[vj + c] as f64;
                    }
                }
            }
        }
    }
    (out, lses)
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn rope_matches_rotate_half((x, pos_offset, theta) in (1..=2usize, 1..=6usize, 1..=3usize, 1..=8usize).prop_flat_map(|(b, t, h, half)| (
        tensor_in(vec![b, t, h, 2 * half], Domain::Uniform(-2.0, 2.0)),
        0..=40usize,
        prop_oneof![Just(10_000.0f32), Just(500.0f32)],
    ))) {
        let y = ok("rope", x.rope(theta, pos_offset));
        prop_assert_eq!(y.shape(), x.shape());
        assert_close("rope", &y.to_vec(), &rope_reference(&x, theta as f64, pos_offset), 1e-4, 2e-5);
        // Applying it to a strided view gives the same result.
        assert_close_f32("rope (non-contiguous)", &ok("rope", non_contiguous(&x).rope(theta, pos_offset)).to_vec(), &y.to_vec(), 0.0, 0.0);
    }

    #[test]
    fn embedding_picks_rows((w, ids, ids_shape) in (1..=5usize, 1..=4usize, shape_with_rank(1..=3)).prop_flat_map(|(vocab, c, ids_shape)| {
        let n = numel(&ids_shape);
        (tensor_in(vec![vocab, c], Domain::Uniform(-2.0, 2.0)), prop::collection::vec(0..vocab as u32, n), Just(ids_shape))
    })) {
        let c = w.shape()[1];
        let ws = w.to_vec();
        let expected: Vec<f32> = ids.iter().flat_map(|&i| ws[i as usize * c..(i as usize + 1) * c].to_vec()).collect();
        let y = ok("embedding", w.embedding(&ids, &ids_shape));
        let out_shape = [ids_shape.as_slice(), &[c]].concat();
        prop_assert_eq!(y.shape(), out_shape.as_slice());
        prop_assert_eq!(y.to_vec(), expected.clone());
        prop_assert_eq!(ok("embedding", non_contiguous(&w).embedding(&ids, &ids_shape)).to_vec(), expected);
    }

    #[test]
    fn causal_attention_matches_masked_softmax((q, k, v) in (1..=2usize, 1..=7usize, 1..=3usize, 1..=8usize)
        .prop_flat_map(|(b, tk, h, d)| (Just((b, tk, h, d)), 1..=tk))
        .prop_flat_map(|((b, tk, h, d), tq)| (
            tensor_in(vec![b, tq, h, d], Domain::Uniform(-2.0, 2.0)),
            tensor_in(vec![b, tk, h, d], Domain::Uniform(-2.0, 2.0)),
            tensor_in(vec![b, tk, h, d], Domain::Uniform(-2.0, 2.0)),
        )))
    {
        let scale = 1.0 / (q.shape()[3] as f32).sqrt();
        let (out, lse) = ok("causal_attention", Tensor::causal_attention(&q, &k, &v, scale));
        let (expected, expected_lse) = attention_reference(&q, &k, &v, scale as f64);
        prop_assert_eq!(out.shape(), q.shape());
        assert_close("causal_attention", &out.to_vec(), &expected, 1e-4, 1e-5);
        assert_close("causal_attention lse", &lse.to_vec(), &expected_lse, 1e-5, 1e-5);
        let (strided, _) = ok("causal_attention", Tensor::causal_attention(&non_contiguous(&q), &non_contiguous(&k), &non_contiguous(&v), scale));
        assert_close_f32("causal_attention (non-contiguous)", &strided.to_vec(), &out.to_vec(), 0.0, 0.0);
    }
}

#[test]
fn rope_at_long_context_positions() {
    // Positions up to LLaMA-scale contexts: f32 angles lose ~|angle|·2⁻²⁴, no more.
    let x = seeded(&[1, 3, 2, 16], -2.0, 2.0, 21);
    for pos_offset in [0, 511, 4093] {
        let y = ok("rope", x.rope(10_000.0, pos_offset));
        assert_close(
            &format!("rope at {pos_offset}"),
            &y.to_vec(),
            &rope_reference(&x, 10_000.0, pos_offset),
            1e-3,
            1e-3,
        );
    }
}

#[test]
fn attention_and_rope_reject_bad_shapes() {
    let q = Tensor::zeros(&[1, 4, 2, 8]);
    let k = Tensor::zeros(&[1, 3, 2, 8]);
    assert!(Tensor::causal_attention(&q, &k, &k, 1.0).is_err(), "Tq > Tk must be rejected");
    let k = Tensor::zeros(&[1, 4, 2, 4]);
    assert!(Tensor::causal_attention(&q, &k, &k, 1.0).is_err(), "head dims differ");
    assert!(Tensor::zeros(&[1, 2, 1, 3]).rope(10_000.0, 0).is_err(), "odd head dim must be rejected");
    assert!(Tensor::zeros(&[2, 3]).rope(10_000.0, 0).is_err(), "rope needs rank 4");
    assert!(Tensor::zeros(&[3, 2]).embedding(&[3], &[1]).is_err(), "id 3 of 3 rows must be rejected");
}

// ---------------------------------------------------------------------------------------
// cat and views.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn cat_matches_loops((parts, axis) in shape_and_axis().prop_flat_map(|(s, axis)| {
        prop::collection::vec(0..=3usize, 1..=4).prop_flat_map(move |sizes| {
            let parts: Vec<_> = sizes.iter().map(|&n| {
                let mut p = s.clone();
                p[axis] = n;
                tensor_in(p, Domain::Uniform(-2.0, 2.0))
            }).collect();
            (parts, Just(axis))
        })
    }), strided in any::<bool>()) {
        let parts: Vec<Tensor> = if strided { parts.iter().map(non_contiguous).collect() } else { parts };
        let y = ok("cat", Tensor::cat(&parts.iter().collect::<Vec<_>>(), axis));
        let mut shape = parts[0].shape().to_vec();
        shape[axis] = parts.iter().map(|p| p.shape()[axis]).sum();
        prop_assert_eq!(y.shape(), shape.as_slice());
        // Element at idx comes from the part whose axis range holds idx[axis].
        let values: Vec<Vec<f32>> = parts.iter().map(Tensor::to_vec).collect();
        let expected: Vec<f32> = (0..numel(&shape)).map(|flat| {
            let mut idx = unravel(flat, &shape);
            let mut p = 0;
            while idx[axis] >= parts[p].shape()[axis] {
                idx[axis] -= parts[p].shape()[axis];
                p += 1;
            }
            values[p][ravel(&idx, parts[p].shape())]
        }).collect();
        prop_assert_eq!(y.to_vec(), expected);
    }

    #[test]
    fn views_of_non_contiguous_tensors((x, axes, (axis, start, len)) in shape().prop_flat_map(|s| {
        let rank = s.len();
        (
            tensor_in(s.clone(), Domain::Uniform(-2.0, 2.0)),
            Just((0..rank).collect::<Vec<_>>()).prop_shuffle(),
            (0..rank).prop_flat_map(move |axis| {
                let size = s[axis];
                (Just(axis), 0..size).prop_flat_map(move |(axis, start)| (Just(axis), Just(start), 0..=size - start))
            }),
        )
    })) {
        let nc = non_contiguous(&x);
        let (shape, xs) = (x.shape().to_vec(), x.to_vec());
        prop_assert_eq!(nc.to_vec(), xs.clone());

        // permute: output index o reads input index with idx[axes[i]] = o[i].
        let p = ok("permute", nc.permute(&axes));
        let p_shape: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
        prop_assert_eq!(p.shape(), p_shape.as_slice());
        let expected: Vec<f32> = (0..xs.len()).map(|flat| {
            let o = unravel(flat, &p_shape);
            let mut idx = vec![0; shape.len()];
            for (i, &a) in axes.iter().enumerate() { idx[a] = o[i]; }
            xs[ravel(&idx, &shape)]
        }).collect();
        prop_assert_eq!(p.to_vec(), expected.clone());
        // reshape of a strided view copies in row-major order of the view.
        prop_assert_eq!(ok("reshape", p.reshape(&[xs.len()])).to_vec(), expected.clone());
        prop_assert_eq!(ok("contiguous", p.contiguous()).to_vec(), expected);
        prop_assert!(ok("contiguous", p.contiguous()).is_contiguous());

        // narrow
        let nw = ok("narrow", nc.narrow(axis, start, len));
        let mut n_shape = shape.clone();
        n_shape[axis] = len;
        let expected: Vec<f32> = (0..numel(&n_shape)).map(|flat| {
            let mut idx = unravel(flat, &n_shape);
            idx[axis] += start;
            xs[ravel(&idx, &shape)]
        }).collect();
        prop_assert_eq!(nw.to_vec(), expected);

        // unsqueeze + expand + squeeze
        let u = ok("unsqueeze", nc.unsqueeze(0));
        let e = ok("expand", u.expand(&[[2].as_slice(), &shape].concat()));
        prop_assert_eq!(e.to_vec(), [xs.clone(), xs.clone()].concat());
        prop_assert_eq!(ok("squeeze", u.squeeze(0)).to_vec(), xs.clone());

        // Ops read strided inputs like their contiguous copies.
        prop_assert_eq!(ok("exp", nc.unary(Unary::Exp)).to_vec(), ok("exp", x.unary(Unary::Exp)).to_vec());
        prop_assert_eq!(ok("mul", nc.mul(&nc)).to_vec(), ok("mul", x.mul(&x)).to_vec());
        prop_assert_eq!(ok("softmax", nc.softmax()).to_vec(), ok("softmax", x.softmax()).to_vec());
        prop_assert_eq!(ok("log_softmax", nc.log_softmax()).to_vec(), ok("log_softmax", x.log_softmax()).to_vec());
        prop_assert_eq!(ok("scalar_op", nc.scalar_op(Binary::Mul, 3.0)).to_vec(), ok("scalar_op", x.scalar_op(Binary::Mul, 3.0)).to_vec());
        prop_assert_eq!(ok("sum_axis", nc.sum_axis(axis, false)).to_vec(), ok("sum_axis", x.sum_axis(axis, false)).to_vec());
        prop_assert_eq!(ok("max_axis", nc.max_axis(axis, true)).0.to_vec(), ok("max_axis", x.max_axis(axis, true)).0.to_vec());
        let w = Tensor::ones(&[shape[shape.len() - 1]]);
        prop_assert_eq!(ok("rms_norm", nc.rms_norm(&w, 1e-5)).y.to_vec(), ok("rms_norm", x.rms_norm(&w, 1e-5)).y.to_vec());
        prop_assert_eq!(ok("layer_norm", nc.layer_norm(Some(&w), None, 1e-5)).y.to_vec(), ok("layer_norm", x.layer_norm(Some(&w), None, 1e-5)).y.to_vec());
        // Autograd views of a strided leaf agree too.
        let v = Var::constant(nc.clone());
        prop_assert_eq!(ok("Var::permute", v.permute(&axes)).value().to_vec(), p.to_vec());
    }
}

// ---------------------------------------------------------------------------------------
// bf16 / f16 storage round trips.

/// `k·2^e` for integer |k| ≤ 2^bits: exactly representable with `bits` significand bits.
fn representable(bits: u32, exp: std::ops::RangeInclusive<i32>) -> impl Strategy<Value = f32> {
    let max = 1i32 << bits;
    (-max..=max, exp).prop_map(|(k, e)| k as f32 * 2f32.powi(e))
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn exactly_representable_values_round_trip_exactly(
        bf in prop::collection::vec(representable(8, -100..=100), 1..40),
        half in prop::collection::vec(representable(11, -24..=4), 1..40),
    ) {
        let t = tensor(bf.clone(), &[bf.len()]);
        let b = ok("to_dtype", t.to_dtype(DType::BF16));
        prop_assert_eq!(b.dtype(), DType::BF16);
        prop_assert_eq!(b.to_vec(), bf.clone());
        prop_assert_eq!(ok("to_dtype", b.to_dtype(DType::F32)).to_vec(), bf);
        let t = tensor(half.clone(), &[half.len()]);
        let h = ok("to_dtype", t.to_dtype(DType::F16));
        prop_assert_eq!(h.dtype(), DType::F16);
        prop_assert_eq!(ok("to_dtype", h.to_dtype(DType::F32)).to_vec(), half);
    }

    #[test]
    fn other_values_round_within_half_an_ulp(
        bf in prop::collection::vec(log_uniform(1, -30.0, 30.0, true), 1..40),
        half in prop::collection::vec(log_uniform(1, -4.0, 4.5, true), 1..40),
    ) {
        // Round to nearest: |error| ≤ ½ ulp ≤ 2^−(significand bits)·|x| (8 bits for bf16,
        // 11 for f16 in its normal range, which 1e-4..3e4 stays in).
        for (values, dtype, rel) in [(bf, DType::BF16, 2f64.powi(-8)), (half, DType::F16, 2f64.powi(-11))] {
            let xs: Vec<f32> = values.into_iter().flatten().collect();
            let t = non_contiguous(&tensor(xs.clone(), &[xs.len()]));
            let back = ok("to_dtype", ok("to_dtype", t.to_dtype(dtype)).to_dtype(DType::F32)).to_vec();
            for (&x, &y) in xs.iter().zip(&back) {
                prop_assert!(((y - x) as f64).abs() <= rel * (x as f64).abs(), "{:?}: {} came back as {}", dtype, x, y);
            }
        }
    }
}

#[test]
fn dtype_conversion_rounds_half_to_even_and_keeps_specials() {
    // 1 + 2⁻⁸ sits halfway between bf16 neighbours 1 and 1 + 2⁻⁷: ties go to the even 1;
    // 1 + 3·2⁻⁸ goes up to the even 1 + 2⁻⁶.
    let x = tensor(vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::INFINITY, -0.0], &[4]);
    let b = ok("to_dtype", x.to_dtype(DType::BF16)).to_vec();
    assert_eq!(b[0], 1.0);
    assert_eq!(b[1], 1.0 + 2f32.powi(-6));
    assert_eq!(b[2], f32::INFINITY);
    assert!(b[3] == 0.0 && b[3].is_sign_negative(), "-0 must stay -0");
    let h = ok("to_dtype", tensor(vec![65504.0, 1e5, 2f32.powi(-24)], &[3]).to_dtype(DType::F16)).to_vec();
    assert_eq!(h, vec![65504.0, f32::INFINITY, 2f32.powi(-24)], "f16 max, overflow, smallest subnormal");
    let nan = ok("to_dtype", tensor(vec![f32::NAN], &[1]).to_dtype(DType::BF16)).to_vec();
    assert!(nan[0].is_nan());
}

#[test]
fn compute_ops_reject_half_precision_storage() {
    let x = ok("to_dtype", Tensor::ones(&[2, 2]).to_dtype(DType::BF16));
    let y = Tensor::ones(&[2, 2]);
    let err = x.add(&y).expect_err("add of a bf16 tensor must be an error (compute is f32)");
    assert!(err.to_string().contains("add") && err.to_string().contains("BF16"), "{err}");
    assert!(y.matmul(&x).is_err(), "matmul with bf16 must be an error");
    assert!(x.unary(Unary::Exp).is_err(), "unary on bf16 must be an error");
    assert_eq!(x.dtype(), DType::BF16);
    assert_eq!(ok("to_dtype", x.to_dtype(DType::F16)).to_vec(), vec![1.0; 4]);
}

// ---------------------------------------------------------------------------------------
// Shape errors name the op and both shapes.

fn assert_shape_error<T: std::fmt::Debug>(result: tensor::Result<T>, op: &str, lhs: &str, rhs: &str) {
    let err = result.expect_err("mismatched shapes must be an error");
    let msg = err.to_string();
    assert!(
        msg.contains(op) && msg.contains(lhs) && msg.contains(rhs),
        "message {msg:?} must name {op}, {lhs} and {rhs}"
    );
}

#[test]
fn mismatched_shapes_are_errors_naming_op_and_shapes() {
    let (a, b) = (Tensor::zeros(&[2, 3]), Tensor::zeros(&[4]));
    assert_shape_error(a.add(&b), "add", "[2, 3]", "[4]");
    assert_shape_error(a.sub(&b), "sub", "[2, 3]", "[4]");
    assert_shape_error(a.mul(&b), "mul", "[2, 3]", "[4]");
    assert_shape_error(a.div(&b), "div", "[2, 3]", "[4]");
    assert_shape_error(a.binary(&b, Binary::Maximum), "maximum", "[2, 3]", "[4]");
    // swiglu does not broadcast: even [3] against [2, 3] is an error.
    assert_shape_error(a.swiglu(&Tensor::zeros(&[3])), "swiglu", "[2, 3]", "[3]");
    assert_shape_error(a.matmul(&Tensor::zeros(&[4, 5])), "matmul", "[2, 3]", "[4, 5]");
    assert_shape_error(a.matmul(&b), "matmul", "[2, 3]", "[4]");
    assert_shape_error(Tensor::cat(&[&a, &Tensor::zeros(&[3, 4])], 0), "cat", "[2, 3]", "[3, 4]");
    assert_shape_error(Tensor::cat(&[&a, &b], 0), "cat", "[2, 3]", "[4]");
    assert!(Tensor::cat(&[&a], 2).is_err(), "cat axis out of range");
    assert!(a.reshape(&[4]).is_err() && a.sum_axis(2, false).is_err() && a.expand(&[3, 3]).is_err());

    // The autograd ops surface the same errors.
    let (va, vb) = (Var::parameter(a.clone()), Var::parameter(b.clone()));
    assert_shape_error(va.add(&vb), "add", "[2, 3]", "[4]");
    assert_shape_error(va.swiglu(&vb), "swiglu", "[2, 3]", "[4]");
    assert_shape_error(va.matmul(&Var::constant(Tensor::zeros(&[4, 5]))), "matmul", "[2, 3]", "[4, 5]");
    assert_shape_error(Var::cat(&[&va, &vb], 0), "cat", "[2, 3]", "[4]");
    assert_shape_error(Var::parameter(Tensor::zeros(&[3])).set_value(Tensor::zeros(&[4])), "set_value", "[3]", "[4]");
}

#[test]
fn matmul_batch_mismatch_names_both_full_shapes() {
    let a = Tensor::zeros(&[2, 2, 3]);
    let b = Tensor::zeros(&[3, 3, 4]);
    assert_shape_error(a.matmul(&b), "matmul", "[2, 2, 3]", "[3, 3, 4]");
}
