//! The cuBLAS product of strided operands, accumulating into the output.

use kernels::cpu;
use kernels::cpu::matmul::{GemmDims, Store};
use kernels::cuda;

use super::{assert_reduced, down, up, Rng};

#[test]
fn cublas_matmul_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(14);
    let (m, n, k) = (67, 129, 300);
    let a = rng.vec(m * k, -1.0, 1.0);
    let b_t = rng.vec(n * k, -1.0, 1.0); // stored [n, k]: the right operand read transposed
    let start = rng.vec(3 + m * n, -1.0, 1.0);
    let mut want = start.clone();
    let lhs = cpu::matmul::MatRef { data: &a, offset: 0, row_stride: k as isize, col_stride: 1 };
    let rhs = cpu::matmul::MatRef { data: &b_t, offset: 0, row_stride: 1, col_stride: k as isize };
    cpu::matmul::matmul(&mut want, 3, lhs, rhs, GemmDims { m, n, k }, Store::Accumulate);
    let (ga, gb) = (up(dev, &a), up(dev, &b_t));
    let mut got = up(dev, &start);
    let glhs = cuda::blas::DeviceMat { buffer: &ga, offset: 0, row_stride: k, col_stride: 1 };
    let grhs = cuda::blas::DeviceMat { buffer: &gb, offset: 0, row_stride: 1, col_stride: k };
    cuda::blas::matmul(dev, &mut got, 3, glhs, grhs, GemmDims { m, n, k }, Store::Accumulate).unwrap();
    assert_reduced("matmul", &down(dev, &got), &want);
}
