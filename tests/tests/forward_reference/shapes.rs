//! Shape errors name the op and both shapes, in tensor and in autograd.

use autograd::Var;
use tensor::ops::Binary;
use tensor::Tensor;

fn assert_shape_error<T: std::fmt::Debug>(result: tensor::Result<T>, op: &str, lhs: &str, rhs: &str) {
    let err = result.expect_err("mismatched shapes must be an error");
    let msg = err.to_string();
    assert!(
        msg.contains(op) && msg.contains(lhs) && msg.contains(rhs),
        "message {msg:?} must name {op}, {lhs} and {rhs}"
    );
}

#[test]
fn mismatched_shapes_are_errors_naming_op_and_shapes() {
    let (a, b) = (Tensor::zeros(&[2, 3]), Tensor::zeros(&[4]));
    assert_shape_error(a.add(&b), "add", "[2, 3]", "[4]");
    assert_shape_error(a.sub(&b), "sub", "[2, 3]", "[4]");
    assert_shape_error(a.mul(&b), "mul", "[2, 3]", "[4]");
    assert_shape_error(a.div(&b), "div", "[2, 3]", "[4]");
    assert_shape_error(a.binary(&b, Binary::Maximum), "maximum", "[2, 3]", "[4]");
    // swiglu does not broadcast: even [3] against [2, 3] is an error.
    assert_shape_error(a.swiglu(&Tensor::zeros(&[3])), "swiglu", "[2, 3]", "[3]");
    assert_shape_error(a.matmul(&Tensor::zeros(&[4, 5])), "matmul", "[2, 3]", "[4, 5]");
    assert_shape_error(a.matmul(&b), "matmul", "[2, 3]", "[4]");
    assert_shape_error(Tensor::cat(&[&a, &Tensor::zeros(&[3, 4])], 0), "cat", "[2, 3]", "[3, 4]");
    assert_shape_error(Tensor::cat(&[&a, &b], 0), "cat", "[2, 3]", "[4]");
    assert!(Tensor::cat(&[&a], 2).is_err(), "cat axis out of range");
    assert!(a.reshape(&[4]).is_err() && a.sum_axis(2, false).is_err() && a.expand(&[3, 3]).is_err());

    // The autograd ops surface the same errors.
    let (va, vb) = (Var::parameter(a.clone()), Var::parameter(b.clone()));
    assert_shape_error(va.add(&vb), "add", "[2, 3]", "[4]");
    assert_shape_error(va.swiglu(&vb), "swiglu", "[2, 3]", "[4]");
    assert_shape_error(va.matmul(&Var::constant(Tensor::zeros(&[4, 5]))), "matmul", "[2, 3]", "[4, 5]");
    assert_shape_error(Var::cat(&[&va, &vb], 0), "cat", "[2, 3]", "[4]");
    assert_shape_error(Var::parameter(Tensor::zeros(&[3])).set_value(Tensor::zeros(&[4])), "set_value", "[3]", "[4]");
}

#[test]
fn matmul_batch_mismatch_names_both_full_shapes() {
    let a = Tensor::zeros(&[2, 2, 3]);
    let b = Tensor::zeros(&[3, 3, 4]);
    assert_shape_error(a.matmul(&b), "matmul", "[2, 2, 3]", "[3, 3, 4]");
}
