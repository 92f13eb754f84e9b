//! Softmax, log-softmax and cross-entropy with `ignore_index`, against the toolkit's oracles.

use gradcheck::oracle;
use proptest::prelude::*;
use tensor::Tensor;
use transponder_tests::*;

use super::CASES;

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn softmax_and_log_softmax_match_loops(x in shape().prop_flat_map(|s| tensor_in(s, Domain::Uniform(-30.0, 30.0)))) {
        let cols = *x.shape().last().unwrap();
        let xs = oracle::widen(&x.to_vec());
        let y = ok("softmax", x.softmax());
        prop_assert_eq!(y.shape(), x.shape());
        assert_close("softmax", &y.to_vec(), &oracle::softmax(&xs, cols), 1e-5, 1e-7);
        let log_y = ok("log_softmax", x.log_softmax()).to_vec();
        assert_close("log_softmax", &log_y, &oracle::log_softmax(&xs, cols), 1e-5, 1e-5);
    }

    #[test]
    fn cross_entropy_matches_loops((x, targets, ignore) in (1..=6usize, 1..=7usize, 0..3u8).prop_flat_map(|(rows, vocab, mode)| {
        let ignore = [Some(vocab as u32), Some(0), None][mode as usize];
        let target = prop_oneof![3 => 0..vocab as u32, 1 => Just(ignore.unwrap_or(0))];
        (tensor_in(vec![rows, vocab], Domain::Uniform(-8.0, 8.0)), prop::collection::vec(target, rows), Just(ignore))
    })) {
        let vocab = x.shape()[1];
        let xs = oracle::widen(&x.to_vec());
        let lses: Vec<f64> = xs.chunks(vocab).map(oracle::logsumexp).collect();
        // An ignored target may be out of range: the oracle reads class 0 there, never counted.
        let read: Vec<u32> = targets.iter().map(|&t| if Some(t) == ignore { 0 } else { t }).collect();
        let losses = oracle::cross_entropy(&xs, vocab, &read);
        let counted: Vec<usize> = (0..targets.len()).filter(|&r| Some(targets[r]) != ignore).collect();
        let (total, count) = (counted.iter().map(|&r| losses[r]).sum::<f64>(), counted.len());
        let out = ok("cross_entropy", x.cross_entropy(&targets, ignore));
        prop_assert_eq!(out.count, count);
        let expected = if count == 0 { 0.0 } else { total / count as f64 };
        assert_close("cross_entropy loss", &[ok("loss", out.loss_value())], &[expected], 1e-5, 1e-5);
        // The lse of ignored rows is never read; the counted rows' must be right.
        let lse = out.lse.to_vec();
        let got: Vec<f32> = counted.iter().map(|&r| lse[r]).collect();
        let want: Vec<f64> = counted.iter().map(|&r| lses[r]).collect();
        assert_close("cross_entropy lse", &got, &want, 1e-5, 1e-5);
    }
}

#[test]
fn softmax_is_stable_for_huge_logits() {
    let x = tensor(vec![1000.0, 0.0, -1000.0, 1e30, 1e30, -1e30], &[2, 3]);
    // (1e30 + ln 2 is 1e30 in f32, so the loss uses moderate logits for its second row.)
    assert_close("softmax", &ok("softmax", x.softmax()).to_vec(), &[1.0, 0.0, 0.0, 0.5, 0.5, 0.0], 1e-6, 1e-7);
    let ls = ok("log_softmax", x.log_softmax()).to_vec();
    assert_close("log_softmax", &ls[..2], &[0.0, -1000.0], 1e-6, 1e-6);
    let y = tensor(vec![1000.0, 0.0, -1000.0, 50.0, 50.0, -50.0], &[2, 3]);
    let ce = ok("cross_entropy", y.cross_entropy(&[1, 0], None));
    assert_close(
        "cross_entropy",
        &[ok("loss", ce.loss_value())],
        &[(1000.0 + std::f64::consts::LN_2) / 2.0],
        1e-6,
        1e-4,
    );
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let x = Tensor::zeros(&[2, 3]);
    let err = x.cross_entropy(&[0, 3], None).err().expect("target 3 of 3 classes must be rejected");
    assert!(err.to_string().contains("cross_entropy"), "{err}");
    assert!(x.cross_entropy(&[0], None).is_err(), "one target for two rows must be rejected");
    assert!(x.cross_entropy(&[0, 3], Some(3)).is_ok(), "an ignored out-of-range target is fine");
}
