//! RMSNorm and LayerNorm (with and without the affine parameters) against the toolkit's
//! oracles.

use gradcheck::oracle;
use proptest::prelude::*;
use tensor::Tensor;
use transponder_tests::*;

use super::CASES;

/// Mean and `1/√(variance + eps)` (biased variance) of each row of `cols`, in f64: the
/// statistics LayerNorm saves for its backward.
fn row_stats(xs: &[f64], cols: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    xs.chunks(cols)
        .map(|row| {
            let mean = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
            (mean, 1.0 / (var + eps).sqrt())
        })
        .unzip()
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn rms_norm_matches_loops((x, w) in (shape_with_rank(0..=2), 1..=9usize).prop_flat_map(|(lead, c)| (
        tensor_in([lead.as_slice(), &[c]].concat(), Domain::Uniform(-3.0, 3.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
    ))) {
        let eps = 1e-5;
        let cols = w.numel();
        let (xs, ws) = (oracle::widen(&x.to_vec()), oracle::widen(&w.to_vec()));
        let y = oracle::rms_norm(&xs, &ws, cols, eps as f64);
        let rstd: Vec<f64> =
            xs.chunks(cols).map(|row| 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps as f64).sqrt()).collect();
        let out = ok("rms_norm", x.rms_norm(&w, eps));
        prop_assert_eq!(out.y.shape(), x.shape());
        assert_close("rms_norm y", &out.y.to_vec(), &y, 1e-5, 1e-5);
        assert_close("rms_norm rstd", &out.rstd.to_vec(), &rstd, 1e-5, 1e-5);
    }

    #[test]
    fn layer_norm_matches_loops((x, w, b, affine) in (shape_with_rank(0..=2), 1..=9usize).prop_flat_map(|(lead, c)| (
        tensor_in([lead.as_slice(), &[c]].concat(), Domain::Uniform(-3.0, 3.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
        tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
        any::<(bool, bool)>(),
    ))) {
        let eps = 1e-5;
        let cols = w.numel();
        let xs = oracle::widen(&x.to_vec());
        // Without the affine parameters the reference scales by 1 and shifts by 0.
        let ws = if affine.0 { oracle::widen(&w.to_vec()) } else { vec![1.0; cols] };
        let bs = if affine.1 { oracle::widen(&b.to_vec()) } else { vec![0.0; cols] };
        let y = oracle::layer_norm(&xs, &ws, &bs, cols, eps as f64);
        let (means, rstds) = row_stats(&xs, cols, eps as f64);
        let out = ok("layer_norm", x.layer_norm(affine.0.then_some(&w), affine.1.then_some(&b), eps));
        prop_assert_eq!(out.y.shape(), x.shape());
        // rstd reaches 1/√eps ≈ 316 on constant rows: relative error there is what counts.
        assert_close("layer_norm y", &out.y.to_vec(), &y, 1e-4, 1e-4);
        assert_close("layer_norm mean", &out.mean.to_vec(), &means, 1e-5, 1e-5);
        assert_close("layer_norm rstd", &out.rstd.to_vec(), &rstds, 1e-4, 1e-4);
    }
}

#[test]
fn layer_norm_is_accurate_for_rows_with_a_large_mean() {
    // A one-pass E[x²] − E[x]² variance in f32 cancels catastrophically here; PyTorch and
    // llm.c subtract the mean first.
    let (rows, cols) = (4, 16);
    let noise = seeded(&[rows, cols], -1.0, 1.0, 12).to_vec();
    let xs: Vec<f32> = noise.iter().map(|v| 1000.0 + v).collect();
    let x = tensor(xs.clone(), &[rows, cols]);
    let out = ok("layer_norm", x.layer_norm(None, None, 1e-5));
    let expected = oracle::layer_norm(&oracle::widen(&xs), &[1.0; 16], &[0.0; 16], cols, 1e-5);
    assert_close("layer_norm of 1000 + noise", &out.y.to_vec(), &expected, 1e-3, 1e-3);
}

#[test]
fn norms_reject_wrong_weight_shapes() {
    let x = Tensor::ones(&[2, 4]);
    let err = x.rms_norm(&Tensor::ones(&[3]), 1e-5).err().expect("weight [3] for rows of 4");
    assert!(err.to_string().contains("rms_norm") && err.to_string().contains("[3]"), "{err}");
    assert!(x.layer_norm(None, Some(&Tensor::ones(&[5])), 1e-5).is_err());
}
