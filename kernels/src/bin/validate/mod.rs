//! The check every line of `kernels-bench` and `conv-bench` runs before it prints a time, as
//! llm.c's `dev/cuda` does: the result of the timed call against the scalar or naive
//! reference path. A disagreement ends the run with exit status 1, naming the line and its
//! worst element, instead of printing the speed of a wrong kernel.

use gradcheck::{compare, Tolerance};
use kernels::cpu::matmul::matmul_reference;

/// Ends the process with status 1 and the worst element when `got` is not within
/// `tolerance` of `want` elementwise (the toolkit's [`compare`]); does nothing otherwise.
pub fn validate(what: &str, got: &[f32], want: &[f32], tolerance: Tolerance) {
    let widen = |v: &[f32]| v.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
    if let Err(mismatch) = compare(what, widen(got), widen(want), tolerance) {
        eprintln!("bench result disagrees with the reference: {mismatch}");
        std::process::exit(1);
    }
}

/// Sums of `k` products of values in [-1, 1), added in another order than the reference's:
/// `4·k·ε` absolute (the benches' results stay below a quarter of it) and `1e-5` relative.
pub fn products(k: usize) -> Tolerance {
    Tolerance { atol: 4.0 * k as f64 * f64::from(f32::EPSILON), rtol: 1e-5 }
}

/// The first `rows` rows of `c = a·b` (`a: [m, k]`, `b: [k, n]`, all row-major) against
/// `matmul_reference` (the naive product of the whole matrices would take longer than the
/// bench).
pub fn validate_product(what: &str, c: &[f32], a: &[f32], b: &[f32], k: usize, n: usize, rows: usize) {
    let want = matmul_reference(&a[..rows * k], b, rows, n, k);
    validate(what, &c[..rows * n], &want, products(k));
}
