//! Fused cross-entropy: log-softmax and negative log-likelihood in one pass over the logits,
//! never materialising the probabilities in the forward.
//!
//! logits `[N, V]`, targets `[N]`: loss_r = lse_r − logits[r, t_r], lse_r = log Σ_j e^logits[r, j].
//! The forward saves `lse` (one float per row); the backward rebuilds softmax from it.
//! [`cross_entropy_forward_backward`] does both in one visit of a row and writes the gradient
//! over the logits, for the LM head's chunked loss (`Tensor::linear_cross_entropy`), which
//! needs the gradient at once and has no use for the logits after it. The three share one
//! row's log-sum-exp ([`row_lse`]) and one row's gradient ([`softmax_minus_onehot`]), so the
//! fused pass cannot drift from the plain ones.
//!
//! PyTorch equivalent: `F.cross_entropy(logits, targets, ignore_index=..., reduction='none')`
//! (the caller applies the mean through `scale`). The backward writes `dlogits = ...` (zeros
//! in ignored rows; the crate's contract, see `lib.rs`).

use rayon::prelude::*;

use super::parallel;
use super::reduce::slice_max;
use super::simd::{exp8, load, store, LANES};
use super::softmax::sum_exp;

/// Rough cost of one logit (an exponential and a few multiply-adds).
const WORK_PER_ELEMENT: usize = 8;

/// Sizes of one cross-entropy call, shared by the CPU and CUDA kernels (`cuda::softmax` takes
/// the same struct): logits `[rows, cols]`; targets, losses and lse `[rows]`; rows whose
/// target is `ignore_index` are skipped. [`CrossEntropyDims::check`] is the length check both
/// devices run (the targets' range is checked by the CPU here and counted by the GPU kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropyDims {
    /// `N`: rows of logits, one target each.
    pub rows: usize,
    /// `V`: classes (logits per row).
    pub cols: usize,
    /// The target that marks a row to skip (loss and gradient 0), if any.
    pub ignore_index: Option<u32>,
}

impl CrossEntropyDims {
    /// Whether `logits` elements and the `[rows]` operands (`per_row`: name and length) fit
    /// these sizes; the error says what does not.
    pub fn check(&self, logits: usize, per_row: &[(&str, usize)]) -> Result<(), String> {
        let (rows, cols) = (self.rows, self.cols);
        if logits != rows * cols {
            return Err(format!(
                "logits have {logits} elements, [rows, cols] = [{rows}, {cols}] needs {}",
                rows * cols
            ));
        }
        match per_row.iter().find(|&&(_, len)| len != rows) {
            Some((name, len)) => Err(format!("{name} has {len} elements, one per row needs {rows}")),
            None => Ok(()),
        }
    }

    /// Whether `target` is a row to skip.
    fn ignores(&self, target: u32) -> bool {
        Some(target) == self.ignore_index
    }
}

/// Per row r: lse[r] = logsumexp(logits row); losses[r] = lse[r] − logits[r, targets[r]], or 0 when targets[r] == ignore_index. Returns the number of rows not ignored. Panics (assert) if a target ≥ cols (caller validates first).
pub fn cross_entropy_forward(
    logits: &[f32],
    targets: &[u32],
    dims: &CrossEntropyDims,
    losses: &mut [f32],
    lse: &mut [f32],
) -> usize {
    let per_row = [("targets", targets.len()), ("losses", losses.len()), ("lse", lse.len())];
    check("cross_entropy_forward", logits, targets, dims, &per_row);
    let CrossEntropyDims { rows, cols, ignore_index } = *dims;
    if rows == 0 {
        return 0;
    }
    let block = parallel::rows_per_task(cols * WORK_PER_ELEMENT);
    let body = |(b, (losses, lse)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, (loss, lse)) in losses.iter_mut().zip(lse.iter_mut()).enumerate() {
            let r = b * block + i;
            let row = &logits[r * cols..][..cols];
            *lse = row_lse(row);
            *loss = match targets[r] {
                t if Some(t) == ignore_index => 0.0,
                t => *lse - row[t as usize],
            };
        }
    };
    if parallel::should_parallelise(logits.len() * WORK_PER_ELEMENT) {
        losses.par_chunks_mut(block).zip(lse.par_chunks_mut(block)).enumerate().for_each(body);
    } else {
        losses.chunks_mut(block).zip(lse.chunks_mut(block)).enumerate().for_each(body);
    }
    targets.iter().filter(|&&t| Some(t) != ignore_index).count()
}

/// dlogits[r] = scale · (softmax(logits[r]) − onehot(targets[r])), or 0 for ignored rows.
pub fn cross_entropy_backward(
    logits: &[f32],
    targets: &[u32],
    dims: &CrossEntropyDims,
    lse: &[f32],
    scale: f32,
    dlogits: &mut [f32],
) {
    check("cross_entropy_backward", logits, targets, dims, &[("targets", targets.len()), ("lse", lse.len())]);
    assert_eq!(dlogits.len(), logits.len(), "cross_entropy_backward: dlogits has the wrong length");
    let CrossEntropyDims { cols, ignore_index, .. } = *dims;
    parallel::for_each_row_block_mut(dlogits, cols, cols * WORK_PER_ELEMENT, |first, block| {
        for (i, dlogits) in block.chunks_mut(cols).enumerate() {
            let r = first + i;
            let target = targets[r];
            if Some(target) == ignore_index {
                dlogits.fill(0.0);
                continue;
            }
            dlogits.copy_from_slice(&logits[r * cols..][..cols]);
            softmax_minus_onehot(dlogits, lse[r], target as usize, scale);
        }
    });
}

/// The forward and the backward of each row in one visit, the gradient written over the
/// logits: `losses[r]` as [`cross_entropy_forward`] writes it, then, with `grad_scale =
/// Some(scale)`, `logits[r] = scale·(softmax(logits[r]) − onehot(targets[r]))` (zeros for
/// ignored rows) as [`cross_entropy_backward`] writes `dlogits`; `None` leaves the logits as
/// they are (evaluation). No `lse` is kept: nothing reads it later. Returns the number of
/// rows not ignored. For a caller that needs the gradient at once and not the logits (the LM
/// head's chunked loss), so a chunk of rows needs one `[rows, V]` buffer, not two.
pub fn cross_entropy_forward_backward(
    logits: &mut [f32],
    targets: &[u32],
    dims: &CrossEntropyDims,
    grad_scale: Option<f32>,
    losses: &mut [f32],
) -> usize {
    check(
        "cross_entropy_forward_backward",
        logits,
        targets,
        dims,
        &[("targets", targets.len()), ("losses", losses.len())],
    );
    let CrossEntropyDims { rows, cols, ignore_index } = *dims;
    if rows == 0 {
        return 0;
    }
    let block = parallel::rows_per_task(cols * WORK_PER_ELEMENT);
    let body = |(b, (losses, logits)): (usize, (&mut [f32], &mut [f32]))| {
        for (i, (loss, row)) in losses.iter_mut().zip(logits.chunks_mut(cols)).enumerate() {
            let target = targets[b * block + i];
            let lse = row_lse(row);
            let ignored = Some(target) == ignore_index;
            *loss = if ignored { 0.0 } else { lse - row[target as usize] };
            match grad_scale {
                None => {}
                Some(_) if ignored => row.fill(0.0),
                Some(scale) => softmax_minus_onehot(row, lse, target as usize, scale),
            }
        }
    };
    if parallel::should_parallelise(logits.len() * WORK_PER_ELEMENT) {
        losses.par_chunks_mut(block).zip(logits.par_chunks_mut(block * cols)).enumerate().for_each(body);
    } else {
        losses.chunks_mut(block).zip(logits.chunks_mut(block * cols)).enumerate().for_each(body);
    }
    targets.iter().filter(|&&t| Some(t) != ignore_index).count()
}

/// `lse = log Σ_j e^row_j`, shifted by the row's maximum so that no exponential overflows.
fn row_lse(row: &[f32]) -> f32 {
    let max = slice_max(row);
    max + sum_exp(row, max).ln()
}

/// `row_j ← scale·(e^(row_j − lse) − [j = target])`: one row of the gradient, written over
/// that row's logits.
fn softmax_minus_onehot(row: &mut [f32], lse: f32, target: usize, scale: f32) {
    // d/dlogits_j (lse − logits_t) = softmax_j − [j = t],  softmax_j = e^(logits_j − lse)
    let cols = row.len();
    let simd_end = cols - cols % LANES;
    for j in (0..simd_end).step_by(LANES) {
        let p = exp8(load(&row[j..]) - lse);
        store(p * scale, &mut row[j..]);
    }
    for v in &mut row[simd_end..] {
        *v = scale * (*v - lse).exp();
    }
    row[target] -= scale;
}

/// Scalar reference: per-row losses (0 for ignored rows), from a plain log-softmax.
pub fn cross_entropy_reference(logits: &[f32], cols: usize, targets: &[u32], ignore_index: Option<u32>) -> Vec<f32> {
    logits
        .chunks(cols)
        .zip(targets)
        .map(|(row, &t)| {
            if Some(t) == ignore_index {
                return 0.0;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
            lse - row[t as usize]
        })
        .collect()
}

/// Panics naming `op` unless [`CrossEntropyDims::check`] accepts the lengths, or with
/// "target out of range" unless every target is below `cols` or ignored.
fn check(op: &str, logits: &[f32], targets: &[u32], dims: &CrossEntropyDims, per_row: &[(&str, usize)]) {
    if let Err(message) = dims.check(logits.len(), per_row) {
        panic!("{op}: {message}");
    }
    assert!(targets.iter().all(|&t| dims.ignores(t) || (t as usize) < dims.cols), "cross_entropy: target out of range");
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{check_gradient, oracle};
    use proptest::prelude::*;

    fn logits(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 31 + seed * 17) % 97) as f32 * 0.1 - 4.8).collect()
    }

    proptest! {
        #[test]
        fn forward_and_backward_match_reference(
            rows in 1usize..6,
            cols in 1usize..70,
            seed in 0usize..50,
            ignore in any::<bool>(),
        ) {
            let x = logits(rows * cols, seed);
            let targets: Vec<u32> = (0..rows).map(|r| ((r * 7 + seed) % cols) as u32).collect();
            let ignore_index = ignore.then_some(targets[0]);
            let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
            let dims = CrossEntropyDims { rows, cols, ignore_index };
            let kept = cross_entropy_forward(&x, &targets, &dims, &mut losses, &mut lse);
            let want = cross_entropy_reference(&x, cols, &targets, ignore_index);
            prop_assert_eq!(kept, targets.iter().filter(|&&t| Some(t) != ignore_index).count());
            for (a, b) in losses.iter().zip(&want) {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
            }
            // Stale (NaN) contents: every element is overwritten, ignored rows with zeros.
            let mut dlogits = vec![f32::NAN; x.len()];
            cross_entropy_backward(&x, &targets, &dims, &lse, 0.75, &mut dlogits);
            for r in 0..rows {
                let row = &x[r * cols..][..cols];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = row.iter().map(|v| (v - max).exp()).sum();
                for j in 0..cols {
                    let ignored = Some(targets[r]) == ignore_index;
                    let onehot = if j == targets[r] as usize { 1.0 } else { 0.0 };
                    let grad = (row[j] - max).exp() / total - onehot;
                    let want = if ignored { 0.0 } else { 0.75 * grad };
                    prop_assert!((dlogits[r * cols + j] - want).abs() <= 1e-5);
                }
            }
            // The fused pass writes the same losses, and the same gradient over the logits,
            // bit for bit; without a gradient it leaves the logits as they were.
            let (mut fused, mut fused_losses) = (x.clone(), vec![f32::NAN; rows]);
            let fused_kept = cross_entropy_forward_backward(&mut fused, &targets, &dims, Some(0.75), &mut fused_losses);
            prop_assert_eq!(fused_kept, kept);
            prop_assert_eq!(&fused_losses, &losses);
            prop_assert_eq!(&fused, &dlogits);
            let (mut kept_logits, mut eval_losses) = (x.clone(), vec![f32::NAN; rows]);
            cross_entropy_forward_backward(&mut kept_logits, &targets, &dims, None, &mut eval_losses);
            prop_assert_eq!(&eval_losses, &losses);
            prop_assert_eq!(&kept_logits, &x);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, cols) = (3, 13);
        let x = logits(rows * cols, 4);
        let targets = [2u32, 12, 0];
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let dims = CrossEntropyDims { rows, cols, ignore_index: None };
        cross_entropy_forward(&x, &targets, &dims, &mut losses, &mut lse);
        let mut dx = vec![0.0; x.len()];
        cross_entropy_backward(&x, &targets, &dims, &lse, 1.0, &mut dx);
        check_gradient("d cross_entropy", &dx, &oracle::widen(&x), |x| {
            oracle::cross_entropy(x, cols, &targets).iter().sum()
        });
    }

    #[test]
    fn large_vocabulary_runs_in_parallel() {
        let (rows, cols) = (64, 5003);
        let x = logits(rows * cols, 1);
        let targets: Vec<u32> = (0..rows as u32).map(|r| r * 71 % cols as u32).collect();
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let dims = CrossEntropyDims { rows, cols, ignore_index: Some(u32::MAX) };
        let kept = cross_entropy_forward(&x, &targets, &dims, &mut losses, &mut lse);
        assert_eq!(kept, rows);
        let want = cross_entropy_reference(&x, cols, &targets, None);
        assert!(losses.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())));
        let mut dx = vec![0.0; x.len()];
        let dims = CrossEntropyDims { ignore_index: None, ..dims };
        cross_entropy_backward(&x, &targets, &dims, &lse, 1.0, &mut dx);
        for row in dx.chunks(cols) {
            assert!(row.iter().sum::<f32>().abs() < 1e-4, "softmax − onehot sums to 0");
        }
        // The fused pass, in parallel too: the same losses and gradient.
        let (mut fused, mut fused_losses) = (x.clone(), vec![0.0; rows]);
        cross_entropy_forward_backward(&mut fused, &targets, &dims, Some(1.0), &mut fused_losses);
        assert_eq!((fused, fused_losses), (dx, losses));
    }

    #[test]
    #[should_panic(expected = "target out of range")]
    fn rejects_out_of_range_targets() {
        let (mut losses, mut lse) = (vec![0.0; 1], vec![0.0; 1]);
        let dims = CrossEntropyDims { rows: 1, cols: 2, ignore_index: None };
        cross_entropy_forward(&[0.0, 1.0], &[2], &dims, &mut losses, &mut lse);
    }
}
