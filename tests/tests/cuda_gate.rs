//! CPU-vs-CUDA agreement through autograd of the fused gated projection (Transponder eq.
//! 8-10), SwiGLU, conv2d, batch norm and the pools: the same random inputs run on the CPU
//! and on GPU 0, forward and backward (every gradient), and the results are compared. Also:
//! the fused projection's packed bf16 weight stays current through optimizer steps and
//! other writes of its weights. Skips, saying so, without a GPU. Run with `cargo test
//! --release -p transponder-tests --features cuda --test cuda_gate`.
//!
//! Tolerance: `|gpu − cpu| ≤ rel·(|cpu| + max|cpu|)` per element. f32 ops 1e-4 (summation
//! order differs); the fused projection 2e-2, as its GEMM reads bf16 on the GPU.
#![cfg(feature = "cuda")]

use std::sync::{Mutex, MutexGuard};

use autograd::ops::GatedProjectionVars;
use autograd::Var;
use gradcheck::Tolerance;
use nn::optim::{Adam, AdamConfig, Optimizer, Sgd};
use nn::NamedParameter;
use tensor::ops::{ProductOutput, Unary};
use tensor::{DType, Device, Error, Rng, Tensor};
use transponder_tests::{gpu, no_gpu, GPU};

/// f32 kernels whose sums run in another order on the GPU.
const F32_REL: f32 = 1e-4;
/// Anything that reads bf16 on the GPU.
const BF16_REL: f32 = 2e-2;

/// Asserts that `got` is on the GPU and agrees with the CPU's `want` (see the module doc).
fn assert_close(what: &str, got: &Tensor, want: &Tensor, rel: f32) {
    assert_eq!(got.device(), GPU, "{what}: the result left the GPU");
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let (got, want) = (got.to_host().unwrap().to_vec(), want.to_vec());
    // `rel·(|want| + scale)`, scale the largest |want|, in the toolkit's comparison.
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tolerance = Tolerance { atol: f64::from(rel * scale), rtol: f64::from(rel) };
    gradcheck::assert_close(what, &got, &want, tolerance);
}

/// Leaves on the CPU and their copies on the GPU: `(cpu, gpu)`.
fn parameters(values: &[Tensor]) -> (Vec<Var>, Vec<Var>) {
    let cpu = values.iter().cloned().map(Var::parameter).collect();
    let gpu = values.iter().map(|t| Var::parameter(gpu(t))).collect();
    (cpu, gpu)
}

/// Runs `op` on both devices, back-propagates the same random seed, and compares the output
/// and the gradient of every leaf of `values`.
fn check(what: &str, values: &[Tensor], rel: f32, op: impl Fn(&[Var]) -> autograd::Result<Var>) {
    let (cpu, gpu_vars) = parameters(values);
    let (y_cpu, y_gpu) = (op(&cpu).unwrap(), op(&gpu_vars).unwrap());
    assert_close(&format!("{what} forward"), &y_gpu.value(), &y_cpu.value(), rel);
    let seed = Tensor::rand_normal(&y_cpu.shape(), 0.0, 1.0, &mut Rng::new(99));
    y_cpu.backward_with(seed.clone()).unwrap();
    y_gpu.backward_with(gpu(&seed)).unwrap();
    for (i, (c, g)) in cpu.iter().zip(&gpu_vars).enumerate() {
        let (c, g) = (c.grad().expect("a CPU gradient"), g.grad().expect("a GPU gradient"));
        assert_close(&format!("{what} gradient of input {i}"), &g, &c, rel);
    }
}

/// Rounds to the nearest bf16 value, so that the GPU's bf16 GEMM reads exactly what the
/// CPU's f32 GEMM reads (the products are then exact on both, and only the summation order
/// differs; the tolerance stays at the bf16 level all the same).
fn bf16_exact(t: Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()
}

/// `[x, W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]` for one projection.
fn gate_inputs(rng: &mut Rng, rows: usize, d_in: usize, d_out: usize, rc: usize, rs: usize) -> Vec<Tensor> {
    let mut t = |shape: &[usize], scale: f32| bf16_exact(Tensor::rand_normal(shape, 0.0, scale, rng));
    vec![
        t(&[2, rows, d_in], 1.0),
        t(&[d_out, d_in], 0.3),
        t(&[rc, d_in], 0.3),
        t(&[rc], 0.3),
        t(&[d_out, rc], 0.5),
        t(&[d_out], 0.3),
        Tensor::from_vec(vec![1.25], &[1]).unwrap(),
        t(&[rs, d_in], 0.3),
        t(&[rs], 0.3),
        t(&[1, rs], 0.5),
        t(&[1], 0.3),
        Tensor::from_vec(vec![0.75], &[1]).unwrap(),
    ]
}

/// One projection's eleven parameters `[W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]`.
fn projection(p: &[Var]) -> GatedProjectionVars<'_> {
    GatedProjectionVars {
        weight: &p[0],
        channel: [&p[1], &p[2], &p[3], &p[4], &p[5]],
        scalar: [&p[6], &p[7], &p[8], &p[9], &p[10]],
    }
}

/// `[x, projection's parameters]` through the fused op.
fn fused_gate(v: &[Var], phi: Unary) -> autograd::Result<Var> {
    let p = projection(&v[1..12]);
    v[0].fused_gated_projection(p.weight, p.channel, p.scalar, phi)
}

/// Serialises the tests that run the fused projection on the GPU: one of them counts the
/// packing launches on the device all tests share.
fn fused_gate_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn fused_gated_projection_agrees_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let _serial = fused_gate_lock();
    let mut rng = Rng::new(1);
    // Row and column counts off the kernel's 128-tiles; d_in a multiple of 8 (vector
    // loads) and not (scalar loads); ranks padded to 16 and to 32.
    for (rows, d_in, d_out, rc, rs, phi) in
        [(37, 48, 40, 4, 2, Unary::Silu), (70, 20, 130, 16, 8, Unary::Sigmoid), (5, 64, 24, 2, 1, Unary::Relu)]
    {
        let values = gate_inputs(&mut rng, rows, d_in, d_out, rc, rs);
        let what = format!("fused gate {rows}x{d_in}->{d_out} r{rc}+{rs} {phi:?}");
        check(&what, &values, BF16_REL, |v| fused_gate(v, phi));
    }
}

/// q, k and v (or gate and up) as one fused group: on the GPU one gate launch forward and one
/// row kernel and one column-sum launch backward for the whole group, against the CPU's
/// projections one by one: outputs side by side, dx summed, every gradient. The `dB_c`s are
/// column sums of that launch (weighted by `H_c`), not products.
#[test]
fn a_group_of_fused_gated_projections_agrees_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let _serial = fused_gate_lock();
    let mut rng = Rng::new(3);
    let (rows, d_in, rc, rs) = (21, 32, 8, 4);
    // [x, then each projection's eleven parameters] for projections of these widths.
    let mut inputs = |widths: [usize; 3]| {
        let mut values = gate_inputs(&mut rng, rows, d_in, widths[0], rc, rs);
        for &d_out in &widths[1..] {
            values.extend(gate_inputs(&mut rng, rows, d_in, d_out, rc, rs).into_iter().skip(1));
        }
        values
    };
    let group = |v: &[Var]| {
        let projections: Vec<GatedProjectionVars> = v[1..].chunks(11).map(projection).collect();
        v[0].fused_gated_projections(&projections, Unary::Silu, ProductOutput::F32)
    };
    check("fused gate group of widths 32, 32, 32", &inputs([32, 32, 32]), BF16_REL, group);
    let values = inputs([24, 40, 16]);
    check("fused gate group of widths 24, 40, 16", &values, BF16_REL, group);
    let dev = tensor::cuda::device(0).unwrap();
    let vars: Vec<Var> = values.iter().map(|t| Var::parameter(gpu(t))).collect();
    group(&vars).unwrap();
    let before = dev.counters();
    let y = group(&vars).unwrap();
    // The device's counters see the other tests' launches too (those of this file that run
    // fused gate kernels hold the same lock), so only the fused gate's own kernels are counted.
    let forward = dev.counters().since(&before).launches_by_kernel;
    assert_eq!(forward.get("fused_gate_apply"), Some(&1), "one gate launch for the group: {forward:?}");
    let before = dev.counters();
    y.sum_all().unwrap().backward().unwrap();
    let backward = dev.counters().since(&before).launches_by_kernel;
    assert_eq!(backward.get("fused_gate_backward_rows"), Some(&1), "{backward:?}");
    assert_eq!(backward.get("column_sums_many"), Some(&1), "{backward:?}");
    assert_eq!(backward.get("cublasGemmStridedBatchedEx"), None, "{backward:?}");
}

/// On the GPU the projection's GEMM reads `[W; A_c; A_s]` packed in bf16, and that buffer is
/// the three weights' bf16 copy: AdamW's step rewrites their rows in place, every other write
/// (SGD, `set_value` as a checkpoint load does) forgets it. After each kind of write the
/// forward must equal, bit for bit, the forward of fresh copies of the parameters (which pack
/// anew), and only the other writes may cost a packing launch.
#[test]
fn the_packed_weight_follows_every_write_of_the_weights() {
    if no_gpu() {
        return;
    }
    let _serial = fused_gate_lock();
    let dev = tensor::cuda::device(0).unwrap();
    let values = gate_inputs(&mut Rng::new(10), 9, 24, 16, 4, 2);
    let mut vars: Vec<Var> = vec![Var::constant(gpu(&values[0]))];
    vars.extend(values[1..].iter().map(|t| Var::parameter(gpu(t))));
    let named = |indices: &[usize]| -> Vec<NamedParameter> {
        let name = |i: usize| format!("input {i}");
        indices.iter().map(|&i| NamedParameter { name: name(i), var: vars[i].clone() }).collect()
    };
    let mut adamw = Adam::new(named(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]), AdamConfig::default());
    let mut sgd_on_weight = Sgd::new(named(&[1]), 0.9, 0.0, false);
    let mut rng = Rng::new(11);
    let mut give_gradients = |optimizer: &dyn Optimizer| {
        for p in optimizer.parameters() {
            p.var.set_grad(Some(gpu(&Tensor::rand_normal(&p.var.shape(), 0.0, 1.0, &mut rng))));
        }
    };
    let output = |v: &[Var]| fused_gate(v, Unary::Silu).unwrap().value().to_host().unwrap().to_vec();
    // The forward's output and its packing launches, against the forward of fresh copies.
    let check = |what: &str, expected_packings: u64| {
        let before = dev.counters();
        let y = output(&vars);
        let counts = dev.counters().since(&before);
        let packings = counts.launches_by_kernel.get("f32_to_bf16_packed").copied().unwrap_or(0);
        let fresh: Vec<Var> = vars.iter().map(|v| Var::parameter(v.value().deep_copy().unwrap())).collect();
        let want = output(&fresh);
        let differing = y.iter().zip(&want).filter(|(got, want)| got.to_bits() != want.to_bits()).count();
        assert_eq!(differing, 0, "{what}: {differing} of {} outputs differ: a stale packed weight", y.len());
        assert_eq!(packings, expected_packings, "{what}: packing launches of the forward");
    };

    check("the first forward", 1);
    check("a second forward, no write between", 0);
    for step in 1..=2 {
        give_gradients(&adamw);
        adamw.step(1e-2).unwrap();
        check(&format!("after AdamW step {step}"), 0);
    }
    // An in-place write of W alone (copy-on-write access, as SGD's step): W's copy is dropped,
    // A_c and A_s keep theirs; the forward packs all three again, and AdamW keeps that.
    give_gradients(&sgd_on_weight);
    sgd_on_weight.step(1e-2).unwrap();
    check("after an SGD step of W", 1);
    give_gradients(&adamw);
    adamw.step(1e-2).unwrap();
    check("after SGD then AdamW", 0);
    // A new value for A_c (as loading a checkpoint does).
    let a_channel = Tensor::rand_normal(values[2].shape(), 0.0, 0.3, &mut Rng::new(12));
    vars[2].set_value(gpu(&a_channel)).unwrap();
    check("after set_value of A_c", 1);
    give_gradients(&adamw);
    adamw.step(1e-2).unwrap();
    check("after set_value then AdamW", 0);
}

#[test]
fn fused_gated_projection_rejects_mixed_devices() {
    if no_gpu() {
        return;
    }
    let values = gate_inputs(&mut Rng::new(2), 3, 8, 8, 2, 2);
    let mut vars: Vec<Var> = values.iter().map(|t| Var::parameter(gpu(t))).collect();
    vars[4] = Var::parameter(values[4].clone());
    let err = fused_gate(&vars, Unary::Silu).expect_err("a CPU parameter among GPU ones");
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
}

#[test]
fn swiglu_agrees_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(3);
    let values =
        [Tensor::rand_normal(&[3, 5, 67], 0.0, 3.0, &mut rng), Tensor::rand_normal(&[3, 5, 67], 0.0, 1.0, &mut rng)];
    check("swiglu", &values, F32_REL, |v| v[0].swiglu(&v[1]));
    // A transposed (strided) gate and up go through the same kernels after a dense copy.
    check("swiglu strided", &values, F32_REL, |v| v[0].transpose(0, 2)?.swiglu(&v[1].transpose(0, 2)?));
}

#[test]
fn conv2d_agrees_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(4);
    // (x shape, weight shape, stride, padding): 3×3 padded, strided, and a pointwise 1×1.
    let cases: [([usize; 4], [usize; 4], usize, usize); 3] =
        [([2, 3, 9, 9], [4, 3, 3, 3], 1, 1), ([2, 5, 11, 7], [6, 5, 3, 3], 2, 1), ([3, 16, 8, 8], [8, 16, 1, 1], 1, 0)];
    for (x_shape, w_shape, stride, padding) in cases {
        let values = [
            Tensor::rand_normal(&x_shape, 0.0, 1.0, &mut rng),
            Tensor::rand_normal(&w_shape, 0.0, 0.5, &mut rng),
            Tensor::rand_normal(&[w_shape[0]], 0.0, 0.5, &mut rng),
        ];
        let what = format!("conv2d {x_shape:?} * {w_shape:?} s{stride} p{padding}");
        check(&what, &values, F32_REL, |v| v[0].conv2d(&v[1], Some(&v[2]), stride, padding));
        check(&format!("{what} no bias"), &values[..2], F32_REL, |v| v[0].conv2d(&v[1], None, stride, padding));
    }
}

#[test]
fn conv2d_skips_the_input_gradient_of_a_constant_input() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(5);
    let x = Tensor::rand_normal(&[2, 3, 8, 8], 0.0, 1.0, &mut rng);
    let w = Tensor::rand_normal(&[4, 3, 3, 3], 0.0, 0.5, &mut rng);
    let seed = Tensor::rand_normal(&[2, 4, 8, 8], 0.0, 1.0, &mut rng);
    // Only the weight needs a gradient, as in a network's first convolution.
    let weight_grad = |device: Device| {
        let weight = Var::parameter(w.to_device(device).unwrap());
        let y = Var::constant(x.to_device(device).unwrap()).conv2d(&weight, None, 1, 1).unwrap();
        y.backward_with(seed.to_device(device).unwrap()).unwrap();
        weight.grad().expect("a weight gradient")
    };
    assert_close("conv2d dw (constant input)", &weight_grad(GPU), &weight_grad(Device::Cpu), F32_REL);
}

#[test]
fn batch_norm_agrees_in_training_and_evaluation() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(6);
    let (n, c, h, w) = (4, 5, 6, 7);
    let values = [
        Tensor::rand_normal(&[n, c, h, w], 0.5, 2.0, &mut rng),
        Tensor::rand_normal(&[c], 1.0, 0.3, &mut rng),
        Tensor::rand_normal(&[c], 0.0, 0.3, &mut rng),
    ];
    let running_mean = Tensor::rand_normal(&[c], 0.0, 0.5, &mut rng).to_vec();
    let running_var = Tensor::rand_uniform(&[c], 0.5, 2.0, &mut rng).to_vec();
    for training in [true, false] {
        // Running statistics per device, each its own buffer (updated in place, compared).
        let stat = |values: &[f32], device: Device| {
            Var::constant(Tensor::from_vec(values.to_vec(), &[c]).unwrap().to_device(device).unwrap())
        };
        let stats = |device: Device| (stat(&running_mean, device), stat(&running_var, device));
        let (cpu_stats, gpu_stats) = (stats(Device::Cpu), stats(GPU));
        let on_device = |v: &[Var]| if v[0].value().device() == GPU { &gpu_stats } else { &cpu_stats };
        let what = if training { "batch norm (training)" } else { "batch norm (evaluation)" };
        check(what, &values, F32_REL, |v| {
            let (rm, rv) = on_device(v);
            v[0].batch_norm2d(Some(&v[1]), Some(&v[2]), [rm, rv], training, 0.1, 1e-5)
        });
        assert_close(&format!("{what} running mean"), &gpu_stats.0.value(), &cpu_stats.0.value(), F32_REL);
        assert_close(&format!("{what} running var"), &gpu_stats.1.value(), &cpu_stats.1.value(), F32_REL);
        // Without the affine parameters.
        check(&format!("{what} without affine"), &values[..1], F32_REL, |v| {
            let (rm, rv) = on_device(v);
            v[0].batch_norm2d(None, None, [rm, rv], training, 0.1, 1e-5)
        });
    }
}

#[test]
fn max_pool_and_global_avg_pool_agree_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(7);
    let x = [Tensor::rand_normal(&[2, 3, 13, 11], 0.0, 1.0, &mut rng)];
    // The ResNet stem's 3×3/2 padded window, and disjoint 2×2 windows.
    for (kernel, stride, padding) in [(3, 2, 1), (2, 2, 0)] {
        let what = format!("max_pool2d k{kernel} s{stride} p{padding}");
        check(&what, &x, F32_REL, |v| v[0].max_pool2d(kernel, stride, padding));
    }
    check("global_avg_pool", &x, F32_REL, |v| v[0].global_avg_pool());
    // The winners' indices agree too.
    let (_, cpu) = x[0].max_pool2d(3, 2, 1).unwrap();
    let (_, gpu_indices) = gpu(&x[0]).max_pool2d(3, 2, 1).unwrap();
    assert_eq!(gpu_indices.device(), GPU);
    assert_eq!(gpu_indices.to_vec().unwrap(), cpu.to_vec().unwrap());
}

#[test]
fn sliding_window_modulated_conv_agrees_forward_and_backward() {
    if no_gpu() {
        return;
    }
    let mut rng = Rng::new(8);
    // conv(x) ⊙ 2σ(conv1x1(σ(conv_{3×3}(x)))) at a CoMT ResNet's shapes: batch 32, hidden 1.
    for (x_shape, out, stride) in [([32, 4, 8, 8], 4, 1), ([32, 8, 8, 8], 16, 2), ([4, 3, 5, 5], 2, 1)] {
        let c = x_shape[1];
        let values = [
            Tensor::rand_normal(&x_shape, 0.0, 1.0, &mut rng),
            Tensor::rand_normal(&[out, c, 3, 3], 0.0, 0.5, &mut rng),
            Tensor::rand_normal(&[1, c, 3, 3], 0.0, 0.5, &mut rng),
            Tensor::rand_normal(&[1], 0.0, 0.5, &mut rng),
            Tensor::rand_normal(&[1, 1, 1, 1], 0.0, 0.5, &mut rng),
            Tensor::rand_normal(&[1], 0.0, 0.5, &mut rng),
        ];
        let what = format!("sliding window {x_shape:?} -> {out} s{stride}");
        let window = [values[0].clone(), values[2].clone(), values[3].clone()];
        check(&format!("{what}: window conv"), &window, F32_REL, |v| v[0].conv2d(&v[1], Some(&v[2]), stride, 1));
        check(&format!("{what}: broadcast mul"), &values[..3], F32_REL, |v| {
            v[0].conv2d(&v[1], None, stride, 1)?.mul(&v[0].conv2d(&v[2], None, stride, 1)?)
        });
        check(&what, &values, F32_REL, |v| {
            let y = v[0].conv2d(&v[1], None, stride, 1)?;
            let hidden = v[0].conv2d(&v[2], Some(&v[3]), stride, 1)?.sigmoid()?;
            let m = hidden.conv2d(&v[4], Some(&v[5]), 1, 0)?.sigmoid()?.mul_scalar(2.0)?;
            y.mul(&m)
        });
    }
}
