//! 2-D convolution (groups = 1, dilation = 1) by im2col + gemm, one image at a time.
//!
//! Legend: `N` batch, `C` input channels, `O` output channels, `H, W` input size, `KH, KW`
//! kernel size, `OH, OW` output size, `P = OH·OW` output positions, `K = C·KH·KW` the
//! im2col depth. Per image the convolution is one matrix product:
//! `y_n[O, P] = w[O, K] · col_n[K, P]`, where `col_n = im2col(x_n)` lays every receptive
//! field out as a column. A 1×1 stride-1 unpadded convolution needs no im2col: `col_n` is
//! `x_n[C, H·W]` itself.
//!
//! PyTorch equivalent: `torch.nn.functional.conv2d(x, w, bias, stride, padding)`.
//! Backward saves nothing beyond the inputs `x` and `w`: `col_n` is rebuilt from `x`.
//! The backward writes its gradients: `dx = ...`, `dw = ...`, `dbias = ...` (the crate's
//! contract, see `lib.rs`).

use rayon::prelude::*;

use crate::cpu::matmul::{matmul, GemmDims, MatRef, Store};
use crate::cpu::parallel;

/// Geometry of a 2-D convolution (groups = 1, dilation = 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dGeometry {
    /// `N`, images in the batch.
    pub batch: usize,
    /// `C`, channels of the input.
    pub in_channels: usize,
    /// `O`, channels of the output (number of filters).
    pub out_channels: usize,
    /// `H`, input height.
    pub height: usize,
    /// `W`, input width.
    pub width: usize,
    /// `KH`, kernel height.
    pub kernel_h: usize,
    /// `KW`, kernel width.
    pub kernel_w: usize,
    /// Step between receptive fields, the same along both axes (at least 1).
    pub stride: usize,
    /// Zero padding added on every side, the same along both axes.
    pub padding: usize,
}

impl Conv2dGeometry {
    /// `OH = (H + 2·padding − KH) / stride + 1`, or 0 when the kernel is taller than the
    /// padded input.
    pub fn out_height(&self) -> usize {
        output_size(self.height, self.kernel_h, self.stride, self.padding)
    }

    /// `OW = (W + 2·padding − KW) / stride + 1`, or 0 when the kernel is wider than the
    /// padded input.
    pub fn out_width(&self) -> usize {
        output_size(self.width, self.kernel_w, self.stride, self.padding)
    }

    fn input_len(&self) -> usize {
        self.in_channels * self.height * self.width
    }

    fn positions(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// `K = C·KH·KW`, the row length of `w` and the height of `col`.
    fn depth(&self) -> usize {
        self.in_channels * self.kernel_h * self.kernel_w
    }

    /// A 1×1 stride-1 unpadded convolution is a plain product with `x_n[C, H·W]`.
    fn is_pointwise(&self) -> bool {
        self.kernel_h == 1 && self.kernel_w == 1 && self.stride == 1 && self.padding == 0
    }

    fn check_lengths(&self, x: &[f32], w: &[f32], what: &str) {
        assert_len(x.len(), self.batch * self.input_len(), what, "x");
        assert_len(w.len(), self.out_channels * self.depth(), what, "w");
    }

    /// `col_n[K, P]`, or nothing for a pointwise convolution, which reads `x_n` in its place.
    fn col_len(&self) -> usize {
        if self.is_pointwise() {
            0
        } else {
            self.depth() * self.positions()
        }
    }

    /// Images per run: the batch cut into one run per thread (each run then needs one
    /// im2col buffer), or one run when the convolution is too small to be worth threads.
    fn images_per_run(&self) -> usize {
        let work = self.batch * self.out_channels * self.positions() * self.depth();
        let runs = if parallel::should_parallelise(work) { rayon::current_num_threads().min(self.batch) } else { 1 };
        self.batch.div_ceil(runs.max(1)).max(1)
    }
}

fn assert_len(got: usize, want: usize, what: &str, name: &str) {
    assert_eq!(got, want, "{what}: {name} has the wrong length");
}

/// `f(run, item)` for each item, on the rayon pool when there is more than one.
fn map_runs<T: Send, R: Send>(items: Vec<T>, f: impl Fn(usize, T) -> R + Sync + Send) -> Vec<R> {
    if items.len() > 1 {
        items.into_par_iter().enumerate().map(|(i, t)| f(i, t)).collect()
    } else {
        items.into_iter().enumerate().map(|(i, t)| f(i, t)).collect()
    }
}

fn output_size(size: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    match (size + 2 * padding).checked_sub(kernel) {
        Some(span) => span / stride + 1,
        None => 0,
    }
}

/// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C,KH,KW]) (+ bias[O] if given), via im2col + gemm per image.
pub fn conv2d_forward(g: &Conv2dGeometry, x: &[f32], w: &[f32], bias: Option<&[f32]>, y: &mut [f32]) {
    let what = "conv2d_forward";
    g.check_lengths(x, w, what);
    let (positions, depth, x_image) = (g.positions(), g.depth(), g.input_len());
    let y_image = g.out_channels * positions;
    assert_len(y.len(), g.batch * y_image, what, "y");
    if let Some(bias) = bias {
        assert_len(bias.len(), g.out_channels, what, "bias");
    }
    if y_image == 0 {
        return;
    }
    let per_run = g.images_per_run();
    let lhs = mat(w, 0, depth, 1);
    map_runs(y.chunks_mut(per_run * y_image).collect(), |run, y_run| {
        let mut col = vec![0.0; g.col_len()];
        for (i, y_n) in y_run.chunks_exact_mut(y_image).enumerate() {
            let n = run * per_run + i;
            let x_n = &x[n * x_image..(n + 1) * x_image];
            // The bias is written first and the product accumulated onto it.
            if let Some(bias) = bias {
                for (row, &b) in y_n.chunks_exact_mut(positions).zip(bias) {
                    row.fill(b);
                }
            }
            let rhs = if g.is_pointwise() {
                mat(x_n, 0, positions, 1)
            } else {
                im2col(g, x_n, &mut col);
                mat(&col, 0, positions, 1)
            };
            let o = g.out_channels;
            matmul(
                y_n,
                0,
                lhs,
                rhs,
                GemmDims { m: o, n: positions, k: depth },
                if bias.is_some() { Store::Accumulate } else { Store::Overwrite },
            );
        }
    });
}

// d/dx_n = col2im(wᵀ · dy_n),  d/dw = Σ_n dy_n · col_nᵀ,  d/dbias[o] = Σ_{n,p} dy[n, o, p]
/// dx = ..., dw = ..., dbias = ... (each optional: None skips that gradient).
pub fn conv2d_backward(
    g: &Conv2dGeometry,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    mut dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) {
    let what = "conv2d_backward";
    g.check_lengths(x, w, what);
    let (positions, x_image) = (g.positions(), g.input_len());
    let dy_image = g.out_channels * positions;
    assert_len(dy.len(), g.batch * dy_image, what, "dy");
    if let Some(dbias) = dbias {
        assert_len(dbias.len(), g.out_channels, what, "dbias");
        bias_grad(g, dy, dbias);
    }
    if let Some(dx) = &dx {
        assert_len(dx.len(), x.len(), what, "dx");
    }
    if let Some(dw) = dw.as_deref_mut() {
        assert_len(dw.len(), w.len(), what, "dw");
        dw.fill(0.0);
    }
    if dy_image == 0 || x_image == 0 || (dx.is_none() && dw.is_none()) {
        // Nothing flows back: the gradients are zeros.
        if let Some(dx) = dx {
            dx.fill(0.0);
        }
        return;
    }
    // Each run sums its own partial dw; the partials are then reduced once, in run order.
    let per_run = g.images_per_run();
    let runs = g.batch.div_ceil(per_run);
    let dx_runs: Vec<Option<&mut [f32]>> = match dx {
        Some(dx) => dx.chunks_mut(per_run * x_image).map(Some).collect(),
        None => (0..runs).map(|_| None).collect(),
    };
    let dw_len = if dw.is_some() { w.len() } else { 0 };
    let partials = map_runs(dx_runs, |run, dx_run| {
        let images = run * per_run..((run + 1) * per_run).min(g.batch);
        let mut dw_part = vec![0.0; dw_len];
        let dw_run = (dw_len > 0).then_some(&mut dw_part[..]);
        backward_images(g, x, w, dy, images, dx_run, dw_run);
        dw_part
    });
    if let Some(dw) = dw {
        for part in &partials {
            for (d, p) in dw.iter_mut().zip(part) {
                *d += p;
            }
        }
    }
}

/// `dbias[o] = Σ_{n,p} dy[n, o, p]`: the row sums of `dy[N·O, P]` as a product with a
/// column of ones, then a sum over the batch.
fn bias_grad(g: &Conv2dGeometry, dy: &[f32], dbias: &mut [f32]) {
    let (o, positions) = (g.out_channels, g.positions());
    dbias.fill(0.0);
    if o == 0 || positions == 0 {
        return;
    }
    let ones = vec![1.0; positions];
    let mut row_sums = vec![0.0; g.batch * o];
    let (dy_rows, column) = (mat(dy, 0, positions, 1), mat(&ones, 0, 1, 1));
    matmul(&mut row_sums, 0, dy_rows, column, GemmDims { m: g.batch * o, n: 1, k: positions }, Store::Overwrite);
    for sums_n in row_sums.chunks_exact(o) {
        for (db, s) in dbias.iter_mut().zip(sums_n) {
            *db += s;
        }
    }
}

/// Backward over a run of images: `dx_run` holds exactly their input gradients (written),
/// `dw_part` (zeroed) receives their summed weight gradient.
fn backward_images(
    g: &Conv2dGeometry,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    images: std::ops::Range<usize>,
    mut dx_run: Option<&mut [f32]>,
    mut dw_part: Option<&mut [f32]>,
) {
    let (positions, depth, x_image) = (g.positions(), g.depth(), g.input_len());
    let o = g.out_channels;
    let mut col = vec![0.0; if dw_part.is_some() { g.col_len() } else { 0 }];
    let mut dcol = vec![0.0; if dx_run.is_some() { g.col_len() } else { 0 }];
    // wᵀ[K, O] is w[O, K] read with swapped strides, and likewise colᵀ below.
    let w_t = mat(w, 0, 1, depth);
    let first = images.start;
    for n in images {
        let dy_n = mat(dy, n * o * positions, positions, 1);
        let x_n = &x[n * x_image..(n + 1) * x_image];
        if let Some(dw_part) = dw_part.as_deref_mut() {
            let col_t = if g.is_pointwise() {
                mat(x_n, 0, 1, positions)
            } else {
                im2col(g, x_n, &mut col);
                mat(&col, 0, 1, positions)
            };
            matmul(dw_part, 0, dy_n, col_t, GemmDims { m: o, n: depth, k: positions }, Store::Accumulate);
        }
        if let Some(dx_run) = dx_run.as_deref_mut() {
            let dx_n = &mut dx_run[(n - first) * x_image..(n - first + 1) * x_image];
            if g.is_pointwise() {
                matmul(dx_n, 0, w_t, dy_n, GemmDims { m: depth, n: positions, k: o }, Store::Overwrite);
            } else {
                matmul(&mut dcol, 0, w_t, dy_n, GemmDims { m: depth, n: positions, k: o }, Store::Overwrite);
                dx_n.fill(0.0);
                col2im(g, &dcol, dx_n);
            }
        }
    }
}

/// Element (i, j) of the operand is `data[offset + i·row_stride + j·col_stride]`.
fn mat(data: &[f32], offset: usize, row_stride: usize, col_stride: usize) -> MatRef<'_> {
    let (row_stride, col_stride) = (row_stride as isize, col_stride as isize);
    MatRef { data, offset, row_stride, col_stride }
}

/// The outputs `lo..hi` (out of `out_len`) whose input `out·stride + offset − padding`
/// falls inside `0..size`; `offset` is the kernel tap (kh or kw).
fn valid_outputs(offset: usize, size: usize, out_len: usize, stride: usize, padding: usize) -> (usize, usize) {
    let lo = padding.saturating_sub(offset).div_ceil(stride);
    let hi = (size + padding).saturating_sub(offset).div_ceil(stride).min(out_len);
    (lo.min(hi), hi)
}

/// One image: `col[(c·KH + kh)·KW + kw, oh·OW + ow] = x[c, oh·s + kh − p, ow·s + kw − p]`,
/// zero where that falls in the padding.
fn im2col(g: &Conv2dGeometry, x: &[f32], col: &mut [f32]) {
    let (out_h, out_w) = (g.out_height(), g.out_width());
    let (s, p) = (g.stride, g.padding);
    let taps = g.kernel_h * g.kernel_w;
    for (r, row) in col.chunks_exact_mut(out_h * out_w).enumerate() {
        let (c, kh, kw) = (r / taps, (r % taps) / g.kernel_w, r % g.kernel_w);
        let plane = &x[c * g.height * g.width..(c + 1) * g.height * g.width];
        let (oh_lo, oh_hi) = valid_outputs(kh, g.height, out_h, s, p);
        let (ow_lo, ow_hi) = valid_outputs(kw, g.width, out_w, s, p);
        if ow_lo == ow_hi {
            // This tap only ever sees padding (a wide pad around a narrow image).
            row.fill(0.0);
            continue;
        }
        row[..oh_lo * out_w].fill(0.0);
        row[oh_hi * out_w..].fill(0.0);
        for oh in oh_lo..oh_hi {
            let out = &mut row[oh * out_w..(oh + 1) * out_w];
            out[..ow_lo].fill(0.0);
            out[ow_hi..].fill(0.0);
            let start = (oh * s + kh - p) * g.width + ow_lo * s + kw - p;
            let src = &plane[start..];
            let out = &mut out[ow_lo..ow_hi];
            if s == 1 {
                out.copy_from_slice(&src[..out.len()]);
            } else {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = src[i * s];
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: every column entry is added back onto the input it came from.
fn col2im(g: &Conv2dGeometry, col: &[f32], dx: &mut [f32]) {
    let (out_h, out_w) = (g.out_height(), g.out_width());
    let (s, p) = (g.stride, g.padding);
    let taps = g.kernel_h * g.kernel_w;
    for (r, row) in col.chunks_exact(out_h * out_w).enumerate() {
        let (c, kh, kw) = (r / taps, (r % taps) / g.kernel_w, r % g.kernel_w);
        let plane = &mut dx[c * g.height * g.width..(c + 1) * g.height * g.width];
        let (oh_lo, oh_hi) = valid_outputs(kh, g.height, out_h, s, p);
        let (ow_lo, ow_hi) = valid_outputs(kw, g.width, out_w, s, p);
        if ow_lo == ow_hi {
            continue;
        }
        for oh in oh_lo..oh_hi {
            let start = (oh * s + kh - p) * g.width + ow_lo * s + kw - p;
            let dst = &mut plane[start..];
            let src = &row[oh * out_w + ow_lo..oh * out_w + ow_hi];
            for (i, v) in src.iter().enumerate() {
                dst[i * s] += v;
            }
        }
    }
}

/// Naive direct convolution for tests and the bench.
pub fn conv2d_reference(g: &Conv2dGeometry, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    g.check_lengths(x, w, "conv2d_reference");
    let widen = |v: &[f32]| v.iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
    let bias = bias.map(widen);
    let y = direct_f64(g, &widen(x), &widen(w), bias.as_deref());
    y.into_iter().map(|v| v as f32).collect()
}

/// Naive `(dx, dw, dbias)` of [`conv2d_backward`] for the bench and the tests, summed in f64
/// from the definition: every term `x[i]·w[j]` of `y[t]` sends `dy[t]·w[j]` to `dx[i]` and
/// `dy[t]·x[i]` to `dw[j]`; `dbias[o]` sums channel `o` of `dy`.
pub fn conv2d_backward_reference(
    g: &Conv2dGeometry,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    g.check_lengths(x, w, "conv2d_backward_reference");
    let positions = g.out_height() * g.out_width();
    assert_eq!(dy.len(), g.batch * g.out_channels * positions, "conv2d_backward_reference: dy has the wrong length");
    let (mut dx, mut dw, mut dbias) = (vec![0.0f64; x.len()], vec![0.0f64; w.len()], vec![0.0f64; g.out_channels]);
    for (t, &d) in dy.iter().enumerate() {
        dbias[t / positions % g.out_channels] += f64::from(d);
    }
    for_each_term(g, |t, i, j| {
        let d = f64::from(dy[t]);
        dx[i] += d * f64::from(w[j]);
        dw[j] += d * f64::from(x[i]);
    });
    let narrow = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect();
    (narrow(dx), narrow(dw), narrow(dbias))
}

/// The definition, summed in f64: `y[n,o,oh,ow] = bias[o] + Σ_{c,kh,kw} x[n,c,ih,iw]·w[o,c,kh,kw]`
/// with `ih = oh·s + kh − p`, `iw = ow·s + kw − p`.
fn direct_f64(g: &Conv2dGeometry, x: &[f64], w: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
    let positions = g.out_height() * g.out_width();
    let mut y: Vec<f64> = (0..g.batch * g.out_channels * positions)
        .map(|t| bias.map_or(0.0, |b| b[t / positions % g.out_channels]))
        .collect();
    for_each_term(g, |t, i, j| y[t] += x[i] * w[j]);
    y
}

/// Calls `term(t, i, j)` for every product `x[i]·w[j]` of the sum that is `y[t]`, outputs in
/// row-major order and each output's terms in `(c, kh, kw)` order; taps in the padding have
/// no term.
fn for_each_term(g: &Conv2dGeometry, mut term: impl FnMut(usize, usize, usize)) {
    let (out_h, out_w) = (g.out_height(), g.out_width());
    let mut t = 0;
    for n in 0..g.batch {
        for o in 0..g.out_channels {
            for oh in 0..out_h {
                for ow in 0..out_w {
                    for c in 0..g.in_channels {
                        for kh in 0..g.kernel_h {
                            for kw in 0..g.kernel_w {
                                let ih = (oh * g.stride + kh).wrapping_sub(g.padding);
                                let iw = (ow * g.stride + kw).wrapping_sub(g.padding);
                                if ih < g.height && iw < g.width {
                                    let i = ((n * g.in_channels + c) * g.height + ih) * g.width + iw;
                                    let j = ((o * g.in_channels + c) * g.kernel_h + kh) * g.kernel_w + kw;
                                    term(t, i, j);
                                }
                            }
                        }
                    }
                    t += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, check_gradient, oracle, Tolerance};
    use proptest::prelude::*;

    /// Small geometries, always with at least one output position.
    fn geometry(max_batch: usize, max_size: usize) -> impl Strategy<Value = Conv2dGeometry> {
        (
            1..=max_batch,
            1..=3usize,
            1..=3usize,
            prop::sample::select(vec![1usize, 3, 7]),
            prop::sample::select(vec![1usize, 3, 7]),
            1..=2usize,
            prop::sample::select(vec![0usize, 1, 3]),
            1..=max_size,
            1..=max_size,
        )
            .prop_map(|(batch, c, o, kh, kw, stride, padding, dh, dw)| Conv2dGeometry {
                batch,
                in_channels: c,
                out_channels: o,
                // At least as large as the kernel once padded, plus a little extra.
                height: (kh + dh).saturating_sub(2 * padding + 1).max(1),
                width: (kw + dw).saturating_sub(2 * padding + 1).max(1),
                kernel_h: kh,
                kernel_w: kw,
                stride,
                padding,
            })
    }

    fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-2.0f32..2.0, len)
    }

    #[test]
    fn output_size_matches_pytorch() {
        let g = Conv2dGeometry {
            batch: 1,
            in_channels: 1,
            out_channels: 1,
            height: 32,
            width: 7,
            kernel_h: 3,
            kernel_w: 7,
            stride: 2,
            padding: 1,
        };
        assert_eq!((g.out_height(), g.out_width()), (16, 2));
        assert_eq!(output_size(2, 5, 1, 1), 0);
    }

    /// Deterministic values in [-1, 1].
    fn wave(len: usize, frequency: f32) -> Vec<f32> {
        (0..len).map(|i| (i as f32 * frequency).sin()).collect()
    }

    /// Shapes large enough for several runs on the thread pool (and one pointwise
    /// convolution with stride 2, which still goes through im2col). Forward against the
    /// reference; backward by the adjoint identities `⟨dx, v⟩ = ⟨dy, conv(v, w)⟩` and
    /// `⟨dw, u⟩ = ⟨dy, conv(x, u)⟩` for random probes `v`, `u` (conv is linear in each).
    #[test]
    fn threaded_shapes_match_reference_and_adjoint() {
        for (c, o, size, k, stride, padding) in
            [(16, 16, 10, 1, 1, 0), (4, 6, 9, 3, 1, 1), (3, 8, 12, 7, 2, 3), (6, 4, 8, 1, 2, 0)]
        {
            let g = Conv2dGeometry {
                batch: 5,
                in_channels: c,
                out_channels: o,
                height: size,
                width: size + 1,
                kernel_h: k,
                kernel_w: k,
                stride,
                padding,
            };
            let (x, w) = (wave(g.batch * g.input_len(), 0.37), wave(o * g.depth(), 0.91));
            let (bias, dy) = (wave(o, 1.7), wave(g.batch * o * g.positions(), 0.23));
            let mut y = vec![f32::NAN; dy.len()];
            conv2d_forward(&g, &x, &w, Some(&bias), &mut y);
            let expected = direct_f64(&g, &oracle::widen(&x), &oracle::widen(&w), Some(&oracle::widen(&bias)));
            assert_close("y", &y, &expected, Tolerance::uniform(1e-5));

            let (mut dx, mut dw, mut dbias) = (vec![f32::NAN; x.len()], vec![f32::NAN; w.len()], vec![f32::NAN; o]);
            conv2d_backward(&g, &x, &w, &dy, Some(&mut dx), Some(&mut dw), Some(&mut dbias));
            let (x64, w64, dy64) = (oracle::widen(&x), oracle::widen(&w), oracle::widen(&dy));
            for probe in 1..=3 {
                let v = oracle::widen(&wave(x.len(), 0.5 + probe as f32));
                let u = oracle::widen(&wave(w.len(), 0.2 + probe as f32));
                let want_dx = oracle::dot(&dy64, &direct_f64(&g, &v, &w64, None));
                let want_dw = oracle::dot(&dy64, &direct_f64(&g, &x64, &u, None));
                assert_close(
                    "dx·probe",
                    &[oracle::dot(&oracle::widen(&dx), &v) as f32],
                    &[want_dx],
                    Tolerance::uniform(1e-5),
                );
                assert_close(
                    "dw·probe",
                    &[oracle::dot(&oracle::widen(&dw), &u) as f32],
                    &[want_dw],
                    Tolerance::uniform(1e-5),
                );
            }
            let want_dbias: Vec<f64> =
                (0..o).map(|ch| dy64.chunks(g.positions()).skip(ch).step_by(o).flatten().sum()).collect();
            assert_close("dbias", &dbias, &want_dbias, Tolerance::uniform(1e-5));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn forward_matches_reference(
            (g, x, w, bias, with_bias) in geometry(4, 9).prop_flat_map(|g| {
                (Just(g), values(g.batch * g.input_len()), values(g.out_channels * g.depth()),
                 values(g.out_channels), any::<bool>())
            })
        ) {
            let bias = with_bias.then_some(&bias[..]);
            let mut y = vec![f32::NAN; g.batch * g.out_channels * g.positions()];
            conv2d_forward(&g, &x, &w, bias, &mut y);
            let expected = direct_f64(&g, &oracle::widen(&x), &oracle::widen(&w), bias.map(oracle::widen).as_deref());
            assert_close("y", &y, &expected, Tolerance::uniform(1e-5));
            let reference = conv2d_reference(&g, &x, &w, bias);
            assert_close("reference", &reference, &expected, Tolerance::uniform(1e-6));
        }

        #[test]
        fn backward_matches_finite_differences(
            (g, x, w, bias, r) in geometry(3, 5).prop_flat_map(|g| {
                let out = g.batch * g.out_channels * g.positions();
                (Just(g), values(g.batch * g.input_len()), values(g.out_channels * g.depth()),
                 values(g.out_channels), values(out))
            }),
        ) {
            // Stale (NaN) gradient buffers: the backward must overwrite every element.
            let mut dx = vec![f32::NAN; x.len()];
            let mut dw = vec![f32::NAN; w.len()];
            let mut dbias = vec![f32::NAN; bias.len()];
            conv2d_backward(&g, &x, &w, &r, Some(&mut dx), Some(&mut dw), Some(&mut dbias));
            let (r64, x64, w64, b64) = (oracle::widen(&r), oracle::widen(&x), oracle::widen(&w), oracle::widen(&bias));
            check_gradient("conv dx", &dx, &x64, |p| oracle::dot(&r64, &direct_f64(&g, p, &w64, Some(&b64))));
            check_gradient("conv dw", &dw, &w64, |p| oracle::dot(&r64, &direct_f64(&g, &x64, p, Some(&b64))));
            check_gradient("conv dbias", &dbias, &b64, |p| oracle::dot(&r64, &direct_f64(&g, &x64, &w64, Some(p))));
            // The naive backward the bench checks against agrees.
            let (want_dx, want_dw, want_dbias) = conv2d_backward_reference(&g, &x, &w, &r);
            assert_close("reference dx", &want_dx, &dx, Tolerance::uniform(1e-5));
            assert_close("reference dw", &want_dw, &dw, Tolerance::uniform(1e-5));
            assert_close("reference dbias", &want_dbias, &dbias, Tolerance::uniform(1e-5));

            // Each gradient alone gives the same result as all three together.
            let mut dw_alone = vec![f32::NAN; w.len()];
            conv2d_backward(&g, &x, &w, &r, None, Some(&mut dw_alone), None);
            prop_assert_eq!(&dw_alone, &dw);
            let mut dx_alone = vec![f32::NAN; x.len()];
            conv2d_backward(&g, &x, &w, &r, Some(&mut dx_alone), None, None);
            prop_assert_eq!(&dx_alone, &dx);
        }
    }
}
