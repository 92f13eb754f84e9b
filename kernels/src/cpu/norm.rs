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

/// Sizes of one RMSNorm or LayerNorm call, shared by the CPU and CUDA kernels (`cuda::norm`
/// takes the same struct): `x`, the output, `dy` and `dx` are `[rows, cols]`, the per-row
/// statistics `[rows]`, the weight, bias and their gradients `[cols]`. [`NormDims::check`] is
/// the one validation both devices run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormDims {
    /// `N`: rows normalised independently.
    pub rows: usize,
    /// `C`: the normalised width (0 only with no rows).
    pub cols: usize,
    /// Added to the mean square (RMSNorm) or the variance (LayerNorm) under the square root.
    /// Forward only: the backward reads the saved `rstd`.
    pub eps: f32,
}

impl NormDims {
    /// The sizes of `len` elements in rows of `cols` (no rows when `cols` is 0; a `len` that
    /// is not whole rows fails [`NormDims::check`]).
    pub fn of(len: usize, cols: usize, eps: f32) -> NormDims {
        NormDims { rows: len / cols.max(1), cols, eps }
    }

    /// Elements of `x` (and of the output, `dy`, `dx`).
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// True when there is nothing to normalise.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the `[rows, cols]` operands (`rows`: name and length), the per-row statistics
    /// (`stats`) and the present `[cols]` parameters or their gradients (`params`, `None`
    /// where absent) fit these sizes; the error says what does not.
    pub fn check(
        &self,
        rows: &[(&str, usize)],
        stats: &[(&str, usize)],
        params: &[(&str, Option<usize>)],
    ) -> Result<(), String> {
        if self.cols == 0 && self.rows > 0 {
            return Err("zero columns".into());
        }
        let [n, c] = [self.rows, self.cols];
        for &(name, len) in rows {
            if len != self.len() {
                return Err(format!("{name} has {len} elements, [rows, cols] = [{n}, {c}] needs {}", self.len()));
            }
        }
        for &(name, len) in stats {
            if len != n {
                return Err(format!("{name} has {len} elements, one per row needs {n}"));
            }
        }
        for &(name, len) in params {
            if let Some(len) = len.filter(|&len| len != c) {
                return Err(format!("{name} has {len} elements, cols is {c}"));
            }
        }
        Ok(())
    }

    /// Panics naming `op` unless [`NormDims::check`] accepts the operands.
    fn assert_fits(&self, op: &str, rows: &[(&str, usize)], stats: &[(&str, usize)], params: &[(&str, Option<usize>)]) {
        if let Err(message) = self.check(rows, stats, params) {
            panic!("{op}: {message}");
        }
    }
}

/// LayerNorm's per-row statistics, `[rows]` each: what the forward writes (`S = &mut` a
/// buffer) and the backward reads (`S = &` a buffer).
#[derive(Debug)]
pub struct RowStats<S> {
    /// The mean of every row.
    pub mean: S,
    /// `1/√(var + eps)` of every row.
    pub rstd: S,
}

/// What a norm's backward writes (never reads): `dx`, and the weight and bias gradients where
/// given. RMSNorm has no bias: its `dbias` must be `None`.
#[derive(Debug)]
pub struct NormGrads<'a, T: ?Sized> {
    /// `∂L/∂x`, `[rows, cols]`.
    pub dx: &'a mut T,
    /// `∂L/∂weight`, `[cols]`, when wanted.
    pub dweight: Option<&'a mut T>,
    /// `∂L/∂bias`, `[cols]`, when wanted.
    pub dbias: Option<&'a mut T>,
}

/// One row of RMSNorm, shared by [`rms_norm_forward`] and [`add_rms_norm_forward`] so both
/// compute the same bits: `y = x · rstd · weight`; returns `rstd = 1/sqrt(mean(x²) + eps)`.
fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, y: &mut [f32]) -> f32 {
    let rstd = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    scale_and_shift(x, 0.0, rstd, Some(weight), None, y);
    rstd
}

/// y = x · rstd · weight, rstd = 1/sqrt(mean(x²) + eps) saved per row
pub fn rms_norm_forward(x: &[f32], weight: &[f32], dims: &NormDims, y: &mut [f32], rstd: &mut [f32]) {
    dims.assert_fits(
        "rms_norm_forward",
        &[("x", x.len()), ("y", y.len())],
        &[("rstd", rstd.len())],
        &[("weight", Some(weight.len()))],
    );
    let NormDims { rows, cols, eps } = *dims;
    if rows == 0 {
        return;
    }
    let block = parallel::rows_per_task(cols * FORWARD_WORK);
    let body = |(b, (y, rstd)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, (y, rstd)) in y.chunks_mut(cols).zip(rstd.iter_mut()).enumerate() {
            *rstd = rms_norm_row(&x[(b * block + i) * cols..][..cols], weight, eps, y);
        }
    };
    if parallel::should_parallelise(x.len() * FORWARD_WORK) {
        y.par_chunks_mut(block * cols).zip(rstd.par_chunks_mut(block)).enumerate().for_each(body);
    } else {
        y.chunks_mut(block * cols).zip(rstd.chunks_mut(block)).enumerate().for_each(body);
    }
}

/// The pre-ln LLaMA block's residual add and the next RMSNorm in one pass: `sum = x + delta`
/// (the residual stream `h = x + attn(norm(x))`), then exactly [`rms_norm_forward`] of `sum`
/// into `y` and `rstd` (same arithmetic, same reduction order, so the results equal the
/// unfused add and norm bit for bit). The backward is [`rms_norm_backward`] of `sum`.
pub fn add_rms_norm_forward(
    x: &[f32],
    delta: &[f32],
    weight: &[f32],
    dims: &NormDims,
    (sum, y): (&mut [f32], &mut [f32]),
    rstd: &mut [f32],
) {
    dims.assert_fits(
        "add_rms_norm_forward",
        &[("x", x.len()), ("delta", delta.len()), ("sum", sum.len()), ("y", y.len())],
        &[("rstd", rstd.len())],
        &[("weight", Some(weight.len()))],
    );
    let NormDims { rows, cols, eps } = *dims;
    if rows == 0 {
        return;
    }
    let block = parallel::rows_per_task(cols * FORWARD_WORK);
    let body = |(b, ((y, sum), rstd)): parallel::Zip3<'_>| {
        let rows = y.chunks_mut(cols).zip(sum.chunks_mut(cols)).zip(rstd.iter_mut());
        for (i, ((y, sum), rstd)) in rows.enumerate() {
            let start = (b * block + i) * cols;
            add(&x[start..][..cols], &delta[start..][..cols], sum);
            *rstd = rms_norm_row(sum, weight, eps, y);
        }
    };
    if parallel::should_parallelise(x.len() * FORWARD_WORK) {
        let outputs = y.par_chunks_mut(block * cols).zip(sum.par_chunks_mut(block * cols));
        outputs.zip(rstd.par_chunks_mut(block)).enumerate().for_each(body);
    } else {
        let outputs = y.chunks_mut(block * cols).zip(sum.chunks_mut(block * cols));
        outputs.zip(rstd.chunks_mut(block)).enumerate().for_each(body);
    }
}

/// `dx = ∂L/∂x` and `dweight = ∂L/∂weight` (when given) for RMSNorm, from the saved `rstd`.
/// `residual`, when given, is the gradient already reaching `x` by another path (in a pre-ln
/// LLaMA block, the residual stream's from the later add): `dx` is then the total,
/// `residual + ∂L/∂x` through the norm.
pub fn rms_norm_backward(
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    (dy, residual): (&[f32], Option<&[f32]>),
    dims: &NormDims,
    grads: NormGrads<'_, [f32]>,
) {
    let NormGrads { dx, mut dweight, dbias } = grads;
    dims.assert_fits(
        "rms_norm_backward",
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len()), ("residual", residual.map_or(x.len(), <[f32]>::len))],
        &[("rstd", rstd.len())],
        &[("weight", Some(weight.len())), ("dweight", dweight.as_ref().map(|w| w.len()))],
    );
    assert!(dbias.is_none(), "rms_norm_backward: RMSNorm has no bias");
    let NormDims { rows, cols, .. } = *dims;
    if let Some(dweight) = dweight.as_deref_mut() {
        dweight.fill(0.0);
    }
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
                store(residual.map_or(grad, |res| load(&res[r * cols + j..]) + grad), &mut dx[j..]);
                store(load(&dw[j..]) + dyv * xv * rs, &mut dw[j..]);
            }
            for j in simd_end..cols {
                let grad = dy[j] * weight[j] * rs - x[j] * c;
                dx[j] = residual.map_or(grad, |res| res[r * cols + j] + grad);
                dw[j] += dy[j] * x[j] * rs;
            }
        }
        dw
    });
    if let Some(dweight) = dweight {
        for partial in &partials {
            add_into(dweight, partial);
        }
    }
}

/// y = (x − mean)·rstd (· weight + bias if given); mean and rstd saved per row
pub fn layer_norm_forward(
    x: &[f32],
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    dims: &NormDims,
    y: &mut [f32],
    stats: RowStats<&mut [f32]>,
) {
    let RowStats { mean, rstd } = stats;
    dims.assert_fits(
        "layer_norm_forward",
        &[("x", x.len()), ("y", y.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[("weight", weight.map(<[f32]>::len)), ("bias", bias.map(<[f32]>::len))],
    );
    let NormDims { rows, cols, eps } = *dims;
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
pub fn layer_norm_backward(
    x: &[f32],
    weight: Option<&[f32]>,
    stats: RowStats<&[f32]>,
    dy: &[f32],
    dims: &NormDims,
    grads: NormGrads<'_, [f32]>,
) {
    let (RowStats { mean, rstd }, NormGrads { dx, mut dweight, mut dbias }) = (stats, grads);
    dims.assert_fits(
        "layer_norm_backward",
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[
            ("weight", weight.map(<[f32]>::len)),
            ("dweight", dweight.as_ref().map(|w| w.len())),
            ("dbias", dbias.as_ref().map(|b| b.len())),
        ],
    );
    let NormDims { rows, cols, .. } = *dims;
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

/// out = a + b.
fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    let simd_end = a.len() - a.len() % LANES;
    for j in (0..simd_end).step_by(LANES) {
        store(load(&a[j..]) + load(&b[j..]), &mut out[j..]);
    }
    for j in simd_end..a.len() {
        out[j] = a[j] + b[j];
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
            rms_norm_forward(&x, &w, &NormDims::of(x.len(), cols, 1e-5), &mut y, &mut rstd);
            let (y_ref, rstd_ref) = rms_norm_reference(&x, &w, cols, 1e-5);
            assert_close("rms_norm y", &y, &y_ref, Tolerance::uniform(1e-5));
            assert_close("rms_norm rstd", &rstd, &rstd_ref, Tolerance::uniform(1e-5));
            let (w, b) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            let stats = RowStats { mean: &mut mean[..], rstd: &mut rstd[..] };
            layer_norm_forward(&x, w, b, &NormDims::of(x.len(), cols, 1e-5), &mut y, stats);
            let (y_ref, mean_ref, rstd_ref) = layer_norm_reference(&x, w, b, cols, 1e-5);
            assert_close("layer_norm y", &y, &y_ref, Tolerance::uniform(1e-4));
            assert_close("layer_norm mean", &mean, &mean_ref, Tolerance::uniform(1e-5));
            assert_close("layer_norm rstd", &rstd, &rstd_ref, Tolerance::uniform(1e-4));
        }
    }

    /// The fused residual add and RMSNorm equals the add and then [`rms_norm_forward`], bit
    /// for bit.
    fn check_add_rms_norm(rows: usize, cols: usize, seed: usize) {
        let (x, delta, w) = (values(rows * cols, seed), values(rows * cols, seed + 1), values(cols, seed + 2));
        let dims = NormDims::of(x.len(), cols, 1e-5);
        let (mut sum, mut y, mut rstd) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()], vec![f32::NAN; rows]);
        add_rms_norm_forward(&x, &delta, &w, &dims, (&mut sum, &mut y), &mut rstd);
        let want_sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let (mut want_y, mut want_rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
        rms_norm_forward(&want_sum, &w, &dims, &mut want_y, &mut want_rstd);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&sum), bits(&want_sum), "sum ({rows}×{cols})");
        assert_eq!(bits(&y), bits(&want_y), "y ({rows}×{cols})");
        assert_eq!(bits(&rstd), bits(&want_rstd), "rstd ({rows}×{cols})");
    }

    proptest! {
        #[test]
        fn add_rms_norm_equals_add_then_rms_norm(rows in 0usize..5, cols in 1usize..70, seed in 0usize..50) {
            check_add_rms_norm(rows, cols, seed);
        }
    }

    #[test]
    fn parallel_add_rms_norm_equals_add_then_rms_norm() {
        check_add_rms_norm(2048, 67, 3);
    }

    /// Checks dx, dweight (and dbias) against central differences of the f64 forward.
    fn check_backward(rows: usize, cols: usize, layer: bool) {
        let eps = 1e-5;
        let (x, w, b, dy) = (values(rows * cols, 4), values(cols, 5), values(cols, 6), values(rows * cols, 7));
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        // Stale gradient buffers: the backward must overwrite every element, never read one.
        let mut dx = vec![f32::NAN; x.len()];
        let (mut dw, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        let dims = NormDims { rows, cols, eps };
        if layer {
            layer_norm_forward(&x, Some(&w), Some(&b), &dims, &mut y, RowStats { mean: &mut mean, rstd: &mut rstd });
            let grads = NormGrads { dx: &mut dx[..], dweight: Some(&mut dw[..]), dbias: Some(&mut db[..]) };
            layer_norm_backward(&x, Some(&w), RowStats { mean: &mean, rstd: &rstd }, &dy, &dims, grads);
        } else {
            rms_norm_forward(&x, &w, &dims, &mut y, &mut rstd);
            rms_norm_backward(
                &x,
                &w,
                &rstd,
                (&dy, None),
                &dims,
                NormGrads { dx: &mut dx, dweight: Some(&mut dw), dbias: None },
            );
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
        let dims = NormDims { rows, cols, eps: 1e-5 };
        layer_norm_forward(&x, Some(&w), None, &dims, &mut y, RowStats { mean: &mut mean, rstd: &mut rstd });
        let (y_ref, _, _) = layer_norm_reference(&x, Some(&w), None, cols, 1e-5);
        assert_close("layer_norm y", &y, &y_ref, Tolerance::uniform(1e-4));
        let mut dx = vec![f32::NAN; x.len()];
        let (mut dw, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        let grads = NormGrads { dx: &mut dx[..], dweight: Some(&mut dw[..]), dbias: Some(&mut db[..]) };
        layer_norm_backward(&x, Some(&w), RowStats { mean: &mean, rstd: &rstd }, &dy, &dims, grads);
        for j in 0..cols {
            let want_db: f32 = (0..rows).map(|r| dy[r * cols + j]).sum();
            let want_dw: f32 = (0..rows).map(|r| dy[r * cols + j] * (x[r * cols + j] - mean[r]) * rstd[r]).sum();
            assert!((db[j] - want_db).abs() < 1e-3 * (1.0 + want_db.abs()));
            assert!((dw[j] - want_dw).abs() < 1e-3 * (1.0 + want_dw.abs()));
        }
        // Without affine parameters only dx is produced.
        let mut dx2 = vec![f32::NAN; x.len()];
        let grads = NormGrads { dx: &mut dx2[..], dweight: None, dbias: None };
        layer_norm_backward(&x, None, RowStats { mean: &mean, rstd: &rstd }, &dy, &dims, grads);
        assert!(dx2.iter().all(|v| v.is_finite()));
    }
}
