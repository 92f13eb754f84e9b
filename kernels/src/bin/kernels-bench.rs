//! Throughput of the CPU kernels, each next to a baseline measured in the same run:
//! - matmul GFLOP/s of `kernels::cpu::matmul::matmul` and of `gemm::gemm` called directly;
//! - GB/s (bytes read + written once) of the memory-bound kernels at 4096 × 512, with
//!   SwiGLU gating fused against the silu + mul pair it replaces;
//! - causal attention forward and backward time against `causal_attention_reference`.
//!
//! Every figure is the median of several timed runs after a warm-up run. Before a line is
//! printed, the result of its timed runs is checked against the scalar or naive reference
//! (`*_reference`; matmul on its first rows); a disagreement ends the run with exit status 1
//! and the worst element.
//!
//! Run: `cargo run --release -p kernels --bin kernels-bench` (about 20 s on two cores).

mod validate;

use std::time::Instant;

use gradcheck::Tolerance;
use kernels::cpu::attention::{
    causal_attention_backward, causal_attention_backward_reference, causal_attention_forward,
    causal_attention_reference, AttentionDims,
};
use kernels::cpu::binary::{binary_forward, binary_reference, Binary};
use kernels::cpu::cross_entropy::{cross_entropy_forward, cross_entropy_reference, CrossEntropyDims};
use kernels::cpu::matmul::{matmul, GemmDims, MatRef, Store};
use kernels::cpu::norm::{layer_norm_forward, layer_norm_reference, rms_norm_forward, rms_norm_reference};
use kernels::cpu::norm::{NormDims, RowStats};
use kernels::cpu::softmax::{softmax_forward, softmax_reference};
use kernels::cpu::swiglu::{swiglu_backward, swiglu_derivative_reference, swiglu_forward, swiglu_reference};
use kernels::cpu::unary::{unary_backward, unary_forward, unary_reference, Unary};
use validate::{validate, validate_product};

/// Rows of each matmul result checked against `matmul_reference`.
const CHECKED_ROWS: usize = 16;

/// Median wall time in seconds of `reps` runs of `f`, after one warm-up run.
fn median_seconds(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Deterministic values in [-1, 1) so runs are comparable.
fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7919 + seed * 104_729) % 2000) as f32 / 1000.0 - 1.0).collect()
}

fn contiguous(data: &[f32], cols: usize) -> MatRef<'_> {
    MatRef { data, offset: 0, row_stride: cols as isize, col_stride: 1 }
}

fn bench_matmul() {
    println!("matmul (GFLOP/s)          {:>10} {:>10} {:>8}", "ours", "gemm", "ratio");
    for (m, k, n) in [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (4096, 512, 1376)] {
        let (a, b) = (filled(m * k, 1), filled(k * n, 2));
        let mut c = vec![0.0f32; m * n];
        let reps = if m * n * k > 1 << 28 { 5 } else { 9 };
        let label = format!("{m}×{k} · {k}×{n}");
        let ours = median_seconds(reps, || {
            matmul(&mut c, 0, contiguous(&a, k), contiguous(&b, n), GemmDims { m, n, k }, Store::Overwrite);
        });
        validate_product(&format!("matmul {label}"), &c, &a, &b, k, n, CHECKED_ROWS);
        let parallelism = gemm::Parallelism::Rayon(rayon::current_num_threads());
        let direct = median_seconds(reps, || {
            // SAFETY: a is m×k, b is k×n and c is m×n, all contiguous row-major and
            // exclusively or immutably borrowed for the call; c does not alias a or b.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
                    1,
                    n as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
        });
        validate_product(&format!("gemm {label}"), &c, &a, &b, k, n, CHECKED_ROWS);
        let flops = 2.0 * (m * n * k) as f64;
        let (ours, direct) = (flops / ours / 1e9, flops / direct / 1e9);
        println!("  {label:<24} {ours:>10.1} {direct:>10.1} {:>8.2}", ours / direct);
    }
}

/// Each row kernel's output against its scalar reference, with the bounds of its unit tests
/// (`|got − want| ≤ tol·(1 + |want|)`; the binary ops are exact).
fn bench_memory_bound() {
    let (rows, cols) = (4096, 512);
    let n = rows * cols;
    let (x, x2) = (filled(n, 3), filled(n, 4));
    let (weight, bias) = (filled(cols, 5), filled(cols, 6));
    let mut y = vec![0.0f32; n];
    let (mut mean, mut rstd) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 37 % cols as u32).collect();
    let (mut losses, mut lse) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let bytes = |floats: usize| (floats * std::mem::size_of::<f32>()) as f64;
    let report = |name: &str, floats: usize, seconds: f64| {
        println!("  {name:<24} {:>10.1} {:>10.3}", bytes(floats) / seconds / 1e9, seconds * 1e3);
    };
    let exact = Tolerance { atol: 0.0, rtol: 0.0 };
    println!("memory-bound at {rows}×{cols}    {:>10} {:>10}", "GB/s", "ms");
    let silu = median_seconds(9, || unary_forward(Unary::Silu, &x, &mut y));
    let want: Vec<f32> = x.iter().map(|&v| unary_reference(Unary::Silu, v)).collect();
    validate("unary silu", &y, &want, Tolerance::uniform(2e-6));
    report("unary silu", 2 * n, silu);
    bench_swiglu(&x, &x2, cols, &report);
    let add =
        median_seconds(9, || binary_forward(Binary::Add, &x, 0, &[cols, 1], &x2, 0, &[cols, 1], &[rows, cols], &mut y));
    let want: Vec<f32> = x.iter().zip(&x2).map(|(&a, &b)| binary_reference(Binary::Add, a, b)).collect();
    validate("binary add", &y, &want, exact);
    report("binary add", 3 * n, add);
    let bias_add =
        median_seconds(9, || binary_forward(Binary::Add, &x, 0, &[cols, 1], &bias, 0, &[0, 1], &[rows, cols], &mut y));
    let want: Vec<f32> =
        x.iter().zip(bias.iter().cycle()).map(|(&a, &b)| binary_reference(Binary::Add, a, b)).collect();
    validate("binary add (bias [C])", &y, &want, exact);
    report("binary add (bias [C])", 2 * n, bias_add);
    let softmax = median_seconds(9, || softmax_forward(&x, cols, &mut y));
    validate("softmax", &y, &softmax_reference(&x, cols), Tolerance::uniform(1e-6));
    report("softmax", 2 * n, softmax);
    let norm_dims = NormDims::of(x.len(), cols, 1e-5);
    let rms = median_seconds(9, || rms_norm_forward(&x, &weight, &norm_dims, &mut y, &mut rstd));
    let (want_y, want_rstd) = rms_norm_reference(&x, &weight, cols, 1e-5);
    validate("rms_norm y", &y, &want_y, Tolerance::uniform(1e-5));
    validate("rms_norm rstd", &rstd, &want_rstd, Tolerance::uniform(1e-5));
    report("rms_norm", 2 * n, rms);
    let layer = median_seconds(9, || {
        let stats = RowStats { mean: &mut mean[..], rstd: &mut rstd[..] };
        layer_norm_forward(&x, Some(&weight), Some(&bias), &norm_dims, &mut y, stats)
    });
    let (want_y, want_mean, want_rstd) = layer_norm_reference(&x, Some(&weight), Some(&bias), cols, 1e-5);
    validate("layer_norm y", &y, &want_y, Tolerance::uniform(1e-4));
    validate("layer_norm mean", &mean, &want_mean, Tolerance::uniform(1e-5));
    validate("layer_norm rstd", &rstd, &want_rstd, Tolerance::uniform(1e-4));
    report("layer_norm", 2 * n, layer);
    let ce = median_seconds(9, || {
        let dims = CrossEntropyDims { rows: targets.len(), cols, ignore_index: None };
        cross_entropy_forward(&x, &targets, &dims, &mut losses, &mut lse);
    });
    validate("cross_entropy", &losses, &cross_entropy_reference(&x, cols, &targets, None), Tolerance::uniform(1e-5));
    report("cross_entropy", n, ce);
}

/// SwiGLU gating `silu(g) ⊙ u` (g = `gate`, u = `up`): the two-kernel composite autograd
/// ran before (silu, then mul; backward: two products, then silu's backward reading the
/// saved `silu(g)`) against the fused op. Bytes count every buffer each pass reads or writes.
/// Both paths are checked against `swiglu_reference` and `swiglu_derivative_reference`.
fn bench_swiglu(gate: &[f32], up: &[f32], cols: usize, report: &impl Fn(&str, usize, f64)) {
    let n = gate.len();
    let (strides, shape) = ([cols, 1], [n / cols, cols]);
    let dout = filled(n, 11);
    let want_y: Vec<f32> = gate.iter().zip(up).map(|(&g, &u)| swiglu_reference(g, u)).collect();
    let (want_dgate, want_dup): (Vec<f32>, Vec<f32>) = gate
        .iter()
        .zip(up)
        .zip(&dout)
        .map(|((&g, &u), &d)| {
            let (dg, du) = swiglu_derivative_reference(g, u);
            (d * dg, d * du)
        })
        .unzip();
    let (forward, backward) = (Tolerance::uniform(2e-6), Tolerance::uniform(1e-5));
    let (mut silu, mut y) = (vec![0.0f32; n], vec![0.0f32; n]);
    let pair = median_seconds(9, || {
        unary_forward(Unary::Silu, gate, &mut silu);
        binary_forward(Binary::Mul, &silu, 0, &strides, up, 0, &strides, &shape, &mut y);
    });
    validate("silu + mul", &y, &want_y, forward);
    report("silu + mul", 5 * n, pair);
    let fused = median_seconds(9, || swiglu_forward(gate, up, &mut y));
    validate("swiglu (fused)", &y, &want_y, forward);
    report("swiglu (fused)", 3 * n, fused);
    let (mut dgate, mut dup, mut dsilu) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let pair_backward = median_seconds(9, || {
        binary_forward(Binary::Mul, &dout, 0, &strides, up, 0, &strides, &shape, &mut dsilu);
        binary_forward(Binary::Mul, &dout, 0, &strides, &silu, 0, &strides, &shape, &mut dup);
        unary_backward(Unary::Silu, gate, &silu, &dsilu, &mut dgate);
    });
    validate("silu + mul backward dgate", &dgate, &want_dgate, backward);
    validate("silu + mul backward dup", &dup, &want_dup, backward);
    report("silu + mul backward", 10 * n, pair_backward);
    let fused_backward = median_seconds(9, || swiglu_backward(gate, up, &dout, &mut dgate, &mut dup));
    validate("swiglu backward (fused) dgate", &dgate, &want_dgate, backward);
    validate("swiglu backward (fused) dup", &dup, &want_dup, backward);
    report("swiglu backward (fused)", 5 * n, fused_backward);
}

fn bench_attention() {
    let (batch, heads, seq, head_dim) = (16, 4, 256, 32);
    let n = batch * seq * heads * head_dim;
    let (q, k, v, dout) = (filled(n, 7), filled(n, 8), filled(n, 9), filled(n, 10));
    let scale = 1.0 / (head_dim as f32).sqrt();
    let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale };
    let mut out = vec![0.0f32; n];
    let mut lse = vec![0.0f32; dims.lse_len()];
    let forward = median_seconds(5, || causal_attention_forward(&q, &k, &v, &dims, &mut out, &mut lse));
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let backward = median_seconds(5, || {
        causal_attention_backward(&q, &k, &v, &out, &lse, &dout, &dims, &mut dq, &mut dk, &mut dv)
    });
    let mut reference = Vec::new();
    let naive = median_seconds(3, || {
        reference = causal_attention_reference(&q, &k, &v, &dims);
    });
    // The bounds of the unit tests: 1e-5 absolute forward, the backward's sums over up to
    // T keys at the gradient rounding.
    validate("attention forward (flash)", &out, &reference, Tolerance { atol: 1e-5, rtol: 0.0 });
    let worst = out.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let (want_dq, want_dk, want_dv) = causal_attention_backward_reference(&q, &k, &v, &dout, &dims);
    validate("attention backward (flash) dq", &dq, &want_dq, Tolerance::uniform(1e-4));
    validate("attention backward (flash) dk", &dk, &want_dk, Tolerance::uniform(1e-4));
    validate("attention backward (flash) dv", &dv, &want_dv, Tolerance::uniform(1e-4));
    // Causal: half of the Tq × Tk scores, two products (Q·Kᵀ and P·V) of 2·D flops each.
    let flops = (batch * heads * seq * seq * head_dim * 2) as f64;
    println!("attention B={batch} H={heads} T={seq} D={head_dim}   {:>10} {:>10}", "ms", "GFLOP/s");
    println!("  {:<24} {:>10.2} {:>10.1}", "forward (flash)", forward * 1e3, flops / forward / 1e9);
    println!("  {:<24} {:>10.2} {:>10.1}", "backward (flash)", backward * 1e3, 2.5 * flops / backward / 1e9);
    println!("  {:<24} {:>10.2} {:>10.1}", "forward (reference)", naive * 1e3, flops / naive / 1e9);
    println!("  forward speed-up {:.1}×, max |flash − reference| = {worst:.1e}", naive / forward);
}

fn main() {
    println!("threads: {}", rayon::current_num_threads());
    bench_matmul();
    bench_memory_bound();
    bench_attention();
}
