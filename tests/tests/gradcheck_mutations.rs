//! Mutation tests of the engine-level gradient check: deliberately wrong backward rules,
//! each a test-only op built with `Var::from_op` beside the true forward, go through the
//! same `autograd::gradcheck` every op test uses, and the check must reject them. Each
//! wrong rule is paired with the correct one on the same input, which must pass, so the
//! rejection is the rule's fault and not the finite differences'.
//!
//! - GELU: the exact (erf) forward with the tanh approximation's slope, the bug Burn
//!   shipped (worst slope error 8.7e-4, at |x| ≈ 2);
//! - mean: the backward without its 1/n;
//! - RMSNorm: the backward's mean-of-squares term without its 1/n;
//! - matmul: `dA = dY·B` instead of `dY·Bᵀ`;
//! - a slope off by a constant 3e-4: the smallest error class the check promises to catch
//!   (`|Δ| > 2·(atol + rtol·|slope|)` with the f32 row atol = rtol = 1e-4 and |w| ≥ 0.5).

use autograd::{gradcheck, GradcheckFailure, Var};
use tensor::ops::{Binary, Unary};
use tensor::{Result, Tensor};
use transponder_tests::*;

/// Asserts the check rejects `wrong` with a mismatch and passes `right`, on `inputs`.
fn assert_rejected(
    what: &str,
    wrong: impl Fn(&[Var]) -> Result<Var>,
    right: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
) {
    if let Err(failure) = gradcheck(right, inputs) {
        panic!("{what}: the correct rule failed, so the check cannot tell: {failure}");
    }
    match gradcheck(wrong, inputs) {
        Err(failure @ GradcheckFailure::Mismatch(_)) => eprintln!("{what}: rejected as it should be: {failure}"),
        Err(other) => panic!("{what}: failed for another reason: {other}"),
        Ok(report) => panic!("{what}: the wrong rule passed (worst ratio {:.2})", report.ratio),
    }
}

/// `n` points evenly spread over `[lo, hi]`, offset so none sits on a round number.
fn spread(n: usize, lo: f32, hi: f32) -> Tensor {
    let step = (hi - lo) / (n - 1) as f32;
    tensor((0..n).map(|i| lo + i as f32 * step + 0.0137).collect(), &[n])
}

/// The erf GELU forward with the tanh approximation's backward.
fn gelu_with_tanh_slope(x: &Var) -> Result<Var> {
    let xv = x.value().contiguous()?;
    let (y, y_tanh) = (xv.unary(Unary::Gelu)?, xv.unary(Unary::GeluTanh)?);
    Ok(Var::from_op(y, vec![x.clone()], move |dy| Ok(vec![Tensor::unary_backward(Unary::GeluTanh, &xv, &y_tanh, dy)?])))
}

/// The mean over the last axis whose backward forgets the 1/n.
fn mean_without_one_over_n(x: &Var) -> Result<Var> {
    let shape = x.shape();
    let axis = shape.len() - 1;
    let y = x.value().mean_axis(axis, false)?;
    Ok(Var::from_op(y, vec![x.clone()], move |dy| Ok(vec![dy.unsqueeze(axis)?.expand(&shape)?.contiguous()?])))
}

/// RMSNorm over the last axis of `x: [rows, n]`, `y = x·r` with `r = (mean(x²) + ε)^{-½}`,
/// whose backward drops the 1/n of the mean: the true rule is
/// `dx = r·dy − x·r³·(Σ dy·x)/n`, the wrong one leaves out the `/n`.
fn rms_norm_without_one_over_n(x: &Var) -> Result<Var> {
    let xv = x.value().contiguous()?;
    let eps = 1e-5;
    let r = xv.binary(&xv, Binary::Mul)?.mean_axis(1, true)?.scalar_op(Binary::Add, eps)?.unary(Unary::Rsqrt)?;
    let y = xv.mul(&r)?;
    Ok(Var::from_op(y, vec![x.clone()], move |dy| {
        let projection = dy.mul(&xv)?.sum_axis(1, true)?; // Σ dy·x, no /n
        let r3 = r.mul(&r)?.mul(&r)?;
        Ok(vec![dy.mul(&r)?.sub(&xv.mul(&r3)?.mul(&projection)?)?])
    }))
}

/// The same RMSNorm from engine ops (the correct rule, by composition).
fn rms_norm_composed(x: &Var) -> Result<Var> {
    x.mul(&x.square()?.mean_axis(1, true)?.add_scalar(1e-5)?.rsqrt()?)
}

/// `A·B` whose backward hands A the gradient `dY·B` (B untransposed).
fn matmul_with_untransposed_b(a: &Var, b: &Var) -> Result<Var> {
    let (av, bv) = (a.value(), b.value());
    let y = av.matmul(&bv)?;
    Ok(Var::from_op(y, vec![a.clone(), b.clone()], move |dy| {
        Ok(vec![dy.matmul(&bv)?, av.transpose(0, 1)?.matmul(dy)?])
    }))
}

/// tanh whose slope is off by `offset` everywhere.
fn tanh_with_slope_offset(x: &Var, offset: f32) -> Result<Var> {
    let xv = x.value().contiguous()?;
    let y = xv.unary(Unary::Tanh)?;
    let saved = y.clone();
    Ok(Var::from_op(y, vec![x.clone()], move |dy| {
        let slope = Tensor::unary_backward(Unary::Tanh, &xv, &saved, &dy.full_like(1.0)?)?;
        Ok(vec![dy.mul(&slope.scalar_op(Binary::Add, offset)?)?])
    }))
}

#[test]
fn rejects_erf_gelu_with_tanh_slope() {
    let x = spread(97, -4.0, 4.0);
    assert_rejected("GELU with the tanh slope", |v| gelu_with_tanh_slope(&v[0]), |v| v[0].gelu(), &[x]);
}

#[test]
fn rejects_mean_without_one_over_n() {
    let x = seeded(&[3, 4], -2.0, 2.0, 11);
    assert_rejected("mean without 1/n", |v| mean_without_one_over_n(&v[0]), |v| v[0].mean_axis(1, false), &[x]);
}

#[test]
fn rejects_rms_norm_without_one_over_n() {
    let x = seeded(&[3, 6], -2.0, 2.0, 12);
    assert_rejected("RMSNorm without 1/n", |v| rms_norm_without_one_over_n(&v[0]), |v| rms_norm_composed(&v[0]), &[x]);
}

#[test]
fn rejects_matmul_with_untransposed_gradient() {
    let (a, b) = (seeded(&[4, 4], -1.5, 1.5, 13), seeded(&[4, 4], -1.5, 1.5, 14));
    assert_rejected(
        "matmul with dA = dY·B",
        |v| matmul_with_untransposed_b(&v[0], &v[1]),
        |v| v[0].matmul(&v[1]),
        &[a, b],
    );
}

#[test]
fn rejects_a_slope_off_by_three_ten_thousandths() {
    // 3e-4 against a bound of at most 2·(1e-4 + 1e-4·1) = 4e-4 where |slope| ≤ 1 and |w| ≥ 0.5:
    // rejected wherever |w|·3e-4 > 1e-4·(1 + |w·slope|), i.e. everywhere the slope is small.
    let x = spread(41, -3.0, 3.0);
    assert_rejected("tanh slope + 3e-4", |v| tanh_with_slope_offset(&v[0], 3e-4), |v| v[0].tanh(), &[x]);
}

#[test]
fn passes_a_slope_off_by_one_millionth() {
    // The other side of the floor: an error 100× below the tolerance is not flagged, so the
    // check is not merely rejecting everything.
    let x = spread(41, -3.0, 3.0);
    let report = gradcheck(|v| tanh_with_slope_offset(&v[0], 1e-6), &[x]).expect("1e-6 is inside the tolerance");
    assert!(report.ratio < 0.5, "worst ratio {:.2}", report.ratio);
}
