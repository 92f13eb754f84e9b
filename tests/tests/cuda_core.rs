//! CPU-vs-CUDA agreement of the core tensor ops and a few autograd graphs: every test
//! builds random inputs on the CPU, runs the same op on the CPU and on GPU 0, and compares.
//! Tolerances: f32 1e-4 relative + 1e-5 absolute; bf16 2e-2 relative.
//!
//! Run on a GPU machine with `cargo test --release -p transponder-tests --features cuda
//! --test cuda_core`; without a GPU every test prints "skipping: no CUDA device" and passes.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use autograd::ops::GatedProjectionVars;
use autograd::Var;
use gradcheck::Tolerance;
use kernels::cuda::DeviceCounters;
use tensor::cuda::{matmul_precision, set_matmul_precision, MatmulPrecision};
use tensor::ops::{Binary, ProductOutput, Unary};
use tensor::{DType, Device, Error, Rng, Tensor};
use transponder_tests::{gpu, no_gpu, token_ids, GPU};

const F32_REL: f32 = 1e-4;
const F32_ABS: f32 = 1e-5;
const BF16_REL: f32 = 2e-2;

/// Uniform values in `[low, high)` from a fixed seed.
fn rand(shape: &[usize], low: f32, high: f32, seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, low, high, &mut Rng::new(seed))
}

/// `got` (on the GPU) is within `abs + rel·|want|` of `want` (on the CPU) everywhere (the
/// toolkit's [`close`](gradcheck::close)).
fn assert_close(got: &Tensor, want: &Tensor, rel: f32, abs: f32, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: result left the GPU");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let tolerance = Tolerance { atol: f64::from(abs), rtol: f64::from(rel) };
    gradcheck::assert_close(what, &got.to_host().unwrap().to_vec(), &want.to_vec(), tolerance);
}

fn assert_f32_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_close(got, want, F32_REL, F32_ABS, what);
}

/// Serialises the tests: the matmul precision is process-wide (the bf16 tests switch it), and
/// so are the device's launch counters, which some tests read (a launch of a test running
/// beside would be counted as theirs).
fn device_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sets a matmul precision until dropped (restoring f32 even if the test fails), holding
/// [`device_lock`] meanwhile.
struct Precision {
    _lock: MutexGuard<'static, ()>,
}

impl Precision {
    fn set(precision: MatmulPrecision) -> Precision {
        let lock = device_lock();
        set_matmul_precision(precision);
        Precision { _lock: lock }
    }
}

impl Drop for Precision {
    fn drop(&mut self) {
        set_matmul_precision(MatmulPrecision::F32);
    }
}

#[test]
fn to_device_round_trips_f32_and_bf16() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let x = rand(&[3, 5, 7], -4.0, 4.0, 1);
    let on_gpu = gpu(&x);
    assert_eq!((on_gpu.device(), on_gpu.dtype()), (GPU, DType::F32));
    assert_eq!(on_gpu.to_host().unwrap().to_vec(), x.to_vec());
    assert_eq!(on_gpu.to_device(Device::Cpu).unwrap().device(), Device::Cpu);

    let x16 = x.to_dtype(DType::BF16).unwrap();
    let on_gpu16 = gpu(&x16);
    assert_eq!(on_gpu16.dtype(), DType::BF16);
    let back = on_gpu16.to_host().unwrap();
    assert_eq!((back.device(), back.dtype()), (Device::Cpu, DType::BF16));
    assert_eq!(back.to_vec(), x16.to_vec());
    // Rounding to bf16 on the device matches the host (nearest even).
    assert_eq!(on_gpu.to_dtype(DType::BF16).unwrap().to_host().unwrap().to_vec(), x16.to_vec());
    // A strided view goes over as its own elements.
    let view = x.transpose(0, 2).unwrap().narrow(1, 1, 3).unwrap();
    assert_eq!(gpu(&view).to_host().unwrap().to_vec(), view.to_vec());
}

#[test]
fn constants_are_created_on_the_gpu() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let z = Tensor::zeros_on(&[2, 3], GPU).unwrap();
    assert_eq!((z.device(), z.to_host().unwrap().to_vec()), (GPU, vec![0.0; 6]));
    let f = Tensor::full_on(&[4], -1.25, GPU).unwrap();
    assert_eq!((f.device(), f.to_host().unwrap().to_vec()), (GPU, vec![-1.25; 4]));
    let like = f.full_like(3.0).unwrap();
    assert_eq!((like.device(), like.shape(), like.to_host().unwrap().to_vec()), (GPU, &[4][..], vec![3.0; 4]));
    assert_eq!(f.zeros_like().unwrap().device(), GPU);
}

#[test]
fn mixing_devices_is_an_error() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let (cpu, on_gpu) = (rand(&[3, 3], -1.0, 1.0, 2), gpu(&rand(&[3, 3], -1.0, 1.0, 3)));
    let mismatch = |r: tensor::Result<Tensor>| matches!(r, Err(Error::DeviceMismatch { .. }));
    assert!(mismatch(cpu.add(&on_gpu)));
    assert!(mismatch(on_gpu.mul(&cpu)));
    assert!(mismatch(cpu.matmul(&on_gpu)));
    assert!(mismatch(on_gpu.matmul(&cpu)));
    assert!(mismatch(Tensor::cat(&[&on_gpu, &cpu], 0)));
    assert!(mismatch(Tensor::select(&cpu, &on_gpu, &on_gpu)));
    assert!(mismatch(on_gpu.clone().accumulate(cpu.clone())));
}

#[test]
fn unary_ops_agree() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let x = rand(&[7, 33], -3.0, 3.0, 4);
    for op in [Unary::Exp, Unary::Sigmoid, Unary::Tanh, Unary::Relu, Unary::Silu, Unary::Neg, Unary::Square] {
        assert_f32_close(&gpu(&x).unary(op).unwrap(), &x.unary(op).unwrap(), &format!("{op:?}"));
    }
    // A transposed (strided) input.
    let xt = x.transpose(0, 1).unwrap();
    assert_f32_close(
        &gpu(&x).transpose(0, 1).unwrap().unary(Unary::Exp).unwrap(),
        &xt.unary(Unary::Exp).unwrap(),
        "exp of a view",
    );
}

#[test]
fn binary_ops_with_broadcasting_agree() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let a = rand(&[4, 1, 5], -2.0, 2.0, 5);
    let b = rand(&[3, 1], 0.5, 2.0, 6);
    for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum] {
        let want = a.binary(&b, op).unwrap();
        assert_f32_close(&gpu(&a).binary(&gpu(&b), op).unwrap(), &want, &format!("{op:?}"));
        let want_swapped = b.binary(&a, op).unwrap();
        assert_f32_close(&gpu(&b).binary(&gpu(&a), op).unwrap(), &want_swapped, &format!("{op:?} swapped"));
    }
}

#[test]
fn scalar_ops_agree() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let x = rand(&[6, 9], -2.0, 2.0, 7);
    for (op, s) in [(Binary::Add, 0.75), (Binary::Sub, -1.5), (Binary::Mul, 3.0), (Binary::Div, 4.0)] {
        assert_f32_close(&gpu(&x).scalar_op(op, s).unwrap(), &x.scalar_op(op, s).unwrap(), &format!("{op:?} {s}"));
    }
}

#[test]
fn select_agrees() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    // cond: 0 or a large positive value (about half each).
    let cond = rand(&[4, 6], -1.0, 1.0, 8).scalar_op(Binary::Mul, 1e6).unwrap().unary(Unary::Relu).unwrap();
    let (a, b) = (rand(&[4, 6], -1.0, 1.0, 9), rand(&[6], -1.0, 1.0, 10));
    let want = Tensor::select(&cond, &a, &b).unwrap();
    assert_f32_close(&Tensor::select(&gpu(&cond), &gpu(&a), &gpu(&b)).unwrap(), &want, "select");
}

#[test]
fn accumulate_agrees() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let (x, y) = (rand(&[5, 8], -1.0, 1.0, 11), rand(&[5, 8], -1.0, 1.0, 12));
    let want = x.add(&y).unwrap();
    // Sole owners: added in place.
    assert_f32_close(&gpu(&x).accumulate(gpu(&y)).unwrap(), &want, "accumulate in place");
    // Both buffers shared: a new sum.
    let (gx, gy) = (gpu(&x), gpu(&y));
    let (_keep_x, _keep_y) = (gx.clone(), gy.clone());
    assert_f32_close(&gx.accumulate(gy).unwrap(), &want, "accumulate shared");
    // Broadcast shapes.
    let row = rand(&[8], -1.0, 1.0, 13);
    assert_f32_close(&gpu(&x).accumulate(gpu(&row)).unwrap(), &x.add(&row).unwrap(), "accumulate broadcast");
}

/// `Tensor::add_matmul` (a gradient summed by the GEMM, β = 1) adds into the sum's own buffer
/// when it is the only owner, bit for bit as the product added to it apart (β·C after the
/// whole sum over k, as cuBLAS's epilogue adds it; k here spans several of the emulator's
/// blocks), and leaves a shared sum as it was. Under bf16 products the write forgets the sum's
/// bf16 copy: a product reading the sum afterwards converts the new values.
#[test]
fn add_matmul_adds_into_a_sole_owner_and_forgets_its_bf16_copy() {
    if no_gpu() {
        return;
    }
    let (sum, dy, w) =
        (rand(&[6, 20], -1.0, 1.0, 47), rand(&[6, 1300], -1.0, 1.0, 48), rand(&[1300, 20], -1.0, 1.0, 49));
    let (gdy, gw) = (gpu(&dy), gpu(&w));
    let bits = |t: &Tensor| t.to_host().unwrap().to_vec();
    {
        let _precision = Precision::set(MatmulPrecision::F32);
        let apart = gpu(&sum).accumulate(gdy.matmul(&gw).unwrap()).unwrap();
        assert_f32_close(&apart, &sum.add(&dy.matmul(&w).unwrap()).unwrap(), "sum and product");
        let owned = gpu(&sum);
        let address = owned.cuda_f32("test").unwrap().device_ptr();
        let total = owned.add_matmul(&gdy, &gw).unwrap();
        assert_eq!(total.cuda_f32("test").unwrap().device_ptr(), address, "added in the sum's own buffer");
        assert_eq!(bits(&total), bits(&apart), "in place");
        let shared = gpu(&sum);
        assert_eq!(bits(&shared.clone().add_matmul(&gdy, &gw).unwrap()), bits(&apart), "shared");
        assert_eq!(bits(&shared), sum.to_vec(), "a shared sum is left as it was");
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let probe = gpu(&rand(&[20, 3], -1.0, 1.0, 50));
    let owned = gpu(&sum);
    owned.matmul(&probe).unwrap(); // makes the sum's bf16 copy (and the probe's)
    let total = owned.add_matmul(&gdy, &gw).unwrap();
    let before = dev.counters();
    let product = total.matmul(&probe).unwrap();
    let conversions = dev.counters().since(&before).launches_by_kernel.get("f32_to_bf16_kernel").copied();
    assert_eq!(conversions, Some(1), "the new sum is converted again");
    assert_eq!(bits(&product), bits(&total.deep_copy().unwrap().matmul(&probe).unwrap()), "the product reads the sum");
}

#[test]
fn reductions_agree() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let x = rand(&[3, 50, 4], -1.0, 1.0, 14);
    let g = gpu(&x);
    for axis in 0..3 {
        for keepdim in [false, true] {
            let what = format!("axis {axis} keepdim {keepdim}");
            assert_f32_close(
                &g.sum_axis(axis, keepdim).unwrap(),
                &x.sum_axis(axis, keepdim).unwrap(),
                &format!("sum {what}"),
            );
            assert_f32_close(
                &g.mean_axis(axis, keepdim).unwrap(),
                &x.mean_axis(axis, keepdim).unwrap(),
                &format!("mean {what}"),
            );
            let (got, got_arg) = g.max_axis(axis, keepdim).unwrap();
            let (want, want_arg) = x.max_axis(axis, keepdim).unwrap();
            assert_f32_close(&got, &want, &format!("max {what}"));
            assert_eq!(got_arg, want_arg, "argmax {what}");
        }
    }
    assert_f32_close(&g.sum_all().unwrap(), &x.sum_all().unwrap(), "sum_all");
    // A strided view, and sums that undo broadcasting.
    let xt = x.transpose(0, 2).unwrap();
    assert_f32_close(
        &g.transpose(0, 2).unwrap().sum_axis(1, false).unwrap(),
        &xt.sum_axis(1, false).unwrap(),
        "sum of a view",
    );
    for shape in [&[50, 1][..], &[1, 4], &[4], &[3, 1, 1]] {
        assert_f32_close(
            &g.sum_to_shape(shape).unwrap(),
            &x.sum_to_shape(shape).unwrap(),
            &format!("sum_to_shape {shape:?}"),
        );
    }
    // An empty axis sums to zeros.
    let empty = Tensor::zeros(&[3, 0, 4]);
    assert_f32_close(&gpu(&empty).sum_axis(1, false).unwrap(), &empty.sum_axis(1, false).unwrap(), "empty sum");
}

#[test]
fn matmul_agrees() {
    if no_gpu() {
        return;
    }
    let _lock = device_lock();
    let check = |a: &Tensor, b: &Tensor, what: &str| {
        let want = a.matmul(b).unwrap();
        assert_f32_close(&gpu(a).matmul(&gpu(b)).unwrap(), &want, what);
    };
    let (a, b) = (rand(&[17, 23], -1.0, 1.0, 15), rand(&[23, 9], -1.0, 1.0, 16));
    check(&a, &b, "plain");
    // x · wᵀ with w stored [out, in], as a linear layer does.
    let w = rand(&[9, 23], -1.0, 1.0, 17);
    let want = a.matmul(&w.transpose(0, 1).unwrap()).unwrap();
    assert_f32_close(&gpu(&a).matmul(&gpu(&w).transpose(0, 1).unwrap()).unwrap(), &want, "transposed rhs");
    // aᵀ · b with both as views of the GPU tensors.
    let c = rand(&[17, 9], -1.0, 1.0, 18);
    let want = a.transpose(0, 1).unwrap().matmul(&c).unwrap();
    assert_f32_close(&gpu(&a).transpose(0, 1).unwrap().matmul(&gpu(&c)).unwrap(), &want, "transposed lhs");
    // A narrowed (offset, row-strided) operand.
    let wide = rand(&[17, 40], -1.0, 1.0, 19);
    let want = wide.narrow(1, 5, 23).unwrap().matmul(&b).unwrap();
    assert_f32_close(&gpu(&wide).narrow(1, 5, 23).unwrap().matmul(&gpu(&b)).unwrap(), &want, "narrowed lhs");
    // Batched, batch dims broadcast: [2, 3, 5, 7] · [3, 7, 4], and [2, 1, 5, 7] · [7, 4].
    check(&rand(&[2, 3, 5, 7], -1.0, 1.0, 20), &rand(&[3, 7, 4], -1.0, 1.0, 21), "batched broadcast");
    check(&rand(&[2, 1, 5, 7], -1.0, 1.0, 22), &rand(&[7, 4], -1.0, 1.0, 23), "batched against a matrix");
    // A batched transposed view: q · kᵀ.
    let (q, k) = (rand(&[2, 3, 5, 8], -1.0, 1.0, 24), rand(&[2, 3, 6, 8], -1.0, 1.0, 25));
    let want = q.matmul(&k.transpose(2, 3).unwrap()).unwrap();
    assert_f32_close(&gpu(&q).matmul(&gpu(&k).transpose(2, 3).unwrap()).unwrap(), &want, "q·kᵀ");
    // A broadcast row (row stride 0) that cuBLAS cannot read in place.
    let row = rand(&[1, 23], -1.0, 1.0, 26);
    let want = row.expand(&[6, 23]).unwrap().matmul(&b).unwrap();
    assert_f32_close(&gpu(&row).expand(&[6, 23]).unwrap().matmul(&gpu(&b)).unwrap(), &want, "broadcast rows");
    // k = 0 gives zeros.
    check(&Tensor::zeros(&[3, 0]), &Tensor::zeros(&[0, 4]), "k = 0");
}

#[test]
fn bf16_matmul_precision() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    assert_eq!(matmul_precision(), MatmulPrecision::Bf16);
    // Positive inputs, so no cancellation: the bf16 error stays ~2⁻⁸ relative. A batched
    // lhs against a transposed weight view, as a linear layer computes x·Wᵀ.
    let (x, w) = (rand(&[2, 33, 64], 0.5, 1.5, 27), rand(&[19, 64], 0.5, 1.5, 28));
    let wt = w.transpose(0, 1).unwrap();
    let got = gpu(&x).matmul(&gpu(&w).transpose(0, 1).unwrap()).unwrap();
    assert_close(&got, &x.matmul(&wt).unwrap(), BF16_REL, 0.0, "bf16 vs f32");
    // Exactly the product of the bf16-rounded operands, up to f32 summation order.
    let round = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    assert_close(&got, &round(&x).matmul(&round(&wt)).unwrap(), 1e-3, 1e-5, "bf16 vs rounded inputs");
    // Backward products run in bf16 too: the gradients stay within the bf16 tolerance.
    let (xv, wv) = (Var::parameter(gpu(&x)), Var::parameter(gpu(&w)));
    xv.matmul(&wv.transpose(0, 1).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let (xc, wc) = (Var::parameter(x.clone()), Var::parameter(w.clone()));
    xc.matmul(&wc.transpose(0, 1).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    assert_close(&xv.grad().unwrap(), &xc.grad().unwrap(), BF16_REL, 0.0, "bf16 dx");
    assert_close(&wv.grad().unwrap(), &wc.grad().unwrap(), BF16_REL, 0.0, "bf16 dW");
}

/// The gate and up projections as one product of their packed weights and SwiGLU over its
/// halves, under bf16 products: the GPU agrees with the CPU (the projections one by one),
/// forward and every gradient (x's added onto a gradient it already has), with one GEMM
/// forward (its output in bf16, which SwiGLU reads), one for the input gradient and one per
/// weight gradient, and no conversion once the weights are packed.
#[test]
fn packed_gate_up_and_swiglu_halves_agree() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let round = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let (x, wg, wu) = (round(rand(&[2, 5, 16], -1.0, 1.0, 60)), round(rand(&[12, 16], -0.5, 0.5, 61)), {
        round(rand(&[12, 16], -0.5, 0.5, 62))
    });
    let seed = rand(&[10, 12], -1.0, 1.0, 63);
    let run = |device: Device| {
        let on = |t: &Tensor| Var::parameter(t.to_device(device).unwrap());
        let (x, wg, wu) = (on(&x), on(&wg), on(&wu));
        let rows = x.reshape(&[10, 16]).unwrap();
        let forward = || rows.packed_linear(&[&wg, &wu], ProductOutput::Bf16).unwrap().swiglu_halves().unwrap();
        // The second forward is the one counted: the first packs the weights and converts x.
        forward();
        let before = device_counters(device);
        let h = forward();
        let forward_launches = launches_since(device, &before);
        // x is read by a sum too, so it may have a gradient already when this one's dx comes.
        let before = device_counters(device);
        let weighted = h.mul(&Var::constant(seed.to_device(device).unwrap())).unwrap().sum_all().unwrap();
        weighted.add(&rows.sum_all().unwrap()).unwrap().backward().unwrap();
        let backward_launches = launches_since(device, &before);
        let grads = [x.grad().unwrap(), wg.grad().unwrap(), wu.grad().unwrap()];
        (h.value(), grads, forward_launches, backward_launches)
    };
    let (h_cpu, grads_cpu, ..) = run(Device::Cpu);
    let (h_gpu, grads_gpu, forward, backward) = run(GPU);
    // bf16 operands: each result is a sum of rounded terms, so the error scales with the largest.
    let bf16_close = |got: &Tensor, want: &Tensor, what: &str| {
        let scale = want.to_vec().iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_close(got, want, BF16_REL, BF16_REL * scale, what);
    };
    bf16_close(&h_gpu, &h_cpu, "packed gate-up SwiGLU forward");
    for (what, (g, c)) in ["dx", "dW_gate", "dW_up"].iter().zip(grads_gpu.iter().zip(&grads_cpu)) {
        bf16_close(g, c, what);
    }
    let count = |launches: &BTreeMap<&'static str, u64>, name: &str| launches.get(name).copied();
    let forward = forward.expect("a GPU counts its launches");
    assert_eq!(count(&forward, "cublasGemmEx"), Some(1), "one GEMM forward: {forward:?}");
    assert_eq!(count(&forward, "swiglu_forward_bf16"), Some(1), "{forward:?}");
    assert_eq!(forward.values().sum::<u64>(), 2, "nothing else forward: {forward:?}");
    let backward = backward.expect("a GPU counts its launches");
    assert_eq!(count(&backward, "swiglu_backward_bf16"), Some(1), "{backward:?}");
    assert_eq!(count(&backward, "f32_to_bf16_kernel"), None, "no conversion backward: {backward:?}");
}

/// `[x, then each projection's W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]` of a fused
/// gated group of `d_outs` outputs reading `x: x_shape` (its last dim the input width), ranks
/// `(r_c, r_s)`, drawn from seeds after `seed`.
fn gated_group_values(seed: u64, x_shape: &[usize], d_outs: &[usize], (rc, rs): (usize, usize)) -> Vec<Tensor> {
    let d_in = x_shape[x_shape.len() - 1];
    let mut seed = seed;
    let mut t = |shape: &[usize], scale: f32| {
        seed += 1;
        rand(shape, -scale, scale, seed)
    };
    let mut values = vec![t(x_shape, 1.0)];
    for &d_out in d_outs {
        values.extend([t(&[d_out, d_in], 0.3), t(&[rc, d_in], 0.3), t(&[rc], 0.3), t(&[d_out, rc], 0.5)]);
        values.extend([t(&[d_out], 0.3), Tensor::full(&[1], 1.25), t(&[rs, d_in], 0.3), t(&[rs], 0.3)]);
        values.extend([t(&[1, rs], 0.5), t(&[1], 0.3), Tensor::full(&[1], 0.75)]);
    }
    values
}

/// The projections of [`gated_group_values`]' vars after `x`, eleven each.
fn gated_group(vars: &[Var]) -> Vec<GatedProjectionVars<'_>> {
    vars.chunks(11)
        .map(|p| GatedProjectionVars {
            weight: &p[0],
            channel: [&p[1], &p[2], &p[3], &p[4], &p[5]],
            scalar: [&p[6], &p[7], &p[8], &p[9], &p[10]],
        })
        .collect()
}

/// Under bf16 products a fused gated group may store its output in bf16
/// (`ProductOutput::Bf16`, for SwiGLU, which reads it so): the f32 output rounded to nearest
/// even, bit for bit, and the same gradients bit for bit (the backward recomputes the gate
/// from the saved `ZU` and never reads the output).
#[test]
fn a_fused_gated_group_stores_its_output_in_bf16_when_asked() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let rows = 12;
    let values = gated_group_values(70, &[rows, 32], &[24, 16], (8, 4));
    let weights = rand(&[rows, 40], -1.0, 1.0, 90);
    let run = |output: ProductOutput| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(gpu(v))).collect();
        let projections = gated_group(&vars[1..]);
        let y = vars[0].fused_gated_projections(&projections, Unary::Silu, output).unwrap();
        let y_values = y.value().to_host().unwrap().to_vec();
        y.mul(&Var::constant(gpu(&weights))).unwrap().sum_all().unwrap().backward().unwrap();
        let grads: Vec<Vec<f32>> = vars.iter().map(|v| v.grad().unwrap().to_host().unwrap().to_vec()).collect();
        (y_values, grads)
    };
    let (y_f32, grads_f32) = run(ProductOutput::F32);
    let (y_bf16, grads_bf16) = run(ProductOutput::Bf16);
    let f32_output = Tensor::from_vec(y_f32, &[rows, 40]).unwrap();
    let rounded = f32_output.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec();
    assert_eq!(y_bf16, rounded, "the bf16 output is the f32 one rounded");
    assert_eq!(grads_bf16, grads_f32, "the gradients do not depend on how the output is stored");
}

/// Under bf16 products attention over gated q, k and v as one op
/// (`Var::fused_gated_rotary_attention`) has no RoPE launch, forward or backward: the gate
/// kernel writes q, k and v rotated (one launch after the GEMM) and attention's backward the
/// packed gradient. It agrees with the two ops it replaces on the same device (the packed
/// gated output, then attention over it) to bf16 precision: the one op rounds q and k once,
/// the two ops twice (3e-2 of each result's largest value; a wrong rotation is off by O(1)).
#[test]
fn gated_rotary_attention_is_one_gate_launch_and_no_rope_under_bf16() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let (batch, seq, heads, head_dim) = (2, 20, 2, 16);
    let d_out = heads * head_dim;
    let values = gated_group_values(120, &[batch, seq, 32], &[d_out; 3], (8, 4));
    let dy = rand(&[batch, seq, heads, head_dim], -1.0, 1.0, 140);
    let run = |one_op: bool| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(gpu(v))).collect();
        let parts = gated_group(&vars[1..]);
        let before = dev.counters();
        let y = if one_op {
            vars[0].fused_gated_rotary_attention(&[parts[0], parts[1], parts[2]], Unary::Silu, heads, 0.25, 10_000.0)
        } else {
            let qkv = vars[0].fused_gated_projections(&parts, Unary::Silu, ProductOutput::Bf16).unwrap();
            Var::rotary_causal_attention_packed(&qkv, heads, 0.25, 10_000.0)
        }
        .unwrap();
        let forward = dev.counters().since(&before).launches_by_kernel;
        let before = dev.counters();
        y.backward_with(gpu(&dy)).unwrap();
        let backward = dev.counters().since(&before).launches_by_kernel;
        let mut results = vec![y.value().to_host().unwrap()];
        results.extend(vars.iter().map(|v| v.grad().unwrap().to_host().unwrap()));
        (results, forward, backward)
    };
    let (one_op, forward, backward) = run(true);
    let (two_ops, _, _) = run(false);
    for (i, (got, want)) in one_op.iter().zip(&two_ops).enumerate() {
        let largest = want.to_vec().iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let tolerance = Tolerance { atol: f64::from(3e-2 * largest), rtol: 0.0 };
        gradcheck::assert_close(&format!("result {i}"), &got.to_vec(), &want.to_vec(), tolerance);
    }
    let gate = forward.get("fused_gate_apply_rotary_qkv").copied();
    assert_eq!(gate, Some(1), "one gate launch writes q, k and v: {forward:?}");
    assert!(!forward.contains_key("rope_rotate") && !backward.contains_key("rope_rotate"), "{forward:?} {backward:?}");
}

/// Under bf16 products the FFN's gated gate and up projections and SwiGLU as one op
/// (`Var::fused_gated_swiglu`) have no SwiGLU launch of their own: the gate kernel writes
/// SwiGLU's output, and, for an output gradient held in bf16 alone (as the down product's
/// backward writes it), the gate's row kernel computes SwiGLU's backward. They give the two
/// ops' results bit for bit, forward and every gradient, for that gradient and for an f32 one
/// (which SwiGLU's backward launch reads, as in the two ops).
#[test]
fn gated_swiglu_is_one_gate_launch_and_the_same_bits_under_bf16() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let (rows, hidden) = (30, 40);
    let values = gated_group_values(150, &[rows, 32], &[hidden; 2], (8, 4));
    let dy = rand(&[rows, hidden], -1.0, 1.0, 160);
    // dy held as its bf16 rounding alone (the storage's own copy, saved as products save it).
    let bf16_alone = || {
        let dy = gpu(&dy);
        dy.to_dtype(DType::BF16).unwrap();
        dy.saved_for_products()
    };
    let run = |one_op: bool, dy: Tensor| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(gpu(v))).collect();
        let parts = gated_group(&vars[1..]);
        let before = dev.counters();
        let y = if one_op {
            vars[0].fused_gated_swiglu(&[parts[0], parts[1]], Unary::Silu)
        } else {
            let gated = vars[0].fused_gated_projections(&parts, Unary::Silu, ProductOutput::Bf16).unwrap();
            gated.swiglu_halves()
        }
        .unwrap();
        let forward = dev.counters().since(&before).launches_by_kernel;
        let before = dev.counters();
        y.backward_with(dy).unwrap();
        let backward = dev.counters().since(&before).launches_by_kernel;
        let mut results = vec![y.value().to_host().unwrap().to_vec()];
        results.extend(vars.iter().map(|v| v.grad().unwrap().to_host().unwrap().to_vec()));
        (results, forward, backward)
    };
    let swiglu_launches =
        |launches: &BTreeMap<&str, u64>| launches.keys().filter(|name| name.starts_with("swiglu")).count();
    let (one_op, forward, backward) = run(true, bf16_alone());
    let (two_ops, _, two_ops_backward) = run(false, bf16_alone());
    assert_eq!(one_op, two_ops, "the same bits (a bf16 output gradient)");
    assert_eq!(forward.get("fused_gate_apply_swiglu").copied(), Some(1), "{forward:?}");
    assert_eq!(swiglu_launches(&forward), 0, "SwiGLU ran on its own: {forward:?}");
    assert_eq!(backward.get("fused_gate_backward_rows_swiglu").copied(), Some(1), "{backward:?}");
    assert_eq!(swiglu_launches(&backward), 0, "SwiGLU's backward ran on its own: {backward:?}");
    assert_eq!(swiglu_launches(&two_ops_backward), 1, "{two_ops_backward:?}");
    let (one_op, _, _) = run(true, gpu(&dy));
    let (two_ops, _, _) = run(false, gpu(&dy));
    assert_eq!(one_op, two_ops, "the same bits (an f32 output gradient)");
}

/// Under bf16 products a gated output projection and the residual stream's add and RMSNorm
/// as one op (`Var::fused_gated_add_rms_norm`) are one launch after the GEMM, with no gate
/// apply and no add-and-norm launch of their own, and give the two ops' results bit for bit:
/// the sum, the normalised sum and every gradient (the stream's, the input's, the norm
/// weight's and the projection's), with a gradient reaching the sum from a later add. The
/// backward finishes the norm's weight gradient in the gate's column-sum launch: no
/// `rms_norm_weight_grad_finish` of its own.
#[test]
fn gated_add_rms_norm_is_one_launch_and_the_same_bits_under_bf16() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let (batch, seq, d_in, d_out) = (2, 15, 24, 40);
    let mut values = gated_group_values(170, &[batch * seq, d_in], &[d_out], (8, 4));
    values.push(rand(&[batch, seq, d_out], -1.5, 1.5, 180));
    values.push(rand(&[d_out], 0.5, 1.5, 181));
    let (later, dy) = (rand(&[batch, seq, d_out], -1.0, 1.0, 182), rand(&[batch, seq, d_out], -1.0, 1.0, 183));
    let run = |one_op: bool| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(gpu(v))).collect();
        let projection = gated_group(&vars[1..12])[0];
        let (stream, weight) = (&vars[12], &vars[13]);
        let before = dev.counters();
        let (sum, normed) = if one_op {
            vars[0].fused_gated_add_rms_norm(projection, Unary::Silu, stream, weight, 1e-5)
        } else {
            let delta = vars[0].fused_gated_projections(&[projection], Unary::Silu, ProductOutput::Bf16).unwrap();
            stream.add_rms_norm(&delta.reshape(&[batch, seq, d_out]).unwrap(), weight, 1e-5)
        }
        .unwrap();
        let forward = dev.counters().since(&before).launches_by_kernel;
        // The sum also feeds a later residual add, as the stream does.
        let out = sum.mul(&Var::constant(gpu(&later))).unwrap().add(&normed).unwrap();
        let before = dev.counters();
        out.backward_with(gpu(&dy)).unwrap();
        let backward = dev.counters().since(&before).launches_by_kernel;
        let mut results = vec![sum.value().to_host().unwrap().to_vec(), normed.value().to_host().unwrap().to_vec()];
        results.extend(vars.iter().map(|v| v.grad().unwrap().to_host().unwrap().to_vec()));
        (results, forward, backward)
    };
    let (one_op, forward, backward) = run(true);
    let (two_ops, two_ops_forward, two_ops_backward) = run(false);
    assert_eq!(one_op, two_ops, "the same bits");
    let finish =
        |launches: &std::collections::BTreeMap<&str, u64>| launches.get("rms_norm_weight_grad_finish").copied();
    assert_eq!(finish(&backward), None, "{backward:?}");
    assert_eq!(finish(&two_ops_backward), Some(1), "{two_ops_backward:?}");
    assert_eq!(backward.get("column_sums_many"), two_ops_backward.get("column_sums_many"), "{backward:?}");
    assert_eq!(forward.get("fused_gate_add_rms_norm").copied(), Some(1), "{forward:?}");
    let apart = |name: &&&str| name.starts_with("fused_gate_apply") || name.starts_with("add_rms_norm");
    assert_eq!(forward.keys().filter(apart).count(), 0, "{forward:?}");
    assert_eq!(two_ops_forward.keys().filter(apart).count(), 2, "{two_ops_forward:?}");
}

/// Every result of `run` on the GPU (under bf16 products) against the CPU's (f32), each to
/// `3e-2` of the CPU result's largest value, and at least `6e-3`: the GPU's products read bf16
/// and it stores some results in bf16, so a bound at the bf16 level; the floor is for the α's
/// gradients, one sum over every row and column whose terms cancel (seen: 0.0224 against the
/// GPU's 0.0200, where every tensor result agrees to 1.2% of its largest value). A wrong gate,
/// a missing rounding or a wrong row is off by far more.
fn assert_bf16_gpu_agrees_with_cpu(what: &str, run: impl Fn(Device) -> Vec<Tensor>) {
    let want = run(Device::Cpu);
    let got = run(GPU);
    assert_eq!(got.len(), want.len(), "{what}: result count");
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let (got, want) = (got.to_host().unwrap().to_vec(), want.to_vec());
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let tolerance = Tolerance { atol: f64::from(3e-2 * largest.max(0.2)), rtol: 0.0 };
        gradcheck::assert_close(&format!("{what}: result {i}"), &got, &want, tolerance);
    }
}

/// The fused ops of Transponder's FFN and output projections on the GPU under bf16 products,
/// SwiGLU's backward inside the gate's (an output gradient held in bf16 alone, as the down
/// product's backward writes it) and the o/down gate inside the residual add and RMSNorm,
/// agree with the CPU's f32 ops: outputs and every gradient.
#[test]
fn gated_swiglu_and_gated_add_rms_norm_agree_with_the_cpu_under_bf16() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let (rows, d_in, hidden) = (30, 32, 40);
    let values = gated_group_values(190, &[rows, d_in], &[hidden; 2], (8, 4));
    // dy as the GPU holds it (bf16 alone), the CPU reading the same rounded values.
    let dy = rand(&[rows, hidden], -1.0, 1.0, 191).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    assert_bf16_gpu_agrees_with_cpu("gated SwiGLU", |device| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(v.to_device(device).unwrap())).collect();
        let parts = gated_group(&vars[1..]);
        let y = vars[0].fused_gated_swiglu(&[parts[0], parts[1]], Unary::Silu).unwrap();
        let dy = dy.to_device(device).unwrap();
        dy.to_dtype(DType::BF16).unwrap();
        y.backward_with(dy.saved_for_products()).unwrap();
        let mut results = vec![y.value()];
        results.extend(vars.iter().map(|v| v.grad().unwrap()));
        results
    });

    let (batch, seq, d_out) = (2, 15, 24);
    let mut values = gated_group_values(192, &[batch * seq, d_in], &[d_out], (8, 4));
    values.push(rand(&[batch, seq, d_out], -1.5, 1.5, 193));
    values.push(rand(&[d_out], 0.5, 1.5, 194));
    let (later, dy) = (rand(&[batch, seq, d_out], -1.0, 1.0, 195), rand(&[batch, seq, d_out], -1.0, 1.0, 196));
    assert_bf16_gpu_agrees_with_cpu("gated add and RMSNorm", |device| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(v.to_device(device).unwrap())).collect();
        let projection = gated_group(&vars[1..12])[0];
        let (sum, normed) =
            vars[0].fused_gated_add_rms_norm(projection, Unary::Silu, &vars[12], &vars[13], 1e-5).unwrap();
        let later = Var::constant(later.to_device(device).unwrap());
        let out = sum.mul(&later).unwrap().add(&normed).unwrap();
        out.backward_with(dy.to_device(device).unwrap()).unwrap();
        let mut results = vec![sum.value(), normed.value()];
        results.extend(vars.iter().map(|v| v.grad().unwrap()));
        results
    });
}

/// Under bf16 products a fused gate's backward reads dẐ in bf16 where an f32 dẐ keeps a
/// bf16 copy beside it (RMSNorm's backward writes one for a residual stream's sum, the o and
/// down projections' dẐ): the gradients are then those of dẐ rounded to bf16, bit for bit;
/// without the copy they are the f32 dẐ's, which differ.
#[test]
fn a_fused_gate_backward_reads_the_bf16_copy_an_f32_gradient_keeps() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let (rows, d_in, d_out, rc, rs) = (12, 32, 24, 8, 4);
    let mut seed = 110;
    let mut t = |shape: &[usize], scale: f32| {
        seed += 1;
        rand(shape, -scale, scale, seed)
    };
    let mut values = vec![t(&[rows, d_in], 1.0), t(&[d_out, d_in], 0.3), t(&[rc, d_in], 0.3), t(&[rc], 0.3)];
    values.extend([t(&[d_out, rc], 0.5), t(&[d_out], 0.3), Tensor::full(&[1], 1.25), t(&[rs, d_in], 0.3)]);
    values.extend([t(&[rs], 0.3), t(&[1, rs], 0.5), t(&[1], 0.3), Tensor::full(&[1], 0.75)]);
    let upstream = rand(&[rows, d_out], -1.0, 1.0, 130);
    let gradients = |dy: Tensor| {
        let vars: Vec<Var> = values.iter().map(|v| Var::parameter(gpu(v))).collect();
        let p = &vars[1..];
        let y = vars[0]
            .fused_gated_projection(
                &p[0],
                [&p[1], &p[2], &p[3], &p[4], &p[5]],
                [&p[6], &p[7], &p[8], &p[9], &p[10]],
                Unary::Silu,
            )
            .unwrap();
        y.backward_with(dy).unwrap();
        vars.iter().map(|v| v.grad().unwrap().to_host().unwrap().to_vec()).collect::<Vec<_>>()
    };
    let with_copy = gpu(&upstream);
    with_copy.to_dtype(DType::BF16).unwrap(); // the storage keeps the copy it makes
    let rounded = upstream.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let from_rounded = gradients(gpu(&rounded));
    assert_eq!(gradients(with_copy), from_rounded, "an f32 dẐ with a bf16 copy: the copy's gradients");
    assert_ne!(gradients(gpu(&upstream)), from_rounded, "an f32 dẐ alone is read in f32");
}

/// A product stored in bf16 (`ProductOutput::Bf16`) is still an f32 tensor: read as f32 it
/// is its bf16 values widened, and written in place it becomes plain f32 storage holding the
/// write (its bf16 rounding no longer stands for it).
#[test]
fn a_product_stored_in_bf16_reads_widened_and_takes_writes() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let (x, w) = (rand(&[6, 16], -1.0, 1.0, 95), rand(&[8, 16], -1.0, 1.0, 96));
    let mut y = gpu(&x).packed_linear(&[&gpu(&w)], ProductOutput::Bf16).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let f32_product = gpu(&x).packed_linear(&[&gpu(&w)], ProductOutput::F32).unwrap();
    let rounded = f32_product.to_host().unwrap().to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    assert_eq!(y.to_host().unwrap().to_vec(), rounded.to_vec(), "read as f32: the bf16 values widened");
    let (dev, buffer) = y.cuda_f32_mut("test").unwrap();
    kernels::cuda::elementwise::fill(&dev, 0.1, buffer).unwrap();
    assert_eq!(y.to_host().unwrap().to_vec(), vec![0.1; 48], "the write is the value");
    let copy = y.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_host().unwrap();
    assert_eq!(
        copy.to_vec(),
        Tensor::full(&[48], 0.1).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec()
    );
}

/// An ungated SwiGLU FFN under bf16 products: on the GPU its gate and up projections run as
/// one packed product (one GEMM forward for the two), on the CPU one by one; the output and
/// every gradient agree (a swapped gate and up would not).
#[test]
fn an_ungated_ffn_packs_its_gate_and_up_projections_on_the_gpu() {
    use nn::ffn::SwiGlu;
    use nn::init::WeightInit;
    use nn::Module;
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let run = |device: Device| {
        let ffn = SwiGlu::new(16, 24, WeightInit::KaimingUniform, &mut Rng::new(70));
        ffn.to_device(device).unwrap();
        let x = Var::parameter(rand(&[2, 5, 16], -1.0, 1.0, 71).to_device(device).unwrap());
        let before = device_counters(device);
        let y = ffn.forward(&x).unwrap();
        let launches = launches_since(device, &before);
        y.mul(&Var::constant(rand(&[2, 5, 16], -1.0, 1.0, 72).to_device(device).unwrap()))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads: Vec<Tensor> = ffn.named_parameters().iter().map(|p| p.var.grad().unwrap()).collect();
        (y.value(), x.grad().unwrap(), grads, launches)
    };
    let (y_cpu, dx_cpu, grads_cpu, _) = run(Device::Cpu);
    let (y_gpu, dx_gpu, grads_gpu, launches) = run(GPU);
    let bf16_close = |got: &Tensor, want: &Tensor, what: &str| {
        let scale = want.to_vec().iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_close(got, want, BF16_REL, BF16_REL * scale, what);
    };
    bf16_close(&y_gpu, &y_cpu, "FFN forward");
    bf16_close(&dx_gpu, &dx_cpu, "FFN dx");
    for (i, (g, c)) in grads_gpu.iter().zip(&grads_cpu).enumerate() {
        bf16_close(g, c, &format!("FFN parameter gradient {i}"));
    }
    let launches = launches.expect("a GPU counts its launches");
    // The gate and up projections' GEMM and the down projection's: two, not three.
    assert_eq!(launches.get("cublasGemmEx").copied(), Some(2), "{launches:?}");
}

/// The device's counters, when `device` is a GPU.
fn device_counters(device: Device) -> Option<DeviceCounters> {
    match device {
        Device::Cuda(ordinal) => Some(tensor::cuda::device(ordinal).unwrap().counters()),
        Device::Cpu => None,
    }
}

/// Launches by kernel on `device` since `before` (`None` on the CPU).
fn launches_since(device: Device, before: &Option<DeviceCounters>) -> Option<BTreeMap<&'static str, u64>> {
    Some(device_counters(device)?.since(before.as_ref()?).launches_by_kernel)
}

/// A training graph keeps what its backward reads, not every value: an op's output is freed
/// once its last `Var` is dropped (the product's output below, which the sum's backward does
/// not read), and under bf16 products an input that products save for their backward keeps
/// only its bf16 copy (the norm's output, which has no f32 values at all: holding it holds
/// nothing more). The gradients are the same bits as with every `Var` held.
#[test]
fn a_graph_frees_the_values_its_backward_does_not_read() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let (rows, d_in, d_out) = (64, 256, 128);
    let (x, norm_w, w) =
        (rand(&[rows, d_in], -1.0, 1.0, 51), rand(&[d_in], 0.5, 1.5, 52), rand(&[d_out, d_in], -1.0, 1.0, 53));
    // The gradients of `sum(rms_norm(x)·Wᵀ)`, and the bytes in use with the graph built.
    let run = |hold: bool| -> (Vec<Vec<f32>>, usize) {
        let params = [&x, &norm_w, &w].map(|t| Var::parameter(gpu(t)));
        let [x, norm_w, w] = &params;
        let normed = x.rms_norm(norm_w, 1e-5).unwrap();
        let y = normed.matmul(&w.transpose(0, 1).unwrap()).unwrap();
        let loss = y.sum_all().unwrap();
        let held = hold.then_some((normed, y));
        let in_use = dev.allocator_stats().in_use_bytes;
        loss.backward().unwrap();
        drop(held);
        (params.iter().map(|p| p.grad().unwrap().to_host().unwrap().to_vec()).collect(), in_use)
    };
    let (held_grads, held_bytes) = run(true);
    let (grads, bytes) = run(false);
    assert_eq!(grads, held_grads, "the gradients do not depend on what the graph keeps");
    let freed = rows * d_out * 4;
    assert_eq!(held_bytes, bytes + freed, "bytes in use with the values held, and without plus y's f32");
}

/// Under bf16 products a weight is converted once however many products read it, and an
/// in-place write (the optimizer's) makes the next product convert the new values.
#[test]
fn a_bf16_copy_is_shared_by_products_and_forgotten_after_a_write() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let conversions = |since: &kernels::cuda::DeviceCounters| {
        dev.counters().since(since).launches_by_kernel.get("f32_to_bf16_kernel").copied().unwrap_or(0)
    };
    let (x, w) = (gpu(&rand(&[8, 16], 0.5, 1.5, 31)), rand(&[4, 16], 0.5, 1.5, 32));
    let mut w_gpu = gpu(&w);
    let before = dev.counters();
    let first = x.matmul(&w_gpu.transpose(0, 1).unwrap()).unwrap();
    let second = x.matmul(&w_gpu.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(conversions(&before), 2, "x and W once each, for both products");
    assert_eq!(first.to_host().unwrap().to_vec(), second.to_host().unwrap().to_vec());

    // Write W in place (as AdamW does): the next product must read the new values.
    let (dev_w, buffer) = w_gpu.cuda_f32_mut("test").unwrap();
    kernels::cuda::elementwise::fill(&dev_w, 2.0, buffer).unwrap();
    let before = dev.counters();
    let after_write = x.matmul(&w_gpu.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(conversions(&before), 1, "only W is converted again");
    let want = x.to_host().unwrap().matmul(&Tensor::full(&[16, 4], 2.0)).unwrap();
    assert_close(&after_write, &want, BF16_REL, 0.0, "product after the write");
}

/// Under bf16 products the packed QKV attention's backward is the tensor-core attention
/// kernels alone: they write the packed product's gradient `[Rᵀ dq | Rᵀ dk | dv]` themselves
/// (no RoPE launch), within bf16 precision of the CPU's f32 gradient (1e-2 of the largest
/// value, as the attention kernels' own test; a wrong rotation is off by O(1)).
#[test]
fn packed_rotary_attention_backward_is_two_launches_under_bf16() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let (batch, seq, heads, head_dim) = (2, 70, 2, 16);
    let qkv = rand(&[batch, seq, 3 * heads * head_dim], -1.5, 1.5, 81);
    let dy = rand(&[batch, seq, heads, head_dim], -1.0, 1.0, 82);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let gradient = |device: Device| {
        let x = Var::parameter(qkv.to_device(device).unwrap());
        let y = Var::rotary_causal_attention_packed(&x, heads, scale, 10_000.0).unwrap();
        let before = dev.counters();
        y.backward_with(dy.to_device(device).unwrap()).unwrap();
        (x.grad().unwrap(), dev.counters().since(&before).launches_by_kernel)
    };
    let (want, _) = gradient(Device::Cpu);
    let (got, launches) = gradient(GPU);
    let largest = want.to_vec().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert_close(&got, &want, 1e-2, 1e-2 * largest, "packed rotary attention dqkv");
    assert!(!launches.contains_key("rope_rotate"), "RoPE's backward ran on its own: {launches:?}");
    let attention = launches.iter().filter(|(name, _)| name.starts_with("attention_mma_backward"));
    assert_eq!(attention.map(|(_, n)| n).sum::<u64>(), 2, "{launches:?}");
}

/// Under bf16 products, the ops whose results bf16 products read write those results' bf16
/// copies themselves (RMSNorm, forward and backward; SwiGLU forward and backward; attention's
/// output and dv; the RoPE backward; the sum of two gradients): the products convert only the weight, and equal the products of fresh
/// copies of the same values (converted by the conversion kernel) bit for bit.
#[test]
fn results_that_products_read_come_with_their_bf16_copies() {
    if no_gpu() {
        return;
    }
    let _precision = Precision::set(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let input = |seed: u64| gpu(&rand(&[6, 16], -1.0, 1.0, seed));
    let (x, norm_w, w) = (input(41), gpu(&rand(&[16], 0.5, 1.5, 42)), rand(&[5, 16], -1.0, 1.0, 43));
    let (gate, up, dy) = (input(44), input(45), input(46));
    let w_gpu = gpu(&w);
    let wt = w_gpu.transpose(0, 1).unwrap();
    // W's copy first, so that only the results' copies are in question below.
    x.matmul(&wt).unwrap();
    let norm = x.rms_norm(&norm_w, 1e-5).unwrap();
    let normed = norm.y;
    // The final norm's dx (no residual gradient to add): the last block's output gradient.
    let (dnorm, _) = Tensor::rms_norm_backward(&x, &norm_w, &norm.rstd, &dy, None).unwrap();
    let gated = gate.swiglu(&up).unwrap();
    let (dgate, dup) = Tensor::swiglu_backward(&gate, &up, &dy).unwrap();
    // [B 1, T 6, H 2, D 8]: one batch of six tokens, viewed back as [6, 16] for the product.
    let heads = |t: &Tensor| t.reshape(&[1, 6, 2, 8]).unwrap();
    let (out, lse) = Tensor::causal_attention(&heads(&x), &heads(&gate), &heads(&up), 0.35).unwrap();
    let (_, _, dv) =
        Tensor::causal_attention_backward(&heads(&x), &heads(&gate), &heads(&up), &out, &lse, &heads(&dy), 0.35)
            .unwrap();
    let drope = heads(&dy).rope_backward(10_000.0, 0).unwrap();
    // The autograd engine's in-place sum of two gradients.
    let summed = dy.deep_copy().unwrap().accumulate(gate.clone()).unwrap();
    let results = [
        ("rms_norm y", normed),
        ("rms_norm dx", dnorm),
        ("swiglu y", gated),
        ("swiglu dgate", dgate),
        ("swiglu dup", dup),
        ("attention out", out),
        ("attention dv", dv),
        ("rope dx", drope),
        ("gradient sum", summed),
    ];
    for (what, result) in results {
        let result = result.reshape(&[6, 16]).unwrap();
        let before = dev.counters();
        let product = result.matmul(&wt).unwrap();
        let conversions = dev.counters().since(&before).launches_by_kernel.get("f32_to_bf16_kernel").copied();
        assert_eq!(conversions, None, "{what}: the product converted an operand");
        let fresh = result.deep_copy().unwrap().matmul(&wt).unwrap();
        assert_eq!(product.to_host().unwrap().to_vec(), fresh.to_host().unwrap().to_vec(), "{what}: copy differs");
    }
}

#[test]
fn cat_agrees() {
    if no_gpu() {
        return;
    }
    let _serial = device_lock();
    let (a, b) = (rand(&[2, 3, 4], -1.0, 1.0, 29), rand(&[2, 3, 4], -1.0, 1.0, 30));
    for axis in 0..3 {
        let mut shape_c = vec![2, 3, 4];
        shape_c[axis] = 5;
        let c = rand(&shape_c, -1.0, 1.0, 31 + axis as u64);
        let want = Tensor::cat(&[&a, &c, &b], axis).unwrap();
        let got = Tensor::cat(&[&gpu(&a), &gpu(&c), &gpu(&b)], axis).unwrap();
        assert_f32_close(&got, &want, &format!("cat axis {axis}"));
    }
    // Strided parts (a transposed view, a narrowed one) and a bf16 part.
    let (t, n) = (rand(&[4, 3, 2], -1.0, 1.0, 34), rand(&[2, 3, 9], -1.0, 1.0, 35));
    let h = rand(&[2, 3, 1], -1.0, 1.0, 36).to_dtype(DType::BF16).unwrap();
    let want = Tensor::cat(&[&t.transpose(0, 2).unwrap(), &n.narrow(2, 3, 4).unwrap(), &h], 2).unwrap();
    let (gt, gn) = (gpu(&t).transpose(0, 2).unwrap(), gpu(&n).narrow(2, 3, 4).unwrap());
    assert_f32_close(&Tensor::cat(&[&gt, &gn, &gpu(&h)], 2).unwrap(), &want, "cat of views");
}

/// Runs `loss` on CPU copies and GPU copies of `inputs` (as parameters) and compares the
/// loss and every input's gradient.
fn assert_graph_agrees(inputs: &[Tensor], loss: impl Fn(&[Var]) -> tensor::Result<Var>, what: &str) {
    let run = |device: Device| {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::parameter(t.to_device(device).unwrap())).collect();
        let l = loss(&vars).unwrap();
        l.backward().unwrap();
        let grads: Vec<Tensor> = vars.iter().map(|v| v.grad().expect("every input gets a gradient")).collect();
        (l.value(), grads)
    };
    let (want_loss, want_grads) = run(Device::Cpu);
    let (got_loss, got_grads) = run(GPU);
    assert_f32_close(&got_loss, &want_loss, &format!("{what}: loss"));
    for (i, (got, want)) in got_grads.iter().zip(&want_grads).enumerate() {
        assert_f32_close(got, want, &format!("{what}: gradient of input {i}"));
    }
}

#[test]
fn linear_sigmoid_graph_agrees() {
    if no_gpu() {
        return;
    }
    let _lock = device_lock();
    let inputs = [rand(&[4, 6], -1.0, 1.0, 37), rand(&[6, 3], -1.0, 1.0, 38), rand(&[3], -1.0, 1.0, 39)];
    assert_graph_agrees(&inputs, |v| v[0].matmul(&v[1])?.add(&v[2])?.sigmoid()?.sum_all(), "(x·W + b).sigmoid().sum()");
}

/// One input read by three projections and a residual add (a pre-ln block's q, k and v): its
/// gradient is summed by the projections' backward GEMMs (`Var::matmul` takes over the sum so
/// far), and a projection of a batched input whose batch dims broadcast sums back apart.
#[test]
fn an_input_read_by_several_products_graph_agrees() {
    if no_gpu() {
        return;
    }
    let _lock = device_lock();
    let weight = |seed: u64| rand(&[5, 6], -1.0, 1.0, seed);
    let inputs = [rand(&[4, 6], -1.0, 1.0, 51), weight(52), weight(53), weight(54), rand(&[2, 6, 3], -1.0, 1.0, 55)];
    let loss = |v: &[Var]| {
        let project = |w: &Var| v[0].matmul(&w.transpose(0, 1)?)?.sigmoid();
        let (q, k, vv) = (project(&v[1])?, project(&v[2])?, project(&v[3])?);
        let batched = v[0].matmul(&v[4])?.tanh()?.sum_all()?;
        q.mul(&k)?.add(&vv)?.sum_all()?.add(&batched)?.add(&v[0].mul(&v[0])?.sum_all()?)
    };
    assert_graph_agrees(&inputs, loss, "x read by three projections, a broadcast product and a square");
}

#[test]
fn view_reduce_select_graph_agrees() {
    if no_gpu() {
        return;
    }
    let _lock = device_lock();
    // Random values: maximum meets no ties; ties of max_axis (between filled 0.25s) go to
    // the first on both devices.
    let (x, z) = (rand(&[4, 6], -1.0, 1.0, 40), rand(&[5], -1.0, 1.0, 41));
    let mask = rand(&[4, 5], -1.0, 1.0, 42).scalar_op(Binary::Mul, 1e6).unwrap().unary(Unary::Relu).unwrap();
    let loss = |v: &[Var]| {
        let (x, z) = (&v[0], &v[1]);
        let parts = Var::cat(&[&x.narrow(1, 1, 3)?, &x.transpose(0, 1)?.narrow(0, 0, 2)?.transpose(0, 1)?], 1)?;
        let m = parts.maximum(z)?.masked_fill(&mask.to_device(x.value_ref().device())?, 0.25)?;
        let rows = m.max_axis(1, false)?.sum_all()?;
        let cols = m.mean_axis(0, true)?.mul(&m)?.sub(&m.sum_axis(1, true)?)?.mean_all()?;
        rows.add(&cols)
    };
    assert_graph_agrees(&[x, z], loss, "cat/narrow/maximum/masked_fill/max/mean");
}

/// The LM head's fused loss on the GPU against the CPU, in f32 and under bf16 products, in one
/// chunk and in several (37 rows by at most 8: 8, 8, 8, 8, 5), some rows ignored, with an
/// upstream gradient of 0.5 read on the device: the loss and both gradients agree, each
/// chunk is one launch of the fused cross-entropy kernel, and nothing is copied from the host
/// (the kernel reads the targets from their `Tokens`, uploaded before). (That nothing waits
/// for the device is held for the whole step by `trainer/tests/cuda_budgets.rs`.)
#[test]
fn linear_cross_entropy_agrees_in_f32_and_bf16() {
    if no_gpu() {
        return;
    }
    let (rows, width, vocab) = (37, 24, 300);
    let (h, w) = (rand(&[rows, width], -2.0, 2.0, 50), rand(&[vocab, width], -1.0, 1.0, 51));
    let mut targets: Vec<u32> = (0..rows).map(|r| (r * 7919 % vocab) as u32).collect();
    targets.iter_mut().step_by(5).for_each(|t| *t = 7);
    let dev = tensor::cuda::device(0).unwrap();
    // The loss and gradients on `device`, and what the device counted meanwhile (the inputs
    // are on it before).
    let run = |device: Device, chunk: Option<usize>| {
        let (hv, wv) = (Var::parameter(h.to_device(device).unwrap()), Var::parameter(w.to_device(device).unwrap()));
        let (targets, upstream) = (token_ids(&targets, device), Tensor::full_on(&[], 0.5, device).unwrap());
        let before = dev.counters();
        let loss = hv.linear_cross_entropy(&wv, &targets, Some(7), chunk).unwrap();
        loss.backward_with(upstream).unwrap();
        let counted = dev.counters().since(&before);
        ([loss.value(), hv.grad().unwrap(), wv.grad().unwrap()], counted)
    };
    for (precision, rel, abs) in [(MatmulPrecision::F32, F32_REL, F32_ABS), (MatmulPrecision::Bf16, BF16_REL, 1e-3)] {
        let _precision = Precision::set(precision);
        for chunk in [None, Some(8)] {
            let (want, _) = run(Device::Cpu, chunk);
            let (got, counted) = run(GPU, chunk);
            let what = format!("{precision:?}, chunk {chunk:?}");
            assert_eq!(counted.host_to_device_copies, 0, "{what}: the loss copied from the host");
            // Under bf16 products the logits are a bf16 product's output: the bf16 kernel reads them.
            let kernel = match precision {
                MatmulPrecision::F32 => "cross_entropy_forward_backward",
                MatmulPrecision::Bf16 => "cross_entropy_forward_backward_bf16",
            };
            let chunks = counted.launches_by_kernel.get(kernel).copied();
            assert_eq!(chunks, Some(if chunk.is_some() { 5 } else { 1 }), "{what}: launches of the fused kernel");
            for (name, (got, want)) in ["loss", "dh", "dW"].iter().zip(got.iter().zip(&want)) {
                assert_close(got, want, rel, abs, &format!("{what}: {name}"));
            }
        }
    }
}
