//! Throughput of `conv2d_forward` and `conv2d_backward` at the ResNet-18 CIFAR layer shapes
//! (batch 64), next to the matmul peak measured in the same run with `matmul` at the
//! equivalent im2col GEMM shape `y[O, P] = w[O, K] · col[K, P]`, two ways: the whole batch as
//! one product (`P` = N·OH·OW), and one product per image spread over the threads as the
//! convolution does it. The peak is the better of the two; the ratios are conv GFLOP/s over it.
//! Backward counts dx and dw (two products the size of the forward one; dbias is negligible).
//!
//! Before a line is printed its results are checked against the naive references (the naive
//! convolution of the whole batch would take longer than the bench): the products' first
//! rows against `matmul_reference`; the timed forward's and backward's first image (`y`, `dx`)
//! against `conv2d_reference` and `conv2d_backward_reference`, and `dw`, `dbias` of a
//! one-image backward against the latter. A disagreement ends the run with exit status 1 and
//! the worst element.
//!
//! Run: `cargo run --release -p kernels --bin conv-bench` (about 10 s on two cores).

mod validate;

use std::time::Instant;

use kernels::cpu::conv::{
    conv2d_backward, conv2d_backward_reference, conv2d_forward, conv2d_reference, Conv2dGeometry,
};
use kernels::cpu::matmul::{matmul, GemmDims, MatRef, Store};
use rayon::prelude::*;
use validate::{products, validate, validate_product};

/// Rows of each matmul result checked against `matmul_reference`.
const CHECKED_ROWS: usize = 4;

/// Timed repetitions per measurement; the best one is reported.
const REPEATS: usize = 3;

/// Best wall time in seconds of `REPEATS` runs of `f`, after one warm-up run.
fn best_seconds(mut f: impl FnMut()) -> f64 {
    f();
    (0..REPEATS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Deterministic values in [-1, 1) so runs are comparable.
fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7919 + seed * 104_729) % 2000) as f32 / 1000.0 - 1.0).collect()
}

fn main() {
    let batch = 64;
    // (channels in, channels out, spatial size, kernel, stride, padding)
    let layers = [
        (3, 64, 32, 3, 1, 1),
        (64, 64, 32, 3, 1, 1),
        (128, 128, 16, 3, 1, 1),
        (256, 256, 8, 3, 1, 1),
        (512, 512, 4, 3, 1, 1),
        (128, 256, 16, 1, 2, 0),
    ];
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "{:<28} {:>18} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "layer (N=64)", "gemm m×(N·P)×k", "mm batch", "mm image", "forward", "backward", "fwd/mm", "bwd/mm"
    );
    for (c, o, size, k, stride, padding) in layers {
        let g = Conv2dGeometry {
            batch,
            in_channels: c,
            out_channels: o,
            height: size,
            width: size,
            kernel_h: k,
            kernel_w: k,
            stride,
            padding,
        };
        let positions = g.out_height() * g.out_width();
        let depth = c * k * k;
        let x = filled(batch * c * size * size, 1);
        let w = filled(o * depth, 2);
        let bias = filled(o, 3);
        let dy = filled(batch * o * positions, 4);
        let flops = 2.0 * (o * batch * positions * depth) as f64;

        // The per-image products share one column matrix, so they run cache-warm.
        let (m, n) = (o, batch * positions);
        let col = filled(depth * n, 5);
        let mut out = vec![0.0; m * n];
        let lhs = MatRef { data: &w, offset: 0, row_stride: depth as isize, col_stride: 1 };
        let rhs = MatRef { data: &col, offset: 0, row_stride: n as isize, col_stride: 1 };
        let name = format!("{c}→{o} {size}×{size} {k}×{k} s{stride} p{padding}");
        let mm_batch =
            flops / best_seconds(|| matmul(&mut out, 0, lhs, rhs, GemmDims { m, n, k: depth }, Store::Overwrite));
        validate_product(&format!("{name}: mm batch"), &out, &w, &col, depth, n, CHECKED_ROWS);
        let rhs = MatRef { data: &col, offset: 0, row_stride: positions as isize, col_stride: 1 };
        let mm_image = flops
            / best_seconds(|| {
                out.par_chunks_mut(m * positions).for_each(|out_n| {
                    matmul(out_n, 0, lhs, rhs, GemmDims { m, n: positions, k: depth }, Store::Overwrite);
                })
            });
        // Every image's product reads the same columns: check the first and the last.
        let (first, last) = (&out[..m * positions], &out[(batch - 1) * m * positions..]);
        validate_product(&format!("{name}: mm image 0"), first, &w, &col, depth, positions, CHECKED_ROWS);
        validate_product(&format!("{name}: mm image {}", batch - 1), last, &w, &col, depth, positions, CHECKED_ROWS);
        let mm = mm_batch.max(mm_image);
        drop((col, out));

        // The first image: its input, output and output gradient.
        let one = Conv2dGeometry { batch: 1, ..g };
        let (x_one, dy_one) = (&x[..c * size * size], &dy[..o * positions]);
        let tolerance = products(depth);
        let mut y = vec![0.0; batch * o * positions];
        let fwd = flops / best_seconds(|| conv2d_forward(&g, &x, &w, Some(&bias), &mut y));
        let want_y = conv2d_reference(&one, x_one, &w, Some(&bias));
        validate(&format!("{name}: forward"), &y[..o * positions], &want_y, tolerance);
        let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; o]);
        let bwd = 2.0 * flops
            / best_seconds(|| conv2d_backward(&g, &x, &w, &dy, Some(&mut dx), Some(&mut dw), Some(&mut db)));
        let (want_dx, want_dw, want_db) = conv2d_backward_reference(&one, x_one, &w, dy_one);
        validate(&format!("{name}: backward dx"), &dx[..c * size * size], &want_dx, products(o * k * k));
        conv2d_backward(&one, x_one, &w, dy_one, None, Some(&mut dw), Some(&mut db));
        validate(&format!("{name}: backward dw"), &dw, &want_dw, products(positions));
        validate(&format!("{name}: backward dbias"), &db, &want_db, products(positions));

        let shape = format!("{m}×{n}×{depth}");
        let giga = 1e-9;
        println!(
            "{name:<28} {shape:>18} {:>7.1} GF {:>7.1} GF {:>7.1} GF {:>7.1} GF {:>8.2} {:>8.2}",
            mm_batch * giga,
            mm_image * giga,
            fwd * giga,
            bwd * giga,
            fwd / mm,
            bwd / mm
        );
    }
}
