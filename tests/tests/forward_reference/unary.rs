//! Every unary op against its f64 reference (the toolkit's oracles), on wide and saturating
//! ranges, special values, the SIMD tail and vectors long enough to be split over threads.

use gradcheck::oracle;
use proptest::prelude::*;
use tensor::ops::Unary;
use transponder_tests::*;

use super::{log_uniform, CASES};

/// `f(x)` in f64: the toolkit's oracles for the transcendental ones, the definition for the
/// rest.
fn unary_reference(op: Unary, x: f64) -> f64 {
    match op {
        Unary::Neg => -x,
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Sqrt => x.sqrt(),
        Unary::Rsqrt => 1.0 / x.sqrt(),
        Unary::Abs => x.abs(),
        Unary::Sigmoid => oracle::sigmoid(x),
        Unary::Tanh => x.tanh(),
        Unary::Relu => x.max(0.0),
        Unary::Silu => oracle::silu(x),
        Unary::Gelu => oracle::gelu(x),
        Unary::GeluTanh => oracle::gelu_tanh(x),
        Unary::Powf(p) => x.powf(p as f64),
        Unary::Square => x * x,
    }
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
    let cases = unary_cases();
    for op in Unary::ALL {
        let covered = cases.iter().any(|(case, _)| std::mem::discriminant(case) == std::mem::discriminant(&op));
        assert!(covered, "{op:?} has no range in unary_cases");
    }
    for (op, strategy) in cases {
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
    for op in Unary::ALL {
        let got = ok("unary", x.unary(op)).to_vec();
        let expected: Vec<f64> = xs.iter().map(|&v| unary_reference(op, v as f64)).collect();
        assert_close(&format!("{op:?} on {n} values"), &got, &expected, 4e-6, 1e-6);
    }
}
