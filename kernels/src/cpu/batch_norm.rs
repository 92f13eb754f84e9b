//! Batch normalisation over `N, H·W` for each channel of an `x[N, C, S]` tensor (`S = H·W`):
//! `y = (x − mean[c])·rstd[c]·weight[c] + bias[c]`, with `rstd = 1/√(var + eps)`
//! (Ioffe & Szegedy 2015, Algorithm 1).
//!
//! PyTorch equivalent: `torch.nn.BatchNorm2d` (`F.batch_norm`), training and eval mode.
//! Training uses the batch statistics (biased variance) and saves `mean[C]` and `rstd[C]`
//! for backward, which also reads `x` again; eval uses the running statistics.
//! The backward writes its gradients: `dx = ...`, `dweight = ...`, `dbias = ...` (the crate's
//! contract, see `lib.rs`).
//!
//! Statistics are summed in eight f32 lanes per plane (so the loops vectorise) and in f64
//! across lanes and planes, two passes (mean, then squared deviations) for a stable variance.

use crate::cpu::norm::NormGrads;
use crate::cpu::parallel;

/// Independent f32 accumulators, enough for the compiler to keep the loop in SIMD registers.
const LANES: usize = 8;

/// Sizes and constants of one batch norm call, shared by the CPU and CUDA kernels
/// (`cuda::batch_norm` takes the same struct): `x`, `y`, `dy` and `dx` are `[N, C, S]`, every
/// per-channel operand `[C]`. [`BatchNormDims::check`] is the one validation both devices run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormDims {
    /// `N`: images.
    pub batch: usize,
    /// `C`: channels, each normalised on its own.
    pub channels: usize,
    /// `S = H·W`: values of one plane.
    pub spatial: usize,
    /// Added to the variance under the square root (forwards only: the training backward
    /// reads the saved `rstd`).
    pub eps: f32,
    /// Weight of the batch statistics in the running statistics' update (training forward
    /// only).
    pub momentum: f32,
}

impl BatchNormDims {
    /// Elements of `x` (and of `y`, `dy`, `dx`).
    pub fn len(&self) -> usize {
        self.batch * self.channels * self.spatial
    }

    /// True when there is nothing to normalise.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the `[N, C, S]` operands (`planes`: name and length) and the per-channel ones
    /// (`per_channel`, `None` where absent) fit these sizes; the error says what does not.
    pub fn check(&self, planes: &[(&str, usize)], per_channel: &[(&str, Option<usize>)]) -> Result<(), String> {
        let wanted = planes.iter().map(|&(name, len)| (name, Some(len), self.len()));
        let per_channel = per_channel.iter().map(|&(name, len)| (name, len, self.channels));
        for (name, got, want) in wanted.chain(per_channel) {
            if let Some(got) = got.filter(|&got| got != want) {
                return Err(format!("{name} has {got} elements, expected {want}"));
            }
        }
        Ok(())
    }

    /// Panics naming `op` unless [`BatchNormDims::check`] accepts the operands.
    fn assert_fits(&self, op: &str, planes: &[(&str, usize)], per_channel: &[(&str, Option<usize>)]) {
        if let Err(message) = self.check(planes, per_channel) {
            panic!("{op}: {message}");
        }
    }
}

/// The optional affine parameters `weight[C]` and `bias[C]` (`None`: 1 and 0).
#[derive(Debug)]
pub struct Affine<'a, T: ?Sized> {
    /// Scales every channel after normalising.
    pub weight: Option<&'a T>,
    /// Shifts every channel after scaling.
    pub bias: Option<&'a T>,
}

// A derive would ask `T: Clone`; the references are copied whatever `T` is.
impl<T: ?Sized> Clone for Affine<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: ?Sized> Copy for Affine<'_, T> {}

/// The running statistics `[C]` each: read by evaluation (`S = &` a buffer), updated in place
/// by training (`S = &mut` a buffer).
#[derive(Debug)]
pub struct RunningStats<S> {
    /// The running mean.
    pub mean: S,
    /// The running (unbiased) variance.
    pub var: S,
}

/// The batch statistics `[C]` each that training saves for its backward (`S = &mut` a buffer
/// when written, `&` when read).
#[derive(Debug)]
pub struct BatchStats<S> {
    /// The batch mean.
    pub mean: S,
    /// `1/√(var + eps)` with the batch's biased variance.
    pub rstd: S,
}

/// Training mode: batch statistics (biased variance for normalisation). Writes y, saves mean[C] and rstd[C] for backward, and updates running stats in place: running = (1−momentum)·running + momentum·batch_stat, with the UNBIASED variance (n/(n−1)) for running_var, like PyTorch. weight/bias None = no affine.
///
/// `n = batch·spatial` must be at least 2 for the unbiased variance (PyTorch refuses
/// training on one value per channel); with `n = 1` the running variance becomes NaN.
pub fn batch_norm_train_forward(
    x: &[f32],
    affine: Affine<'_, [f32]>,
    dims: &BatchNormDims,
    running: RunningStats<&mut [f32]>,
    y: &mut [f32],
    stats: BatchStats<&mut [f32]>,
) {
    let (Affine { weight, bias }, RunningStats { mean: running_mean, var: running_var }) = (affine, running);
    let BatchStats { mean, rstd } = stats;
    dims.assert_fits(
        "batch_norm_train_forward",
        &[("x", x.len()), ("y", y.len())],
        &[
            ("weight", weight.map(<[f32]>::len)),
            ("bias", bias.map(<[f32]>::len)),
            ("running_mean", Some(running_mean.len())),
            ("running_var", Some(running_var.len())),
            ("mean", Some(mean.len())),
            ("rstd", Some(rstd.len())),
        ],
    );
    let BatchNormDims { batch, channels, spatial, eps, momentum } = *dims;
    if x.is_empty() {
        return;
    }
    let count = (batch * spatial) as f64;
    let stats = per_channel(channels, batch * spatial, |c| {
        let planes = || (0..batch).map(|n| plane(x, n, c, channels, spatial));
        let mu = planes().map(|p| lane_sum(p, p, |v, _| v)).sum::<f64>() / count;
        let mu32 = mu as f32;
        let squares = planes().map(|p| lane_sum(p, p, |v, _| (v - mu32) * (v - mu32)));
        (mu, squares.sum::<f64>() / count)
    });
    let mut scale = vec![0.0; channels];
    let mut shift = vec![0.0; channels];
    for (c, &(mu, var)) in stats.iter().enumerate() {
        let r = 1.0 / (var + f64::from(eps)).sqrt();
        mean[c] = mu as f32;
        rstd[c] = r as f32;
        scale[c] = (r * weight.map_or(1.0, |w| f64::from(w[c]))) as f32;
        shift[c] = bias.map_or(0.0, |b| b[c]) - mean[c] * scale[c];
        let unbiased = var * count / (count - 1.0);
        running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mean[c];
        running_var[c] = (1.0 - momentum) * running_var[c] + momentum * unbiased as f32;
    }
    scale_and_shift(x, channels, spatial, &scale, &shift, y);
}

/// Eval mode: normalise with the running statistics.
pub fn batch_norm_eval_forward(
    x: &[f32],
    affine: Affine<'_, [f32]>,
    dims: &BatchNormDims,
    running: RunningStats<&[f32]>,
    y: &mut [f32],
) {
    let (Affine { weight, bias }, RunningStats { mean: running_mean, var: running_var }) = (affine, running);
    dims.assert_fits(
        "batch_norm_eval_forward",
        &[("x", x.len()), ("y", y.len())],
        &[
            ("weight", weight.map(<[f32]>::len)),
            ("bias", bias.map(<[f32]>::len)),
            ("running_mean", Some(running_mean.len())),
            ("running_var", Some(running_var.len())),
        ],
    );
    let BatchNormDims { channels, spatial, eps, .. } = *dims;
    let scale: Vec<f32> = (0..channels).map(|c| weight.map_or(1.0, |w| w[c]) / (running_var[c] + eps).sqrt()).collect();
    let shift: Vec<f32> = (0..channels).map(|c| bias.map_or(0.0, |b| b[c]) - running_mean[c] * scale[c]).collect();
    scale_and_shift(x, channels, spatial, &scale, &shift, y);
}

// d/dx = weight·rstd/n · (n·dy − Σdy − x̂·Σ(dy·x̂)),  x̂ = (x − mean)·rstd,
// d/dweight = Σ dy·x̂,  d/dbias = Σ dy   (sums over the n = N·S values of a channel)
/// Training-mode backward: dx = ..., dweight = Σ dy·x̂, dbias = Σ dy.
pub fn batch_norm_train_backward(
    x: &[f32],
    weight: Option<&[f32]>,
    stats: BatchStats<&[f32]>,
    dy: &[f32],
    dims: &BatchNormDims,
    grads: NormGrads<'_, [f32]>,
) {
    let (BatchStats { mean, rstd }, NormGrads { dx, dweight, dbias }) = (stats, grads);
    dims.assert_fits(
        "batch_norm_train_backward",
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[
            ("weight", weight.map(<[f32]>::len)),
            ("mean", Some(mean.len())),
            ("rstd", Some(rstd.len())),
            ("dweight", dweight.as_ref().map(|g| g.len())),
            ("dbias", dbias.as_ref().map(|g| g.len())),
        ],
    );
    let BatchNormDims { batch, channels, spatial, .. } = *dims;
    // Per channel: (Σ dy, Σ dy·x̂).
    let sums = per_channel(channels, batch * spatial, |c| {
        let (mut dy_sum, mut dy_dev) = (0.0, 0.0);
        for n in 0..batch {
            let (g, xs, m) = (plane(dy, n, c, channels, spatial), plane(x, n, c, channels, spatial), mean[c]);
            dy_sum += lane_sum(g, g, |v, _| v);
            dy_dev += lane_sum(g, xs, |gv, xv| gv * (xv - m));
        }
        (dy_sum, dy_dev * f64::from(rstd[c]))
    });
    if let Some(dweight) = dweight {
        for (dw, &(_, dy_xhat)) in dweight.iter_mut().zip(&sums) {
            *dw = dy_xhat as f32;
        }
    }
    if let Some(dbias) = dbias {
        for (db, &(dy_sum, _)) in dbias.iter_mut().zip(&sums) {
            *db = dy_sum as f32;
        }
    }
    // Expanded per channel into dx = k·dy + slope·x + offset, one fused pass.
    let count = (batch * spatial) as f64;
    let coefficients: Vec<[f32; 3]> = (0..channels)
        .map(|c| {
            let r = f64::from(rstd[c]);
            let k = r * weight.map_or(1.0, |w| f64::from(w[c]));
            let (dy_sum, dy_xhat) = sums[c];
            let slope = -k * r * dy_xhat / count;
            let offset = -k * dy_sum / count - slope * f64::from(mean[c]);
            [k as f32, slope as f32, offset as f32]
        })
        .collect();
    parallel::for_each_row_block_mut(dx, spatial, 3 * spatial, |first, block| {
        for (i, dx_p) in (first..).zip(block.chunks_exact_mut(spatial)) {
            let [k, slope, offset] = coefficients[i % channels];
            let (x_p, dy_p) = (&x[i * spatial..(i + 1) * spatial], &dy[i * spatial..(i + 1) * spatial]);
            for ((d, &xv), &g) in dx_p.iter_mut().zip(x_p).zip(dy_p) {
                *d = k * g + slope * xv + offset;
            }
        }
    });
}

/// The `S` values of channel `c` in image `n`.
fn plane(x: &[f32], n: usize, c: usize, channels: usize, spatial: usize) -> &[f32] {
    let start = (n * channels + c) * spatial;
    &x[start..start + spatial]
}

/// `f(c)` for every channel in order, on the rayon pool when the channels are large enough.
fn per_channel<T: Send>(channels: usize, per_channel: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    let blocks = parallel::map_row_ranges(channels, 2 * per_channel, |cs| cs.map(&f).collect());
    blocks.into_iter().flat_map(|b: Vec<T>| b).collect()
}

/// `Σ f(a_i, b_i)` over two equally long slices.
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    let mut acc = [0.0f32; LANES];
    let (a_body, b_body) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_body.remainder().iter().zip(b_body.remainder()).map(|(&p, &q)| f(p, q)).sum();
    for (ca, cb) in a_body.zip(b_body) {
        for ((s, &p), &q) in acc.iter_mut().zip(ca).zip(cb) {
            *s += f(p, q);
        }
    }
    acc.iter().map(|&v| f64::from(v)).sum::<f64>() + f64::from(tail)
}

/// `y = x·scale[c] + shift[c]` plane by plane.
fn scale_and_shift(x: &[f32], channels: usize, spatial: usize, scale: &[f32], shift: &[f32], y: &mut [f32]) {
    parallel::for_each_row_block_mut(y, spatial, spatial, |first, block| {
        for (i, y_p) in (first..).zip(block.chunks_exact_mut(spatial)) {
            let (a, b) = (scale[i % channels], shift[i % channels]);
            for (o, &v) in y_p.iter_mut().zip(&x[i * spatial..(i + 1) * spatial]) {
                *o = v * a + b;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{assert_close, check_gradient, oracle, Tolerance};
    use proptest::prelude::*;

    /// One random problem: `x` and `dy` are `[n, c, s]`, the rest `[c]`.
    #[derive(Debug, Clone)]
    struct Case {
        dims: (usize, usize, usize),
        x: Vec<f32>,
        dy: Vec<f32>,
        weight: Vec<f32>,
        bias: Vec<f32>,
        running_mean: Vec<f32>,
        running_var: Vec<f32>,
    }

    fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-3.0f32..3.0, len)
    }

    fn case() -> impl Strategy<Value = Case> {
        (1..=3usize, 1..=3usize, 2..=9usize).prop_flat_map(|(n, c, s)| {
            let len = n * c * s;
            let running_var = prop::collection::vec(0.1f32..4.0, c);
            (values(len), values(len), values(c), values(c), values(c), running_var).prop_map(
                move |(x, dy, weight, bias, running_mean, running_var)| Case {
                    dims: (n, c, s),
                    x,
                    dy,
                    weight,
                    bias,
                    running_mean,
                    running_var,
                },
            )
        })
    }

    /// Per-channel (mean, biased variance) of an `[N, C, S]` tensor, in f64.
    fn stats(x: &[f64], (batch, channels, spatial): (usize, usize, usize)) -> Vec<(f64, f64)> {
        (0..channels)
            .map(|c| {
                let values: Vec<f64> =
                    (0..batch).flat_map(|n| x[(n * channels + c) * spatial..][..spatial].iter().copied()).collect();
                let count = values.len() as f64;
                let mean = values.iter().sum::<f64>() / count;
                let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count;
                (mean, var)
            })
            .collect()
    }

    /// Training-mode forward by the definition, in f64.
    fn train_reference(x: &[f64], dims: (usize, usize, usize), weight: &[f64], bias: &[f64], eps: f64) -> Vec<f64> {
        let (_, channels, spatial) = dims;
        let stats = stats(x, dims);
        let channel = |i: usize| (i / spatial) % channels;
        let normalise = |(i, &v): (usize, &f64)| {
            let (c, (mean, var)) = (channel(i), stats[channel(i)]);
            (v - mean) / (var + eps).sqrt() * weight[c] + bias[c]
        };
        x.iter().enumerate().map(normalise).collect()
    }

    /// Runs the training forward pass; returns (y, mean, rstd) and updates the running stats.
    fn train_forward(case: &mut Case, affine: bool, eps: f32, momentum: f32) -> [Vec<f32>; 3] {
        let (n, c, s) = case.dims;
        let weight = affine.then_some(&case.weight[..]);
        let bias = affine.then_some(&case.bias[..]);
        let (mut y, mut mean, mut rstd) = (vec![0.0; n * c * s], vec![0.0; c], vec![0.0; c]);
        let (rm, rv) = (&mut case.running_mean, &mut case.running_var);
        let dims = BatchNormDims { batch: n, channels: c, spatial: s, eps, momentum };
        let (running, stats) = (
            RunningStats { mean: &mut rm[..], var: &mut rv[..] },
            BatchStats { mean: &mut mean[..], rstd: &mut rstd[..] },
        );
        batch_norm_train_forward(&case.x, Affine { weight, bias }, &dims, running, &mut y, stats);
        [y, mean, rstd]
    }

    /// Weight and bias as the reference sees them: ones and zeros without affine.
    fn affine_params(case: &Case, affine: bool) -> (Vec<f64>, Vec<f64>) {
        let c = case.dims.1;
        if affine {
            (oracle::widen(&case.weight), oracle::widen(&case.bias))
        } else {
            (vec![1.0; c], vec![0.0; c])
        }
    }

    /// Training backward on `case`, checked against central differences of the f64
    /// reference forward (`loss = Σ dy·y`), into stale (NaN) gradient buffers.
    fn check_train_backward(mut case: Case, affine: bool) {
        let eps = 1e-2;
        let [_, mean, rstd] = train_forward(&mut case, affine, eps, 0.1);
        let (n, c, s) = case.dims;
        let weight = affine.then_some(&case.weight[..]);
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; n * c * s], vec![f32::NAN; c], vec![f32::NAN; c]);
        let (x, dy) = (&case.x, &case.dy);
        let dims = BatchNormDims { batch: n, channels: c, spatial: s, eps, momentum: 0.1 };
        let grads = NormGrads { dx: &mut dx[..], dweight: Some(&mut dw[..]), dbias: Some(&mut db[..]) };
        batch_norm_train_backward(x, weight, BatchStats { mean: &mean, rstd: &rstd }, dy, &dims, grads);

        let (x64, dy64) = (oracle::widen(x), oracle::widen(dy));
        let (w64, b64) = affine_params(&case, affine);
        let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            let y = train_reference(x, case.dims, w, b, f64::from(eps));
            y.iter().zip(&dy64).map(|(p, q)| p * q).sum()
        };
        check_gradient("batch_norm dx", &dx, &x64, |p| loss(p, &w64, &b64));
        check_gradient("batch_norm dweight", &dw, &w64, |p| loss(&x64, p, &b64));
        check_gradient("batch_norm dbias", &db, &b64, |p| loss(&x64, &w64, p));
    }

    #[test]
    fn large_tensors_take_the_threaded_path_and_match() {
        // 3·4·3001 values: above the parallel threshold, with an odd plane length.
        let (n, c, s) = (3, 4, 3001);
        let wave = |len: usize, f: f32| (0..len).map(move |i| (i as f32 * f).sin() * 2.0 + 0.5);
        let mut case = Case {
            dims: (n, c, s),
            x: wave(n * c * s, 0.37).collect(),
            dy: wave(n * c * s, 0.11).collect(),
            weight: wave(c, 1.3).collect(),
            bias: wave(c, 0.7).collect(),
            running_mean: vec![0.0; c],
            running_var: vec![1.0; c],
        };
        let [y, ..] = train_forward(&mut case.clone(), true, 1e-5, 0.1);
        let (w64, b64) = affine_params(&case, true);
        assert_close(
            "y",
            &y,
            &train_reference(&oracle::widen(&case.x), case.dims, &w64, &b64, 1e-5),
            Tolerance::uniform(1e-5),
        );
        // Closed form, checked by finite differences on small sizes below.
        let eps = 1e-2;
        let [_, mean, rstd] = train_forward(&mut case, true, eps, 0.1);
        let mut dx = vec![0.0; n * c * s];
        let weight = Some(&case.weight[..]);
        let dims = BatchNormDims { batch: n, channels: c, spatial: s, eps, momentum: 0.1 };
        let grads = NormGrads { dx: &mut dx[..], dweight: None, dbias: None };
        batch_norm_train_backward(&case.x, weight, BatchStats { mean: &mean, rstd: &rstd }, &case.dy, &dims, grads);
        let (x64, dy64) = (oracle::widen(&case.x), oracle::widen(&case.dy));
        let stats = stats(&x64, case.dims);
        let count = (n * s) as f64;
        let mut sums = vec![(0.0, 0.0); c];
        for (i, (&v, &g)) in x64.iter().zip(&dy64).enumerate() {
            let (ch, (m, var)) = ((i / s) % c, stats[(i / s) % c]);
            sums[ch].0 += g;
            sums[ch].1 += g * (v - m) / (var + f64::from(eps)).sqrt();
        }
        let want: Vec<f64> = (0..x64.len())
            .map(|i| {
                let (ch, (m, var)) = ((i / s) % c, stats[(i / s) % c]);
                let r = 1.0 / (var + f64::from(eps)).sqrt();
                let xhat = (x64[i] - m) * r;
                w64[ch] * r / count * (count * dy64[i] - sums[ch].0 - xhat * sums[ch].1)
            })
            .collect();
        assert_close("dx", &dx, &want, Tolerance::uniform(1e-4));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn train_forward_matches_reference_and_updates_running_stats(
            case in case(),
            momentum in 0.0f32..1.0,
            affine in any::<bool>(),
        ) {
            let eps = 1e-5;
            let mut updated = case.clone();
            let [y, mean, rstd] = train_forward(&mut updated, affine, eps, momentum);
            let (w64, b64) = affine_params(&case, affine);
            let x64 = oracle::widen(&case.x);
            assert_close("y", &y, &train_reference(&x64, case.dims, &w64, &b64, f64::from(eps)), Tolerance::uniform(1e-4));

            let stats = stats(&x64, case.dims);
            let count = (case.dims.0 * case.dims.2) as f64;
            let m = f64::from(momentum);
            let blend = |old: f32, new: f64| (1.0 - m) * f64::from(old) + m * new;
            let want_running_mean: Vec<f64> = case.running_mean.iter().zip(&stats)
                .map(|(&old, &(mu, _))| blend(old, mu)).collect();
            let want_running_var: Vec<f64> = case.running_var.iter().zip(&stats)
                .map(|(&old, &(_, var))| blend(old, var * count / (count - 1.0))).collect();
            let means: Vec<f64> = stats.iter().map(|st| st.0).collect();
            let rstds: Vec<f64> = stats.iter().map(|st| 1.0 / (st.1 + f64::from(eps)).sqrt()).collect();
            assert_close("mean", &mean, &means, Tolerance::uniform(1e-5));
            assert_close("rstd", &rstd, &rstds, Tolerance::uniform(1e-4));
            assert_close("running_mean", &updated.running_mean, &want_running_mean, Tolerance::uniform(1e-5));
            assert_close("running_var", &updated.running_var, &want_running_var, Tolerance::uniform(1e-5));
        }

        #[test]
        fn eval_forward_uses_running_stats(case in case(), affine in any::<bool>()) {
            let (n, c, s) = case.dims;
            let eps = 1e-3;
            let weight = affine.then_some(&case.weight[..]);
            let bias = affine.then_some(&case.bias[..]);
            let (rm, rv) = (&case.running_mean, &case.running_var);
            let mut y = vec![0.0; n * c * s];
            let dims = BatchNormDims { batch: n, channels: c, spatial: s, eps, momentum: 0.1 };
            batch_norm_eval_forward(&case.x, Affine { weight, bias }, &dims, RunningStats { mean: &rm[..], var: &rv[..] }, &mut y);
            let (w64, b64) = affine_params(&case, affine);
            let want: Vec<f64> = case.x.iter().enumerate().map(|(i, &v)| {
                let ch = (i / s) % c;
                let std = (f64::from(rv[ch]) + f64::from(eps)).sqrt();
                (f64::from(v) - f64::from(rm[ch])) / std * w64[ch] + b64[ch]
            }).collect();
            assert_close("y", &y, &want, Tolerance::uniform(1e-5));
        }

        #[test]
        fn train_backward_matches_finite_differences(
            case in case(),
            affine in any::<bool>(),
        ) {
            check_train_backward(case, affine);
        }
    }
}
