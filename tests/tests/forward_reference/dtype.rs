//! bf16 and f16 storage: exact round trips, round-to-nearest-even and the refusal to compute
//! in half precision.

use proptest::prelude::*;
use tensor::ops::Unary;
use tensor::{DType, Tensor};
use transponder_tests::*;

use super::{log_uniform, CASES};

/// `k·2^e` for integer |k| ≤ 2^bits: exactly representable with `bits` significand bits.
fn representable(bits: u32, exp: std::ops::RangeInclusive<i32>) -> impl Strategy<Value = f32> {
    let max = 1i32 << bits;
    (-max..=max, exp).prop_map(|(k, e)| k as f32 * 2f32.powi(e))
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn exactly_representable_values_round_trip_exactly(
        bf in prop::collection::vec(representable(8, -100..=100), 1..40),
        half in prop::collection::vec(representable(11, -24..=4), 1..40),
    ) {
        let t = tensor(bf.clone(), &[bf.len()]);
        let b = ok("to_dtype", t.to_dtype(DType::BF16));
        prop_assert_eq!(b.dtype(), DType::BF16);
        prop_assert_eq!(b.to_vec(), bf.clone());
        prop_assert_eq!(ok("to_dtype", b.to_dtype(DType::F32)).to_vec(), bf);
        let t = tensor(half.clone(), &[half.len()]);
        let h = ok("to_dtype", t.to_dtype(DType::F16));
        prop_assert_eq!(h.dtype(), DType::F16);
        prop_assert_eq!(ok("to_dtype", h.to_dtype(DType::F32)).to_vec(), half);
    }

    #[test]
    fn other_values_round_within_half_an_ulp(
        bf in prop::collection::vec(log_uniform(1, -30.0, 30.0, true), 1..40),
        half in prop::collection::vec(log_uniform(1, -4.0, 4.5, true), 1..40),
    ) {
        // Round to nearest: |error| ≤ ½ ulp ≤ 2^−(significand bits)·|x| (8 bits for bf16,
        // 11 for f16 in its normal range, which 1e-4..3e4 stays in).
        for (values, dtype, rel) in [(bf, DType::BF16, 2f64.powi(-8)), (half, DType::F16, 2f64.powi(-11))] {
            let xs: Vec<f32> = values.into_iter().flatten().collect();
            let t = non_contiguous(&tensor(xs.clone(), &[xs.len()]));
            let back = ok("to_dtype", ok("to_dtype", t.to_dtype(dtype)).to_dtype(DType::F32)).to_vec();
            for (&x, &y) in xs.iter().zip(&back) {
                prop_assert!(((y - x) as f64).abs() <= rel * (x as f64).abs(), "{:?}: {} came back as {}", dtype, x, y);
            }
        }
    }
}

#[test]
fn dtype_conversion_rounds_half_to_even_and_keeps_specials() {
    // 1 + 2⁻⁸ sits halfway between bf16 neighbours 1 and 1 + 2⁻⁷: ties go to the even 1;
    // 1 + 3·2⁻⁸ goes up to the even 1 + 2⁻⁶.
    let x = tensor(vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::INFINITY, -0.0], &[4]);
    let b = ok("to_dtype", x.to_dtype(DType::BF16)).to_vec();
    assert_eq!(b[0], 1.0);
    assert_eq!(b[1], 1.0 + 2f32.powi(-6));
    assert_eq!(b[2], f32::INFINITY);
    assert!(b[3] == 0.0 && b[3].is_sign_negative(), "-0 must stay -0");
    let h = ok("to_dtype", tensor(vec![65504.0, 1e5, 2f32.powi(-24)], &[3]).to_dtype(DType::F16)).to_vec();
    assert_eq!(h, vec![65504.0, f32::INFINITY, 2f32.powi(-24)], "f16 max, overflow, smallest subnormal");
    let nan = ok("to_dtype", tensor(vec![f32::NAN], &[1]).to_dtype(DType::BF16)).to_vec();
    assert!(nan[0].is_nan());
}

#[test]
fn compute_ops_reject_half_precision_storage() {
    let x = ok("to_dtype", Tensor::ones(&[2, 2]).to_dtype(DType::BF16));
    let y = Tensor::ones(&[2, 2]);
    let err = x.add(&y).expect_err("add of a bf16 tensor must be an error (compute is f32)");
    assert!(err.to_string().contains("add") && err.to_string().contains("BF16"), "{err}");
    assert!(y.matmul(&x).is_err(), "matmul with bf16 must be an error");
    assert!(x.unary(Unary::Exp).is_err(), "unary on bf16 must be an error");
    assert_eq!(x.dtype(), DType::BF16);
    assert_eq!(ok("to_dtype", x.to_dtype(DType::F16)).to_vec(), vec![1.0; 4]);
}
