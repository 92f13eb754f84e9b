//! Broadcasting binary ops, scalar ops, select and `sum_to_shape` against index loops.

use proptest::prelude::*;
use tensor::ops::Binary;
use tensor::Tensor;
use transponder_tests::*;

use super::{broadcast_source, unravel, CASES};

fn binary_reference(op: Binary, a: f32, b: f32) -> f32 {
    match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::Maximum => a.max(b),
        Binary::Minimum => a.min(b),
    }
}

const BINARY_OPS: [Binary; 6] = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum];

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn binary_ops_broadcast_exactly((a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| (
        tensor_in(sa, Domain::Uniform(-10.0, 10.0)),
        tensor_in(sb, Domain::AwayFromZero(0.1, 10.0)),
    ))) {
        let out_shape = broadcast_shape(a.shape(), b.shape());
        let (av, bv) = (a.to_vec(), b.to_vec());
        for op in BINARY_OPS {
            let y = ok("binary", a.binary(&b, op));
            prop_assert_eq!(y.shape(), out_shape.as_slice());
            let expected: Vec<f32> = (0..numel(&out_shape)).map(|i| {
                let idx = unravel(i, &out_shape);
                binary_reference(op, av[broadcast_source(&idx, a.shape())], bv[broadcast_source(&idx, b.shape())])
            }).collect();
            // IEEE + − × ÷ are correctly rounded: the kernel must agree bit for bit.
            prop_assert_eq!(y.to_vec(), expected, "{:?} {:?} {:?}", op, a.shape(), b.shape());
        }
    }

    #[test]
    fn scalar_ops_are_exact(x in shape().prop_flat_map(|s| tensor_in(s, Domain::Uniform(-10.0, 10.0))), s in -5.0f32..5.0) {
        for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Maximum, Binary::Minimum] {
            let expected: Vec<f32> = x.to_vec().iter().map(|&v| binary_reference(op, v, s)).collect();
            prop_assert_eq!(ok("scalar_op", x.scalar_op(op, s)).to_vec(), expected, "{:?}", op);
        }
    }

    #[test]
    fn select_picks_by_condition((cond, a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| {
        let full = broadcast_shape(&sa, &sb);
        let cond = prop::collection::vec(prop::bool::ANY, numel(&full))
            .prop_map(move |bits| tensor(bits.iter().map(|&c| if c { 2.5 } else { 0.0 }).collect(), &full));
        (cond, tensor_in(sa, Domain::Uniform(-3.0, 3.0)), tensor_in(sb, Domain::Uniform(-3.0, 3.0)))
    })) {
        let y = ok("select", Tensor::select(&cond, &a, &b));
        let shape = cond.shape().to_vec();
        let (c, av, bv) = (cond.to_vec(), a.to_vec(), b.to_vec());
        let expected: Vec<f32> = (0..numel(&shape)).map(|i| {
            let idx = unravel(i, &shape);
            if c[i] != 0.0 { av[broadcast_source(&idx, a.shape())] } else { bv[broadcast_source(&idx, b.shape())] }
        }).collect();
        prop_assert_eq!(y.to_vec(), expected);
    }

    #[test]
    fn sum_to_shape_undoes_broadcasting((a, b) in broadcast_pair().prop_flat_map(|(sa, sb)| {
        let full = broadcast_shape(&sa, &sb);
        (tensor_in(full, Domain::Uniform(-2.0, 2.0)), Just(sa))
    })) {
        let reduced = ok("sum_to_shape", a.sum_to_shape(&b));
        prop_assert_eq!(reduced.shape(), b.as_slice());
        let mut expected = vec![0.0f64; numel(&b)];
        for (i, v) in a.to_vec().iter().enumerate() {
            expected[broadcast_source(&unravel(i, a.shape()), &b)] += *v as f64;
        }
        assert_close("sum_to_shape", &reduced.to_vec(), &expected, 1e-5, 1e-5);
    }
}

#[test]
fn binary_ops_on_long_vectors() {
    let n = 150_001;
    let a = seeded(&[n], -4.0, 4.0, 1);
    let b = seeded(&[1, n], 0.5, 4.0, 2);
    let y = ok("div", a.div(&b));
    assert_eq!(y.shape(), &[1, n]);
    let expected: Vec<f32> = a.to_vec().iter().zip(b.to_vec()).map(|(x, y)| x / y).collect();
    assert_eq!(y.to_vec(), expected);
}
