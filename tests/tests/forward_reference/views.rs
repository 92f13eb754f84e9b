//! `cat` and the views (permute, reshape, narrow, unsqueeze, expand, squeeze) of
//! non-contiguous tensors against index loops, and ops that read strided inputs.

use autograd::Var;
use proptest::prelude::*;
use tensor::ops::{Binary, Unary};
use tensor::Tensor;
use transponder_tests::*;

use super::{ravel, unravel, CASES};

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn cat_matches_loops((parts, axis) in shape_and_axis().prop_flat_map(|(s, axis)| {
        prop::collection::vec(0..=3usize, 1..=4).prop_flat_map(move |sizes| {
            let parts: Vec<_> = sizes.iter().map(|&n| {
                let mut p = s.clone();
                p[axis] = n;
                tensor_in(p, Domain::Uniform(-2.0, 2.0))
            }).collect();
            (parts, Just(axis))
        })
    }), strided in any::<bool>()) {
        let parts: Vec<Tensor> = if strided { parts.iter().map(non_contiguous).collect() } else { parts };
        let y = ok("cat", Tensor::cat(&parts.iter().collect::<Vec<_>>(), axis));
        let mut shape = parts[0].shape().to_vec();
        shape[axis] = parts.iter().map(|p| p.shape()[axis]).sum();
        prop_assert_eq!(y.shape(), shape.as_slice());
        // Element at idx comes from the part whose axis range holds idx[axis].
        let values: Vec<Vec<f32>> = parts.iter().map(Tensor::to_vec).collect();
        let expected: Vec<f32> = (0..numel(&shape)).map(|flat| {
            let mut idx = unravel(flat, &shape);
            let mut p = 0;
            while idx[axis] >= parts[p].shape()[axis] {
                idx[axis] -= parts[p].shape()[axis];
                p += 1;
            }
            values[p][ravel(&idx, parts[p].shape())]
        }).collect();
        prop_assert_eq!(y.to_vec(), expected);
    }

    #[test]
    fn views_of_non_contiguous_tensors((x, axes, (axis, start, len)) in shape().prop_flat_map(|s| {
        let rank = s.len();
        (
            tensor_in(s.clone(), Domain::Uniform(-2.0, 2.0)),
            Just((0..rank).collect::<Vec<_>>()).prop_shuffle(),
            (0..rank).prop_flat_map(move |axis| {
                let size = s[axis];
                (Just(axis), 0..size).prop_flat_map(move |(axis, start)| (Just(axis), Just(start), 0..=size - start))
            }),
        )
    })) {
        let nc = non_contiguous(&x);
        let (shape, xs) = (x.shape().to_vec(), x.to_vec());
        prop_assert_eq!(nc.to_vec(), xs.clone());

        // permute: output index o reads input index with idx[axes[i]] = o[i].
        let p = ok("permute", nc.permute(&axes));
        let p_shape: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
        prop_assert_eq!(p.shape(), p_shape.as_slice());
        let expected: Vec<f32> = (0..xs.len()).map(|flat| {
            let o = unravel(flat, &p_shape);
            let mut idx = vec![0; shape.len()];
            for (i, &a) in axes.iter().enumerate() { idx[a] = o[i]; }
            xs[ravel(&idx, &shape)]
        }).collect();
        prop_assert_eq!(p.to_vec(), expected.clone());
        // reshape of a strided view copies in row-major order of the view.
        prop_assert_eq!(ok("reshape", p.reshape(&[xs.len()])).to_vec(), expected.clone());
        prop_assert_eq!(ok("contiguous", p.contiguous()).to_vec(), expected);
        prop_assert!(ok("contiguous", p.contiguous()).is_contiguous());

        // narrow
        let nw = ok("narrow", nc.narrow(axis, start, len));
        let mut n_shape = shape.clone();
        n_shape[axis] = len;
        let expected: Vec<f32> = (0..numel(&n_shape)).map(|flat| {
            let mut idx = unravel(flat, &n_shape);
            idx[axis] += start;
            xs[ravel(&idx, &shape)]
        }).collect();
        prop_assert_eq!(nw.to_vec(), expected);

        // unsqueeze + expand + squeeze
        let u = ok("unsqueeze", nc.unsqueeze(0));
        let e = ok("expand", u.expand(&[[2].as_slice(), &shape].concat()));
        prop_assert_eq!(e.to_vec(), [xs.clone(), xs.clone()].concat());
        prop_assert_eq!(ok("squeeze", u.squeeze(0)).to_vec(), xs.clone());

        // Ops read strided inputs like their contiguous copies.
        prop_assert_eq!(ok("exp", nc.unary(Unary::Exp)).to_vec(), ok("exp", x.unary(Unary::Exp)).to_vec());
        prop_assert_eq!(ok("mul", nc.mul(&nc)).to_vec(), ok("mul", x.mul(&x)).to_vec());
        prop_assert_eq!(ok("softmax", nc.softmax()).to_vec(), ok("softmax", x.softmax()).to_vec());
        prop_assert_eq!(ok("log_softmax", nc.log_softmax()).to_vec(), ok("log_softmax", x.log_softmax()).to_vec());
        prop_assert_eq!(ok("scalar_op", nc.scalar_op(Binary::Mul, 3.0)).to_vec(), ok("scalar_op", x.scalar_op(Binary::Mul, 3.0)).to_vec());
        prop_assert_eq!(ok("sum_axis", nc.sum_axis(axis, false)).to_vec(), ok("sum_axis", x.sum_axis(axis, false)).to_vec());
        prop_assert_eq!(ok("max_axis", nc.max_axis(axis, true)).0.to_vec(), ok("max_axis", x.max_axis(axis, true)).0.to_vec());
        let w = Tensor::ones(&[shape[shape.len() - 1]]);
        prop_assert_eq!(ok("rms_norm", nc.rms_norm(&w, 1e-5)).y.to_vec(), ok("rms_norm", x.rms_norm(&w, 1e-5)).y.to_vec());
        prop_assert_eq!(ok("layer_norm", nc.layer_norm(Some(&w), None, 1e-5)).y.to_vec(), ok("layer_norm", x.layer_norm(Some(&w), None, 1e-5)).y.to_vec());
        // Autograd views of a strided leaf agree too.
        let v = Var::constant(nc.clone());
        prop_assert_eq!(ok("Var::permute", v.permute(&axes)).value().to_vec(), p.to_vec());
    }
}
