//! RMSNorm and LayerNorm over the last axis (x is `[N, C]`, rows of `cols` = C).
//!
//! RMSNorm (Zhang & Sennrich 2019, eq. 4): y = x · rstd · w, rstd = 1/√(mean(x²) + eps).
//! LayerNorm (Ba et al. 2016, eq. 15): y = (x − mean) · rstd (· w + b), rstd = 1/√(var + eps),
//! with the biased variance.
//!
//! PyTorch equivalents: `torch.nn.functional.rms_norm(x, (C,), w, eps)` and
//! `F.layer_norm(x, (C,), w, b, eps)`. The forward saves `rstd` (and `mean`) per row, which
//! is all the backward reads besides `x` and the weight. The backward writes its gradients
//! (`dx = ...`, `dweight = ...`; the crate's contract, see `lib.rs`); the weight gradients are
//! summed per block of rows and the blocks are added in order, so the result does not depend
//! on the thread count.

use rayon::prelude::*;
use wide::f32x8;

use super::parallel;
use super::reduce::{dot, slice_sum};
use super::simd::{load, store, LANES};

/// Rough cost of one element in the forward (two passes of multiply-adds).
const FORWARD_WORK: usize = 4;
/// Rough cost of one element in the backward.
const BACKWARD_WORK: usize = 8;

/// y = x · rstd · weight, rstd = 1/sqrt(mean(x²) + eps) saved per row
pub fn rms_norm_forward(x: &[f32], weight: &[f32], cols: usize, eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let rows = check_rows(x, cols, y.len(), rstd.len(), "rms_norm_forward");
    assert_eq!(weight.len(), cols, "rms_norm_forward: weight length differs from cols");
    if rows == 0 {
        return;
    }
    let block = parallel::rows_per_task(cols * FORWARD_WORK);
    let body = |(b, (y, rstd)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, (y, rstd)) in y.chunks_mut(cols).zip(rstd.iter_mut()).enumerate() {
            let x = &x[(b * block + i) * cols..][..cols];
            *rstd = 1.0 / (dot(x, x) / cols as f32 + eps).sqrt();
            scale_and_shift(x, 0.0, *rstd, Some(weight), None, y);
        }
    };
    if parallel::should_parallelise(x.len() * FORWARD_WORK) {
        y.par_chunks_mut(block * cols).zip(rstd.par_chunks_mut(block)).enumerate().for_each(body);
    } else {
        y.chunks_mut(block * cols).zip(rstd.chunks_mut(block)).enumerate().for_each(body);
    }
}

/// `dx = ∂L/∂x` and `dweight = ∂L/∂weight` for RMSNorm, from the saved `rstd`.
pub fn rms_norm_backward(
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dy: &[f32],
    cols: usize,
    dx: &mut [f32],
    dweight: &mut [f32],
) {
    let rows = check_rows(x, cols, dx.len(), rstd.len(), "rms_norm_backward");
    assert!(weight.len() == cols && dweight.len() == cols, "rms_norm_backward: weight length differs from cols");
    assert_eq!(dy.len(), x.len(), "rms_norm_backward: dy and x differ in length");
    dweight.fill(0.0);
    if rows == 0 {
        return;
    }
    // With g = dy ⊙ w:  d/dx_j = r·g_j − x_j · r³ · (Σ_k g_k x_k) / C;   d/dw_j = Σ_rows dy_j · x_j · r
    let partials = parallel::map_row_blocks_mut(dx, cols, cols * BACKWARD_WORK, |first, block| {
        let mut dw = vec![0.0; cols];
        for (i, dx) in block.chunks_mut(cols).enumerate() {
            let r = first + i;
            let (x, dy, rs) = (&x[r * cols..][..cols], &dy[r * cols..][..cols], rstd[r]);
            let gx = triple_dot(dy, weight, x);
            let c = rs * rs * rs * gx / cols as f32;
            let simd_end = cols - cols % LANES;
            for j in (0..simd_end).step_by(LANES) {
                let (xv, dyv) = (load(&x[j..]), load(&dy[j..]));
                let grad = dyv * load(&weight[j..]) * rs - xv * c;
                store(grad, &mut dx[j..]);
                store(load(&dw[j..]) + dyv * xv * rs, &mut dw[j..]);
            }
            for j in simd_end..cols {
                dx[j] = dy[j] * weight[j] * rs - x[j] * c;
                dw[j] += dy[j] * x[j] * rs;
            }
        }
        dw
    });
    for partial in &partials {
        add_into(dweight, partial);
    }
}

/// y = (x − mean)·rstd (· weight + bias if given); mean and rstd saved per row
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(
    x: &[f32],
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    cols: usize,
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
    let rows = check_rows(x, cols, y.len(), rstd.len(), "layer_norm_forward");
    assert_eq!(mean.len(), rows, "layer_norm_forward: mean has the wrong length");
    assert!(weight.is_none_or(|w| w.len() == cols), "layer_norm_forward: weight length differs from cols");
    assert!(bias.is_none_or(|b| b.len() == cols), "layer_norm_forward: bias length differs from cols");
    if rows == 0 {
        return;
    }
    let block = parallel::rows_per_task(cols * FORWARD_WORK);
    let body = |(b, ((y, mean), rstd)): parallel::Zip3<'_>| {
        let rows = y.chunks_mut(cols).zip(mean.iter_mut()).zip(rstd.iter_mut());
        for (i, ((y, mean), rstd)) in rows.enumerate() {
            let x = &x[(b * block + i) * cols..][..cols];
            *mean = slice_sum(x) / cols as f32;
            // Two passes: Σ(x − mean)² does not cancel the way Σx² − C·mean² does.
            *rstd = 1.0 / (centred_sum_squares(x, *mean) / cols as f32 + eps).sqrt();
            scale_and_shift(x, *mean, *rstd, weight, bias, y);
        }
    };
    let parallel = parallel::should_parallelise(x.len() * FORWARD_WORK);
    if parallel {
        let stats = mean.par_chunks_mut(block).zip(rstd.par_chunks_mut(block));
        y.par_chunks_mut(block * cols).zip(stats).map(|(y, (m, r))| ((y, m), r)).enumerate().for_each(body);
    } else {
        let stats = mean.chunks_mut(block).zip(rstd.chunks_mut(block));
        y.chunks_mut(block * cols).zip(stats).map(|(y, (m, r))| ((y, m), r)).enumerate().for_each(body);
    }
}

/// `dx = ∂L/∂x`, and `dweight`/`dbias` = their gradients when given, for LayerNorm.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &[f32],
    weight: Option<&[f32]>,
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    cols: usize,
    dx: &mut [f32],
    mut dweight: Option<&mut [f32]>,
    mut dbias: Option<&mut [f32]>,
) {
    let rows = check_rows(x, cols, dx.len(), rstd.len(), "layer_norm_backward");
    assert!(mean.len() == rows && dy.len() == x.len(), "layer_norm_backward: mean or dy has the wrong length");
    assert!(weight.is_none_or(|w| w.len() == cols), "layer_norm_backward: weight length differs from cols");
    assert!(dweight.as_ref().is_none_or(|w| w.len() == cols), "layer_norm_backward: dweight length differs from cols");
    assert!(dbias.as_ref().is_none_or(|b| b.len() == cols), "layer_norm_backward: dbias length differs from cols");
    for grad in dweight.as_deref_mut().into_iter().chain(dbias.as_deref_mut()) {
        grad.fill(0.0);
    }
    if rows == 0 {
        return;
    }
    let (want_dw, want_db) = (dweight.is_some(), dbias.is_some());
    // With x̂ = (x − mean)·r and g = dy ⊙ w:
    //   d/dx_j = r · (g_j − mean(g) − x̂_j · mean(g ⊙ x̂));   d/dw_j = Σ dy_j x̂_j;   d/db_j = Σ dy_j
    let partials = parallel::map_row_blocks_mut(dx, cols, cols * BACKWARD_WORK, |first, block| {
        let mut dw = vec![0.0; if want_dw { cols } else { 0 }];
        let mut db = vec![0.0; if want_db { cols } else { 0 }];
        let mut g = vec![0.0; cols];
        let mut x_hat = vec![0.0; cols];
        for (i, dx) in block.chunks_mut(cols).enumerate() {
            let r = first + i;
            let (x, dy, rs) = (&x[r * cols..][..cols], &dy[r * cols..][..cols], rstd[r]);
            scale_and_shift(x, mean[r], rs, None, None, &mut x_hat);
            match weight {
                Some(w) => multiply(dy, w, &mut g),
                None => g.copy_from_slice(dy),
            }
            let mean_g = slice_sum(&g) / cols as f32;
            let mean_gx = dot(&g, &x_hat) / cols as f32;
            let simd_end = cols - cols % LANES;
            for j in (0..simd_end).step_by(LANES) {
                let grad = (load(&g[j..]) - mean_g - load(&x_hat[j..]) * mean_gx) * rs;
                store(grad, &mut dx[j..]);
            }
            for j in simd_end..cols {
                dx[j] = (g[j] - mean_g - x_hat[j] * mean_gx) * rs;
            }
            if want_dw {
                multiply_add(dy, &x_hat, &mut dw);
            }
            if want_db {
                add_into(&mut db, dy);
            }
        }
        (dw, db)
    });
    if let Some(dweight) = dweight {
        partials.iter().for_each(|(dw, _)| add_into(dweight, dw));
    }
    if let Some(dbias) = dbias {
        partials.iter().for_each(|(_, db)| add_into(dbias, db));
    }
}

/// Scalar reference RMSNorm forward: (y, rstd).
pub fn rms_norm_reference(x: &[f32], weight: &[f32], cols: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let mut y = Vec::with_capacity(x.len());
    let mut rstd = Vec::new();
    for row in x.chunks(cols) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / cols as f32 + eps).sqrt();
        y.extend(row.iter().zip(weight).map(|(v, w)| v * r * w));
        rstd.push(r);
    }
    (y, rstd)
}

/// Scalar reference LayerNorm forward: (y, mean, rstd).
pub fn layer_norm_reference(
    x: &[f32],
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    cols: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut y, mut means, mut rstds) = (Vec::with_capacity(x.len()), Vec::new(), Vec::new());
    for row in x.chunks(cols) {
        let mean = row.iter().sum::<f32>() / cols as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
        let r = 1.0 / (var + eps).sqrt();
        for (j, v) in row.iter().enumerate() {
            let w = weight.map_or(1.0, |w| w[j]);
            let b = bias.map_or(0.0, |b| b[j]);
            y.push((v - mean) * r * w + b);
        }
        means.push(mean);
        rstds.push(r);
    }
    (y, means, rstds)
}

/// Checks `x` is whole rows and outputs match; returns the number of rows.
fn check_rows(x: &[f32], cols: usize, out_len: usize, stats_len: usize, what: &str) -> usize {
    assert!(cols > 0 || x.is_empty(), "{what}: zero columns");
    assert!(x.len().is_multiple_of(cols), "{what}: length is not a multiple of cols");
    assert_eq!(out_len, x.len(), "{what}: output length differs from x");
    let rows = x.len().checked_div(cols).unwrap_or(0);
    assert_eq!(stats_len, rows, "{what}: per-row statistics have the wrong length");
    rows
}

/// y = (x − shift)·factor (· w + b).
fn scale_and_shift(x: &[f32], shift: f32, factor: f32, w: Option<&[f32]>, b: Option<&[f32]>, y: &mut [f32]) {
    let simd_end = x.len() - x.len() % LANES;
    for j in (0..simd_end).step_by(LANES) {
        let mut v = (load(&x[j..]) - shift) * factor;
        if let Some(w) = w {
            v *= load(&w[j..]);
        }
        if let Some(b) = b {
            v += load(&b[j..]);
        }
        store(v, &mut y[j..]);
    }
    for j in simd_end..x.len() {
        y[j] = (x[j] - shift) * factor * w.map_or(1.0, |w| w[j]) + b.map_or(0.0, |b| b[j]);
    }
}

/// Σ (x − mean)².
fn centred_sum_squares(x: &[f32], mean: f32) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = f32x8::ZERO;
    for j in (0..simd_end).step_by(LANES) {
        let d = load(&x[j..]) - mean;
        acc = d.mul_add(d, acc);
    }
    acc.reduce_add() + x[simd_end..].iter().map(|v| (v - mean) * (v - mean)).sum::<f32>()
}

/// Σ a·b·c.
fn triple_dot(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let simd_end = a.len() - a.len() % LANES;
    let mut acc = f32x8::ZERO;
    for j in (0..simd_end).step_by(LANES) {
        acc = (load(&a[j..]) * load(&b[j..])).mul_add(load(&c[j..]), acc);
    }
    acc.reduce_add() + (simd_end..a.len()).map(|j| a[j] * b[j] * c[j]).sum::<f32>()
}

/// out = a ⊙ b.
fn multiply(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
}

/// acc += a ⊙ b.
fn multiply_add(a: &[f32], b: &[f32], acc: &mut [f32]) {
    for ((o, x), y) in acc.iter_mut().zip(a).zip(b) {
        *o += x * y;
    }
}

/// acc += v.
fn add_into(acc: &mut [f32], v: &[f32]) {
    for (o, x) in acc.iter_mut().zip(v) {
        *o += x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, assert_within, gradient, oracle, Dtype, Tolerance};
    use proptest::prelude::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 29 + seed * 11) % 41) as f32 * 0.1 - 1.7).collect()
    }

    proptest! {
        #[test]
        fn forward_matches_reference(rows in 1usize..5, cols in 1usize..70, affine in any::<bool>()) {
            let (x, w, b) = (values(rows * cols, 1), values(cols, 2), values(cols, 3));
            let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
            rms_norm_forward(&x, &w, cols, 1e-5, &mut y, &mut rstd);
            let (y_ref, rstd_ref) = rms_norm_reference(&x, &w, cols, 1e-5);
            assert_close("rms_norm y", &y, &y_ref, Tolerance::uniform(1e-5));
            assert_close("rms_norm rstd", &rstd, &rstd_ref, Tolerance::uniform(1e-5));
            let (w, b) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            layer_norm_forward(&x, w, b, cols, 1e-5, &mut y, &mut mean, &mut rstd);
            let (y_ref, mean_ref, rstd_ref) = layer_norm_reference(&x, w, b, cols, 1e-5);
            assert_close("layer_norm y", &y, &y_ref, Tolerance::uniform(1e-4));
            assert_close("layer_norm mean", &mean, &mean_ref, Tolerance::uniform(1e-5));
            assert_close("layer_norm rstd", &rstd, &rstd_ref, Tolerance::uniform(1e-4));
        }
    }

    /// Checks dx, dweight (and dbias) against central differences of the f64 forward.
    fn check_backward(rows: usize, cols: usize, layer: bool) {
        let eps = 1e-5;
        let (x, w, b, dy) = (values(rows * cols, 4), values(cols, 5), values(cols, 6), values(rows * cols, 7));
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        // Stale gradient buffers: the backward must overwrite every element, never read one.
        let mut dx = vec![f32::NAN; x.len()];
        let (mut dw, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        if layer {
            layer_norm_forward(&x, Some(&w), Some(&b), cols, eps, &mut y, &mut mean, &mut rstd);
            layer_norm_backward(&x, Some(&w), &mean, &rstd, &dy, cols, &mut dx, Some(&mut dw), Some(&mut db));
        } else {
            rms_norm_forward(&x, &w, cols, eps, &mut y, &mut rstd);
            rms_norm_backward(&x, &w, &rstd, &dy, cols, &mut dx, &mut dw);
        }
        let (x64, w64, b64, dy64) = (oracle::widen(&x), oracle::widen(&w), oracle::widen(&b), oracle::widen(&dy));
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            let eps = f64::from(eps);
            let y = if layer { oracle::layer_norm(x, w, b, cols, eps) } else { oracle::rms_norm(x, w, cols, eps) };
            oracle::dot(&y, &dy64)
        };
        let name = if layer { "layer_norm" } else { "rms_norm" };
        let tol = Dtype::F64.table().gradient;
        let numeric_dx = gradient(&x64, Dtype::F64, |x| loss(x, &w64, &b64));
        assert_within(&format!("{name} dx ({rows}×{cols})"), oracle::widen(&dx), numeric_dx, tol);
        let numeric_dw = gradient(&w64, Dtype::F64, |w| loss(&x64, w, &b64));
        assert_within(&format!("{name} dw ({rows}×{cols})"), oracle::widen(&dw), numeric_dw, tol);
        if layer {
            let numeric_db = gradient(&b64, Dtype::F64, |b| loss(&x64, &w64, b));
            assert_within(&format!("{name} db ({rows}×{cols})"), oracle::widen(&db), numeric_db, tol);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for (rows, cols) in [(1, 1), (3, 5), (2, 19)] {
            check_backward(rows, cols, false);
            check_backward(rows, cols, true);
        }
    }

    #[test]
    fn parallel_blocks_match_sequential_sums() {
        let (rows, cols) = (2048, 67);
        let (x, w, dy) = (values(rows * cols, 1), values(cols, 2), values(rows * cols, 3));
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        layer_norm_forward(&x, Some(&w), None, cols, 1e-5, &mut y, &mut mean, &mut rstd);
        let (y_ref, _, _) = layer_norm_reference(&x, Some(&w), None, cols, 1e-5);
        assert_close("layer_norm y", &y, &y_ref, Tolerance::uniform(1e-4));
        let mut dx = vec![f32::NAN; x.len()];
        let (mut dw, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        layer_norm_backward(&x, Some(&w), &mean, &rstd, &dy, cols, &mut dx, Some(&mut dw), Some(&mut db));
        for j in 0..cols {
            let want_db: f32 = (0..rows).map(|r| dy[r * cols + j]).sum();
            let want_dw: f32 = (0..rows).map(|r| dy[r * cols + j] * (x[r * cols + j] - mean[r]) * rstd[r]).sum();
            assert!((db[j] - want_db).abs() < 1e-3 * (1.0 + want_db.abs()));
            assert!((dw[j] - want_dw).abs() < 1e-3 * (1.0 + want_dw.abs()));
        }
        // Without affine parameters only dx is produced.
        let mut dx2 = vec![f32::NAN; x.len()];
        layer_norm_backward(&x, None, &mean, &rstd, &dy, cols, &mut dx2, None, None);
        assert!(dx2.iter().all(|v| v.is_finite()));
    }
}
