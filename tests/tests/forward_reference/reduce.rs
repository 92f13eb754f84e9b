//! Sum, mean and max along an axis, and the sum of all elements, against loops in f64.

use proptest::prelude::*;
use transponder_tests::*;

use super::CASES;

/// `(outer, n, inner)` around `axis`.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (numel(&shape[..axis]), shape[axis], numel(&shape[axis + 1..]))
}

fn reduced_shape(shape: &[usize], axis: usize, keepdim: bool) -> Vec<usize> {
    let mut s = shape.to_vec();
    if keepdim {
        s[axis] = 1;
    } else {
        s.remove(axis);
    }
    s
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn reductions_match_loops(((shape, axis), keepdim, seed) in (shape_and_axis(), any::<bool>(), any::<u64>())) {
        let x = seeded(&shape, -3.0, 3.0, seed);
        let xs = x.to_vec();
        let (outer, n, inner) = split(&shape, axis);
        let out_shape = reduced_shape(&shape, axis, keepdim);
        let mut sum = vec![0.0f64; outer * inner];
        let mut max = vec![(f32::NEG_INFINITY, 0usize); outer * inner];
        for o in 0..outer {
            for j in 0..n {
                for i in 0..inner {
                    let v = xs[(o * n + j) * inner + i];
                    sum[o * inner + i] += v as f64;
                    if v > max[o * inner + i].0 {
                        max[o * inner + i] = (v, j);
                    }
                }
            }
        }
        let s = ok("sum_axis", x.sum_axis(axis, keepdim));
        prop_assert_eq!(s.shape(), out_shape.as_slice());
        assert_close("sum_axis", &s.to_vec(), &sum, 1e-5, 1e-5);

        let m = ok("mean_axis", x.mean_axis(axis, keepdim));
        prop_assert_eq!(m.shape(), out_shape.as_slice());
        let mean: Vec<f64> = sum.iter().map(|v| v / n as f64).collect();
        assert_close("mean_axis", &m.to_vec(), &mean, 1e-5, 1e-5);

        let (mx, argmax) = ok("max_axis", x.max_axis(axis, keepdim));
        prop_assert_eq!(mx.shape(), out_shape.as_slice());
        prop_assert_eq!(mx.to_vec(), max.iter().map(|p| p.0).collect::<Vec<_>>());
        prop_assert_eq!(argmax, max.iter().map(|p| p.1).collect::<Vec<_>>());

        let all = ok("sum_all", x.sum_all());
        prop_assert_eq!(all.shape(), &[] as &[usize]);
        assert_close("sum_all", &all.to_vec(), &[xs.iter().map(|&v| v as f64).sum()], 1e-5, 1e-4);
    }
}

#[test]
fn max_axis_takes_the_first_of_tied_maxima() {
    let x = tensor(vec![1.0, 4.0, 4.0, -1.0, -1.0, -1.0], &[2, 3]);
    let (m, argmax) = ok("max_axis", x.max_axis(1, true));
    assert_eq!(m.shape(), &[2, 1]);
    assert_eq!(m.to_vec(), vec![4.0, -1.0]);
    assert_eq!(argmax, vec![1, 0]);
}

#[test]
fn long_reductions_keep_f32_accuracy() {
    let n = 100_000;
    let x = seeded(&[3, n], 0.0, 1.0, 8);
    let xs = x.to_vec();
    let expected: Vec<f64> = (0..3).map(|r| xs[r * n..(r + 1) * n].iter().map(|&v| v as f64).sum()).collect();
    assert_close("sum of 1e5 values", &ok("sum_axis", x.sum_axis(1, false)).to_vec(), &expected, 1e-5, 0.0);
}
