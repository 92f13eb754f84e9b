//! The optimizers on a GPU agree with the CPU: AdamW, Adam and SGD (momentum, Nesterov)
//! take three steps from the same parameters and gradients on both devices; parameters and
//! state must match to f32 rounding (1e-5 relative / 1e-6 absolute, one fused kernel per
//! tensor with the same per-step constants). Also gradient clipping, the step guard, state saved on the GPU
//! and loaded into a fresh optimizer, and `Module::to_device`. Skips without a GPU.
#![cfg(feature = "cuda")]

use std::sync::{Mutex, MutexGuard};

use autograd::Var;
use gradcheck::Tolerance;
use nn::layers::Linear;
use nn::optim::{clip_grad_norm, Adam, AdamConfig, Optimizer, Sgd};
use nn::{Module, NamedParameter};
use tensor::cuda::{set_matmul_precision, MatmulPrecision};
use tensor::{Device, Rng, Tensor};

const GPU: Device = Device::Cuda(0);
const RTOL: f32 = 1e-5;
const ATOL: f32 = 1e-6;

fn no_gpu() -> bool {
    if tensor::cuda::is_available() {
        return false;
    }
    assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no CUDA device");
    eprintln!("skipping: no CUDA device");
    true
}

/// Serialises the tests: some read the device's counters, which count every test's work on
/// the device (a deep copy of another test, counted in a window of this one's, was a copy
/// it never made), and one sets the process-wide matmul precision.
fn device_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A matrix (decayed by Adam) of an odd size and a vector (not decayed), on `device`.
fn parameters(device: Device) -> Vec<NamedParameter> {
    let mut rng = Rng::new(7);
    [("weight", vec![37, 19]), ("bias", vec![19])]
        .into_iter()
        .map(|(name, shape)| {
            let value = Tensor::rand_normal(&shape, 0.0, 1.0, &mut rng).to_device(device).unwrap();
            NamedParameter { name: name.into(), var: Var::parameter(value) }
        })
        .collect()
}

/// Gives every parameter the gradient of step `step` (the same values on both devices).
fn set_gradients(params: &[NamedParameter], step: u64) {
    let mut rng = Rng::new(100 + step);
    for p in params {
        let device = p.var.value_ref().device();
        let grad = Tensor::rand_normal(&p.var.shape(), 0.0, 0.5, &mut rng).to_device(device).unwrap();
        p.var.set_grad(Some(grad));
    }
}

fn assert_close(what: &str, cpu: &Tensor, gpu: &Tensor) {
    assert_eq!(gpu.device(), GPU, "{what} left the GPU");
    let tolerance = Tolerance { atol: f64::from(ATOL), rtol: f64::from(RTOL) };
    gradcheck::assert_close(what, &gpu.to_host().unwrap().to_vec(), &cpu.to_vec(), tolerance);
}

/// Runs three steps of the optimizer `make` builds on both devices and compares.
fn agree(name: &str, make: impl Fn(Vec<NamedParameter>) -> Box<dyn Optimizer>) {
    let (cpu_params, gpu_params) = (parameters(Device::Cpu), parameters(GPU));
    let (mut cpu, mut gpu) = (make(cpu_params.clone()), make(gpu_params.clone()));
    for step in 1..=3 {
        let lr = 0.01 * step as f32;
        for (params, optimizer) in [(&cpu_params, &mut cpu), (&gpu_params, &mut gpu)] {
            set_gradients(params, step);
            optimizer.step(lr).unwrap();
            optimizer.zero_grad();
        }
    }
    for (c, g) in cpu_params.iter().zip(&gpu_params) {
        assert_close(&format!("{name} {}", c.name), &c.var.value(), &g.var.value());
    }
    for ((entry, c), (_, g)) in cpu.state().iter().zip(gpu.state()) {
        if c.numel() > 1 {
            assert_close(&format!("{name} state {entry}"), c, &g);
        }
    }
}

#[test]
fn adamw_step_matches_the_cpu() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    agree("adamw", |p| Box::new(Adam::new(p, AdamConfig { weight_decay: 0.1, ..AdamConfig::default() })));
}

/// Gradients that are views of one buffer (a fused gated projection's packed weight gradient,
/// the data-parallel all-reduce's flat one) are read in place by the gradient norm and AdamW:
/// the same norm and update as dense ones, and no copy on the device.
#[test]
fn adamw_reads_gradients_that_are_rows_of_one_buffer_in_place() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let (cpu_params, gpu_params) = (parameters(Device::Cpu), parameters(GPU));
    let config = AdamConfig { weight_decay: 0.1, ..AdamConfig::default() };
    let (mut cpu, mut gpu) = (Adam::new(cpu_params.clone(), config), Adam::new(gpu_params.clone(), config));
    set_gradients(&cpu_params, 1);
    // The same values, side by side in one GPU buffer, each gradient a view of its run.
    let grads: Vec<Tensor> =
        cpu_params.iter().map(|p| p.var.grad().unwrap().reshape(&[p.var.value_ref().numel()]).unwrap()).collect();
    let flat = Tensor::cat(&grads.iter().collect::<Vec<_>>(), 0).unwrap().to_device(GPU).unwrap();
    let mut at = 0;
    for p in &gpu_params {
        let n = p.var.value_ref().numel();
        p.var.set_grad(Some(flat.narrow(0, at, n).unwrap().reshape(&p.var.shape()).unwrap()));
        at += n;
    }
    let dev = tensor::cuda::device(0).unwrap();
    let cpu_norm = clip_grad_norm(&cpu_params, f32::INFINITY).unwrap();
    cpu.step(0.01).unwrap();
    let before = dev.counters();
    let gpu_norm = clip_grad_norm(&gpu_params, f32::INFINITY).unwrap();
    gpu.step(0.01).unwrap();
    let counted = dev.counters().since(&before);
    assert!((cpu_norm - gpu_norm).abs() <= 1e-5 * cpu_norm, "norm: cpu {cpu_norm} vs cuda {gpu_norm}");
    // The tests of this binary run one at a time (`device_lock`): what is counted is this one's.
    let copies = counted.launches_by_kernel.get("copy_strided");
    assert_eq!(copies, None, "a gradient view was copied before the update: {counted:?}");
    assert_eq!(counted.device_copies, 0, "a gradient view was copied: {counted:?}");
    for (c, g) in cpu_params.iter().zip(&gpu_params) {
        assert_close(&format!("adamw from views, {}", c.name), &c.var.value(), &g.var.value());
    }
}

#[test]
fn adam_step_matches_the_cpu() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let config = AdamConfig { weight_decay: 0.1, decoupled: false, ..AdamConfig::default() };
    agree("adam", |p| Box::new(Adam::new(p, config)));
}

#[test]
fn sgd_step_matches_the_cpu() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    agree("sgd momentum", |p| Box::new(Sgd::new(p, 0.9, 0.01, false)));
    agree("sgd nesterov", |p| Box::new(Sgd::new(p, 0.9, 0.0, true)));
    agree("sgd plain", |p| Box::new(Sgd::new(p, 0.0, 0.0, false)));
}

#[test]
fn clipping_matches_the_cpu() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let (cpu, gpu) = (parameters(Device::Cpu), parameters(GPU));
    set_gradients(&cpu, 1);
    set_gradients(&gpu, 1);
    let (cpu_norm, gpu_norm) = (clip_grad_norm(&cpu, 0.5).unwrap(), clip_grad_norm(&gpu, 0.5).unwrap());
    assert!((cpu_norm - gpu_norm).abs() <= 1e-5 * cpu_norm, "norm: cpu {cpu_norm} vs cuda {gpu_norm}");
    assert!(cpu_norm > 0.5, "the gradients must be large enough to clip");
    for (c, g) in cpu.iter().zip(&gpu) {
        assert_close(&format!("clipped {}", c.name), &c.var.grad().unwrap(), &g.var.grad().unwrap());
    }
}

#[test]
fn state_saved_on_the_gpu_loads_into_a_fresh_optimizer() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let config = AdamConfig::default();
    let (first, second) = (parameters(GPU), parameters(GPU));
    let (mut a, mut b) = (Adam::new(first.clone(), config), Adam::new(second.clone(), config));
    set_gradients(&first, 1);
    a.step(0.01).unwrap();
    // `second` takes the same first step through saved state: weights from `first`, moments loaded.
    for (s, f) in second.iter().zip(&first) {
        s.var.set_value(f.var.value().deep_copy().unwrap()).unwrap();
    }
    let saved: Vec<(String, Tensor)> = a.state().into_iter().map(|(n, t)| (n, t.to_host().unwrap())).collect();
    b.load_state(&saved).unwrap();
    set_gradients(&first, 2);
    set_gradients(&second, 2);
    a.step(0.01).unwrap();
    b.step(0.01).unwrap();
    for (f, s) in first.iter().zip(&second) {
        let (x, y) = (f.var.value().to_host().unwrap().to_vec(), s.var.value().to_host().unwrap().to_vec());
        assert_eq!(x, y, "{}: a resumed optimizer must repeat the step exactly", f.name);
    }
}

#[test]
fn module_to_device_moves_every_parameter_and_back() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let layer = Linear::new(5, 3, true, &mut Rng::new(1));
    let before: Vec<Vec<f32>> = layer.named_parameters().iter().map(|p| p.var.value().to_vec()).collect();
    layer.to_device(GPU).unwrap();
    assert_eq!(layer.device(), GPU);
    assert!(layer.named_parameters().iter().all(|p| p.var.value_ref().device() == GPU));
    layer.to_device(Device::Cpu).unwrap();
    let after: Vec<Vec<f32>> = layer.named_parameters().iter().map(|p| p.var.value().to_vec()).collect();
    assert_eq!(before, after, "a round trip must not change a value");
}

/// Under bf16 products, an AdamW step writes the bf16 copy of a weight the products read
/// beside its new f32 value: the next product converts nothing, and it equals the product
/// of a fresh copy of the updated weight (converted by the conversion kernel) bit for bit.
#[test]
fn adamw_rewrites_the_bf16_copy_that_bf16_products_read() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    // Process-wide: the other tests of this binary wait (`device_lock`).
    set_matmul_precision(MatmulPrecision::Bf16);
    let dev = tensor::cuda::device(0).unwrap();
    let params = parameters(GPU);
    let x = Tensor::rand_normal(&[4, 19], 0.0, 1.0, &mut Rng::new(3)).to_device(GPU).unwrap();
    let product = |w: &Tensor| x.matmul(&w.transpose(0, 1).unwrap()).unwrap().to_host().unwrap().to_vec();
    product(&params[0].var.value());
    let mut adam = Adam::new(params.clone(), AdamConfig::default());
    set_gradients(&params, 1);
    adam.step(0.01).unwrap();
    let before = dev.counters();
    let after_step = product(&params[0].var.value());
    let conversions = dev.counters().since(&before).launches_by_kernel.get("f32_to_bf16_kernel").copied();
    let fresh = product(&params[0].var.value().deep_copy().unwrap());
    set_matmul_precision(MatmulPrecision::F32);
    assert_eq!(conversions, None, "x keeps its copy and the step wrote W's");
    assert_eq!(after_step, fresh, "the step's copy is the updated weight rounded to bf16");
}

/// Adam under a step guard made on the GPU equals, on the GPU, clipping with
/// `clip_grad_norm` and then stepping (bit for bit: the same norm, the same scaled
/// gradients), and a guard over a non-finite gradient leaves the parameters untouched.
#[test]
fn a_guarded_adam_step_on_the_gpu_clips_on_the_device_and_skips_a_non_finite_step() {
    if no_gpu() {
        return;
    }
    let _device = device_lock();
    let loss_sum = Tensor::from_vec(vec![6.0], &[1]).unwrap().to_device(GPU).unwrap();
    for max_norm in [0.5, f32::INFINITY] {
        let (host_params, device_params) = (parameters(GPU), parameters(GPU));
        let config = AdamConfig { weight_decay: 0.1, decoupled: true, ..AdamConfig::default() };
        let (mut host, mut device) = (Adam::new(host_params.clone(), config), Adam::new(device_params.clone(), config));
        set_gradients(&host_params, 1);
        set_gradients(&device_params, 1);
        let norm = clip_grad_norm(&host_params, max_norm).unwrap();
        host.step(1e-2).unwrap();
        let guard = nn::optim::step_guard(&device_params, &loss_sum, 3.0, max_norm, None).unwrap();
        assert_eq!(guard.tensor().device(), GPU, "the guard is made where the gradients are");
        device.step_guarded(1e-2, &guard).unwrap();
        let values = guard.read().unwrap();
        assert_eq!((values.update, values.grad_norm, values.loss), (true, norm, 2.0));
        for (h, d) in host_params.iter().zip(&device_params) {
            let (h, d) = (h.var.value().to_host().unwrap().to_vec(), d.var.value().to_host().unwrap().to_vec());
            assert_eq!(h, d, "max_norm {max_norm}: the guarded update is clipping then stepping");
        }
    }
    let params = parameters(GPU);
    let before: Vec<Vec<f32>> = params.iter().map(|p| p.var.value().to_host().unwrap().to_vec()).collect();
    let mut adam = Adam::new(params.clone(), AdamConfig::default());
    set_gradients(&params, 1);
    let mut bad = params[1].var.grad().unwrap().to_host().unwrap().to_vec();
    bad[3] = f32::NAN;
    params[1].var.set_grad(Some(Tensor::from_vec(bad, &[19]).unwrap().to_device(GPU).unwrap()));
    let guard = nn::optim::step_guard(&params, &loss_sum, 3.0, 1.0, None).unwrap();
    adam.step_guarded(1e-2, &guard).unwrap();
    assert!(!guard.read().unwrap().update);
    let after: Vec<Vec<f32>> = params.iter().map(|p| p.var.value().to_host().unwrap().to_vec()).collect();
    assert_eq!(after, before, "a NaN gradient skips the update on the device");
    // The next step, finite, queued before the host read that verdict: skipped too.
    set_gradients(&params, 2);
    let next = nn::optim::step_guard(&params, &loss_sum, 3.0, 1.0, Some(&guard)).unwrap();
    adam.step_guarded(1e-2, &next).unwrap();
    let values = next.read().unwrap();
    assert_eq!((values.update, values.loss), (false, 2.0), "a step after a skipped one is skipped");
    let after: Vec<Vec<f32>> = params.iter().map(|p| p.var.value().to_host().unwrap().to_vec()).collect();
    assert_eq!(after, before, "the weights stay at the last good step");
}
