//! Batched, broadcast and transposed matmul against the toolkit's oracle.

use gradcheck::oracle;
use proptest::prelude::*;
use tensor::Tensor;
use transponder_tests::*;

use super::{broadcast_source, unravel, CASES};

/// `a[..., m, k] · b[..., k, n]` with broadcast batch dimensions, in f64: the toolkit's
/// oracle on each pair of matrices.
fn matmul_reference(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let batch = broadcast_shape(&a.shape()[..ra - 2], &b.shape()[..rb - 2]);
    let (av, bv) = (a.to_vec(), b.to_vec());
    let mut out = Vec::new();
    for bi in 0..numel(&batch) {
        let idx = unravel(bi, &batch);
        let oa = broadcast_source(&idx, &a.shape()[..ra - 2]) * m * k;
        let ob = broadcast_source(&idx, &b.shape()[..rb - 2]) * k * n;
        out.extend(oracle::matmul(&oracle::widen(&av[oa..oa + m * k]), &oracle::widen(&bv[ob..ob + k * n]), m, k, n));
    }
    ([batch.as_slice(), &[m, n]].concat(), out)
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn matmul_matches_loops(((ba, bb), m, k, n, seed, strided) in (
        broadcast_pair_from(shape_with_rank(0..=2)), 1..=6usize, 1..=6usize, 1..=6usize, any::<u64>(), any::<(bool, bool)>(),
    )) {
        let mut a = seeded(&[ba.as_slice(), &[m, k]].concat(), -2.0, 2.0, seed);
        let mut b = seeded(&[bb.as_slice(), &[k, n]].concat(), -2.0, 2.0, seed ^ 7);
        if strided.0 { a = non_contiguous(&a); }
        if strided.1 { b = non_contiguous(&b); }
        let (shape, expected) = matmul_reference(&a, &b);
        let y = ok("matmul", a.matmul(&b));
        prop_assert_eq!(y.shape(), shape.as_slice());
        assert_close("matmul", &y.to_vec(), &expected, 1e-5, 1e-5);
    }
}

#[test]
fn large_matmul_with_transposed_operands() {
    // Big enough for the multi-threaded gemm path.
    let a = seeded(&[2, 96, 64], -1.0, 1.0, 3);
    let w = seeded(&[80, 96], -1.0, 1.0, 4);
    let check = |what: &str, lhs: &Tensor, rhs: &Tensor| {
        let y = ok(what, lhs.matmul(rhs));
        let (shape, expected) = matmul_reference(lhs, rhs);
        assert_eq!(y.shape(), shape.as_slice(), "{what}");
        assert_close(what, &y.to_vec(), &expected, 1e-4, 1e-4);
    };
    for (what, lhs) in [("a", a.clone()), ("non-contiguous a", non_contiguous(&a))] {
        // w · a: a 2-D lhs broadcast over a's batch.
        check(&format!("w · {what}"), &w, &lhs);
        // aᵀ · wᵀ: both operands transposed views, read in place.
        let a_t = ok("transpose", lhs.transpose(1, 2));
        let w_t = ok("transpose", w.transpose(0, 1));
        check(&format!("{what}ᵀ · wᵀ"), &a_t, &w_t);
    }
}
