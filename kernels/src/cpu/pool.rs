//! Pooling over the `H×W` planes of `x[N, C, H, W]`: max pooling with a square window, and
//! global average pooling (one mean per plane).
//!
//! PyTorch equivalents: `nn.MaxPool2d(kernel, stride, padding)` (dilation 1,
//! `ceil_mode = False`, padding counts as −∞) and `nn.AdaptiveAvgPool2d(1)` flattened to
//! `[N, C]`. Max pooling saves `argmax` (the winner's index in its `H·W` plane) for backward;
//! global average pooling saves nothing. The backward writes `dx = ...` (the crate's contract,
//! see `lib.rs`).
//!
//! Legend: `OH, OW` output height and width, `S = H·W` the plane size.

use rayon::prelude::*;

use crate::cpu::parallel;

/// `(size + 2·padding − kernel) / stride + 1` output positions along one axis (PyTorch's
/// floor mode), or 0 when the window is larger than the padded input.
pub fn max_pool2d_output_size(size: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    match (size + 2 * padding).checked_sub(kernel) {
        Some(span) => span / stride + 1,
        None => 0,
    }
}

/// The geometry of one max pooling, shared by the CPU kernels and the CUDA launchers:
/// `x[planes, height, width]` (planes = N·C), a square window of `kernel` with `stride` and
/// −∞ `padding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2d {
    /// `N·C`, the number of planes.
    pub planes: usize,
    /// `H`.
    pub height: usize,
    /// `W`.
    pub width: usize,
    /// Window side.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// −∞ padding on every side (at most `kernel / 2`).
    pub padding: usize,
}

impl MaxPool2d {
    /// `(OH, OW)`, PyTorch's floor mode.
    pub fn output_size(&self) -> (usize, usize) {
        (
            max_pool2d_output_size(self.height, self.kernel, self.stride, self.padding),
            max_pool2d_output_size(self.width, self.kernel, self.stride, self.padding),
        )
    }

    /// `N·H·W`, the length of `x` (and `dx`).
    pub fn input_len(&self) -> usize {
        self.planes * self.height * self.width
    }

    /// `N·OH·OW`, the length of `y`, `argmax` and `dy`.
    pub fn output_len(&self) -> usize {
        let (out_h, out_w) = self.output_size();
        self.planes * out_h * out_w
    }

    /// The window rule, checked once for both devices (the tensor layer turns the message
    /// into its error, the CUDA launchers into theirs): kernel and stride ≥ 1 and, as in
    /// PyTorch, `padding ≤ kernel / 2`, so every window holds at least one input.
    pub fn check(&self) -> Result<(), String> {
        let MaxPool2d { kernel, stride, padding, .. } = *self;
        if kernel == 0 || stride == 0 || padding > kernel / 2 {
            return Err(format!(
                "kernel {kernel}, stride {stride}, padding {padding}: needs kernel, stride ≥ 1, padding ≤ kernel/2"
            ));
        }
        Ok(())
    }

    /// Panics (naming `op`) unless the geometry holds and `x` and `y` have its lengths.
    fn assert_fits(&self, op: &str, x_len: usize, y_len: usize) {
        if let Err(message) = self.check() {
            panic!("{op}: {message}");
        }
        assert_eq!(x_len, self.input_len(), "{op}: x (or dx) has the wrong length");
        assert_eq!(y_len, self.output_len(), "{op}: y (or dy) has the wrong length");
    }
}

/// Max pooling with −∞ padding (PyTorch `MaxPool2d` semantics): `y[N·C, OH, OW]`, and
/// `argmax[i]` = the flat index of the chosen input in its `H·W` plane. A NaN in a window
/// wins it.
pub fn max_pool2d_forward(g: &MaxPool2d, x: &[f32], y: &mut [f32], argmax: &mut [usize]) {
    g.assert_fits("max_pool2d_forward", x.len(), y.len());
    assert_eq!(argmax.len(), y.len(), "max_pool2d_forward: argmax has the wrong length");
    let MaxPool2d { planes, height, width, kernel, stride, padding } = *g;
    let (out_h, out_w) = g.output_size();
    let (plane_in, plane_out) = (height * width, out_h * out_w);
    if plane_out == 0 {
        return;
    }
    // The window's rows (or columns) for output `o`, clipped to the image.
    let window = |o: usize, size: usize| {
        let end = (o * stride + kernel).saturating_sub(padding).min(size);
        ((o * stride).saturating_sub(padding).min(end), end)
    };
    let pool_plane = |(i, (y_p, a_p)): (usize, (&mut [f32], &mut [usize]))| {
        let x_p = &x[i * plane_in..(i + 1) * plane_in];
        for oh in 0..out_h {
            let (h_lo, h_hi) = window(oh, height);
            for ow in 0..out_w {
                let (w_lo, w_hi) = window(ow, width);
                let (mut best, mut best_at) = (f32::NEG_INFINITY, h_lo * width + w_lo);
                for first in (h_lo..h_hi).map(|ih| ih * width + w_lo) {
                    for (at, &v) in (first..).zip(&x_p[first..first + w_hi - w_lo]) {
                        if v > best || v.is_nan() {
                            (best, best_at) = (v, at);
                        }
                    }
                }
                y_p[oh * out_w + ow] = best;
                a_p[oh * out_w + ow] = best_at;
            }
        }
    };
    let work_per_plane = plane_out * kernel * kernel;
    if parallel::should_parallelise(planes * work_per_plane) {
        y.par_chunks_mut(plane_out)
            .zip(argmax.par_chunks_mut(plane_out))
            .enumerate()
            .with_min_len(parallel::rows_per_task(work_per_plane))
            .for_each(pool_plane);
    } else {
        y.chunks_mut(plane_out).zip(argmax.chunks_mut(plane_out)).enumerate().for_each(pool_plane);
    }
}

// d/dx[n, c, argmax[n, c, o]] = dy[n, c, o]   (summed where windows share a winner)
/// `dx = 0`, then `dx[argmax] += dy` (a winner shared by windows gets every one's gradient)
pub fn max_pool2d_backward(g: &MaxPool2d, argmax: &[usize], dy: &[f32], dx: &mut [f32]) {
    g.assert_fits("max_pool2d_backward", dx.len(), dy.len());
    assert_eq!(argmax.len(), dy.len(), "max_pool2d_backward: argmax has the wrong length");
    let (out_h, out_w) = g.output_size();
    let (plane_in, plane_out) = (g.height * g.width, out_h * out_w);
    if plane_in == 0 || plane_out == 0 {
        dx.fill(0.0);
        return;
    }
    let scatter = |(dx_p, (dy_p, a_p)): (&mut [f32], (&[f32], &[usize]))| {
        dx_p.fill(0.0);
        for (&grad, &at) in dy_p.iter().zip(a_p) {
            dx_p[at] += grad;
        }
    };
    if parallel::should_parallelise(dy.len()) {
        dx.par_chunks_mut(plane_in)
            .zip(dy.par_chunks(plane_out).zip(argmax.par_chunks(plane_out)))
            .with_min_len(parallel::rows_per_task(plane_out))
            .for_each(scatter);
    } else {
        dx.chunks_mut(plane_in).zip(dy.chunks(plane_out).zip(argmax.chunks(plane_out))).for_each(scatter);
    }
}

/// y[N,C] = mean over H*W
pub fn global_avg_pool_forward(x: &[f32], batch: usize, channels: usize, spatial: usize, y: &mut [f32]) {
    assert_eq!(x.len(), batch * channels * spatial, "global_avg_pool_forward: x has the wrong length");
    assert_eq!(y.len(), batch * channels, "global_avg_pool_forward: y has the wrong length");
    // Summed in f64: the planes are short, and this keeps the mean exact to f32 rounding.
    parallel::for_each_row_block_mut(y, 1, spatial, |first, block| {
        for (i, out) in (first..).zip(block) {
            let plane = &x[i * spatial..(i + 1) * spatial];
            *out = (plane.iter().map(|&v| f64::from(v)).sum::<f64>() / spatial as f64) as f32;
        }
    });
}

// d/dx[n, c, s] = dy[n, c] / S
/// dx = dy / spatial broadcast over the plane
pub fn global_avg_pool_backward(dy: &[f32], batch: usize, channels: usize, spatial: usize, dx: &mut [f32]) {
    assert_eq!(dy.len(), batch * channels, "global_avg_pool_backward: dy has the wrong length");
    assert_eq!(dx.len(), batch * channels * spatial, "global_avg_pool_backward: dx has the wrong length");
    let inv = 1.0 / spatial as f32;
    parallel::for_each_row_block_mut(dx, spatial, spatial, |first, block| {
        for (i, plane) in (first..).zip(block.chunks_exact_mut(spatial)) {
            let g = dy[i] * inv;
            plane.fill(g);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, check_gradient, oracle, Tolerance};
    use proptest::prelude::*;

    /// (batch, channels, height, width, kernel, stride, padding), with a valid window.
    type Geometry = (usize, usize, usize, usize, usize, usize, usize);

    fn geometry() -> impl Strategy<Value = Geometry> {
        (
            1..=2usize,
            1..=3usize,
            prop::sample::select(vec![1usize, 2, 3, 7]),
            1..=2usize,
            0..=1usize,
            0..=5usize,
            0..=5usize,
        )
            .prop_map(|(n, c, k, s, p, dh, dw)| {
                let p = p.min(k / 2);
                let least = (k - 2 * p).max(1);
                (n, c, least + dh, least + dw, k, s, p)
            })
    }

    /// The kernels' geometry of a test geometry.
    fn pooling((n, c, h, w, k, s, p): Geometry) -> MaxPool2d {
        MaxPool2d { planes: n * c, height: h, width: w, kernel: k, stride: s, padding: p }
    }

    /// The input as distinct values `i/100` in shuffled order, so no window has a tie
    /// and a small step never changes a winner.
    fn distinct(len: usize) -> impl Strategy<Value = Vec<f32>> {
        Just((0..len).map(|i| i as f32 / 100.0 - 1.0).collect::<Vec<_>>()).prop_shuffle()
    }

    /// Max pooling by the definition over an explicitly −∞-padded copy of each plane.
    fn max_pool_reference(x: &[f64], g: Geometry) -> (Vec<f64>, Vec<usize>) {
        let (n, c, h, w, k, s, p) = g;
        let (oh, ow) = (max_pool2d_output_size(h, k, s, p), max_pool2d_output_size(w, k, s, p));
        let (ph, pw) = (h + 2 * p, w + 2 * p);
        let (mut y, mut arg) = (Vec::new(), Vec::new());
        for plane in x.chunks(h * w).take(n * c) {
            let mut padded = vec![(f64::NEG_INFINITY, 0); ph * pw];
            for (i, &v) in plane.iter().enumerate() {
                padded[(i / w + p) * pw + i % w + p] = (v, i);
            }
            for (r, q) in (0..oh * ow).map(|o| (o / ow * s, o % ow * s)) {
                let window = (0..k * k).map(|t| padded[(r + t / k) * pw + q + t % k]);
                let best = window.fold((f64::NEG_INFINITY, 0), |b, e| if e.0 > b.0 { e } else { b });
                y.push(best.0);
                arg.push(best.1);
            }
        }
        (y, arg)
    }

    #[test]
    fn output_size_matches_pytorch() {
        assert_eq!(max_pool2d_output_size(32, 3, 2, 1), 16);
        assert_eq!(max_pool2d_output_size(7, 7, 1, 3), 7);
        assert_eq!(max_pool2d_output_size(5, 3, 2, 0), 2);
        assert_eq!(max_pool2d_output_size(2, 5, 1, 1), 0);
    }

    #[test]
    fn nan_wins_its_window() {
        let x = [1.0, f32::NAN, 3.0, 2.0];
        let (mut y, mut argmax) = ([0.0; 1], [0; 1]);
        let g = MaxPool2d { planes: 1, height: 2, width: 2, kernel: 2, stride: 2, padding: 0 };
        max_pool2d_forward(&g, &x, &mut y, &mut argmax);
        assert!(y[0].is_nan());
        assert_eq!(argmax[0], 1);
    }

    #[test]
    fn large_planes_take_the_threaded_path_and_match() {
        // 4·16 planes of 64×62: above the parallel threshold forward and backward.
        let g = (4, 16, 64, 62, 3, 2, 1);
        let (n, c, h, w, k, s, p) = g;
        let (oh, ow) = (max_pool2d_output_size(h, k, s, p), max_pool2d_output_size(w, k, s, p));
        let len = n * c * h * w;
        // Distinct values (7919 is prime and does not divide len), so no window has a tie.
        let x: Vec<f32> = (0..len).map(|i| ((i * 7919) % len) as f32).collect();
        let dy: Vec<f32> = (0..n * c * oh * ow).map(|i| (i as f32 * 0.3).sin()).collect();
        let (mut y, mut argmax) = (vec![0.0; dy.len()], vec![0; dy.len()]);
        let pool = pooling(g);
        max_pool2d_forward(&pool, &x, &mut y, &mut argmax);
        let (want_y, want_arg) = max_pool_reference(&oracle::widen(&x), g);
        assert_eq!(oracle::widen(&y), want_y);
        assert_eq!(argmax, want_arg);

        let mut dx = vec![f32::NAN; len];
        max_pool2d_backward(&pool, &argmax, &dy, &mut dx);
        let mut want = vec![0.0; len];
        for (i, (&g, &at)) in dy.iter().zip(&want_arg).enumerate() {
            want[i / (oh * ow) * h * w + at] += f64::from(g);
        }
        assert_close("dx", &dx, &want, Tolerance::uniform(1e-6));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn max_pool_matches_reference_and_finite_differences(
            (g, x, r) in geometry().prop_flat_map(|g| {
                let (n, c, h, w, k, s, p) = g;
                let out = n * c * max_pool2d_output_size(h, k, s, p) * max_pool2d_output_size(w, k, s, p);
                (Just(g), distinct(n * c * h * w), prop::collection::vec(-2.0f32..2.0, out))
            })
        ) {
            let (mut y, mut argmax) = (vec![0.0; r.len()], vec![0; r.len()]);
            max_pool2d_forward(&pooling(g), &x, &mut y, &mut argmax);
            let (want_y, want_arg) = max_pool_reference(&oracle::widen(&x), g);
            prop_assert_eq!(oracle::widen(&y), want_y);
            prop_assert_eq!(&argmax, &want_arg);

            // Stale (NaN) contents: every element is written, zeros where nothing wins.
            let mut dx = vec![f32::NAN; x.len()];
            max_pool2d_backward(&pooling(g), &argmax, &r, &mut dx);
            let r64 = oracle::widen(&r);
            check_gradient("d max_pool", &dx, &oracle::widen(&x), |x| oracle::dot(&r64, &max_pool_reference(x, g).0));
        }

        #[test]
        fn global_avg_pool_matches_mean_and_finite_differences(
            (n, c, s, x, r) in (1..=3usize, 1..=4usize, 1..=20usize).prop_flat_map(|(n, c, s)| {
                let values = |len| prop::collection::vec(-2.0f32..2.0, len);
                (Just(n), Just(c), Just(s), values(n * c * s), values(n * c))
            })
        ) {
            let mean = |x: &[f64]| -> Vec<f64> {
                x.chunks(s).map(|p| p.iter().sum::<f64>() / s as f64).collect()
            };
            let mut y = vec![0.0; n * c];
            global_avg_pool_forward(&x, n, c, s, &mut y);
            assert_close("y", &y, &mean(&oracle::widen(&x)), Tolerance::uniform(1e-6));

            let mut dx = vec![f32::NAN; x.len()];
            global_avg_pool_backward(&r, n, c, s, &mut dx);
            let r64 = oracle::widen(&r);
            check_gradient("d global_avg_pool", &dx, &oracle::widen(&x), |x| oracle::dot(&r64, &mean(x)));
        }
    }
}
