//! Fused SwiGLU gating, `silu(g) ⊙ u` in one op, against the toolkit's oracle.

use gradcheck::oracle;
use proptest::prelude::*;
use tensor::Tensor;
use transponder_tests::*;

use super::CASES;

/// `silu(g) ⊙ u` in f64 from the toolkit's oracle.
fn swiglu_reference(g: &Tensor, u: &Tensor) -> Vec<f64> {
    oracle::swiglu(&oracle::widen(&g.to_vec()), &oracle::widen(&u.to_vec()))
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn swiglu_matches_silu_times_up((g, u) in shape().prop_flat_map(|s| (
        tensor_in(s.clone(), Domain::Uniform(-60.0, 60.0)),
        tensor_in(s, Domain::Uniform(-4.0, 4.0)),
    ))) {
        let y = ok("swiglu", g.swiglu(&u));
        prop_assert_eq!(y.shape(), g.shape());
        assert_close("swiglu", &y.to_vec(), &swiglu_reference(&g, &u), 4e-6, 1e-6);
        // Strided views are read like their contiguous copies.
        let strided = ok("swiglu", non_contiguous(&g).swiglu(&non_contiguous(&u)));
        assert_close_f32("swiglu (non-contiguous)", &strided.to_vec(), &y.to_vec(), 0.0, 0.0);
    }
}

#[test]
fn swiglu_special_values_and_long_vectors() {
    // Saturation both ways, in the SIMD body (first 8) and the scalar tail (last one).
    let g = tensor(vec![-1e4, 1e4, 0.0, -100.0, 100.0, -90.0, 90.0, 1.0, -100.0], &[9]);
    let u = tensor(vec![2.0, -3.0, 5.0, 1.5, -0.5, 4.0, 1.0, 2.0, -7.0], &[9]);
    let check = |g: &Tensor, u: &Tensor, what: &str| {
        assert_close(what, &ok("swiglu", g.swiglu(u)).to_vec(), &swiglu_reference(g, u), 4e-6, 1e-6);
    };
    check(&g, &u, "swiglu at ±1e4, ±100, ±90");
    // Long enough to be split over threads.
    let n = 200_003;
    check(&seeded(&[n], -8.0, 8.0, 31), &seeded(&[n], -2.0, 2.0, 32), &format!("swiglu on {n} values"));
}
