//! Forward values against f64 references (the `gradcheck` toolkit's oracles where it has one,
//! plain loops otherwise), one module per op family: every unary op (including extreme ranges
//! and the SIMD tail), broadcasting binary ops, fused SwiGLU gating, reductions, matmul,
//! softmax/log-softmax, cross-entropy with ignore_index, RMSNorm, LayerNorm, rotary embedding
//! (rotate-half, θ = 10000), embedding, causal attention, cat, views of non-contiguous tensors,
//! bf16/f16 round trips, and the error messages of mismatched shapes.

use proptest::prelude::*;

mod attention;
mod binary;
mod dtype;
mod matmul;
mod norm;
mod reduce;
mod shapes;
mod softmax;
mod swiglu;
mod unary;
mod views;

const CASES: u32 = 32;

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
