//! A guarded Adam step captured as a CUDA graph (`kernels::cuda::graph`): each replay reads
//! the learning rate staged before it, and its step guard, rewritten in place, chains as the
//! eager guards do: a non-finite step is skipped on the device, and so is every step after
//! it, even a finite one, so the weights stay those of the last good step. Skips without a
//! GPU. (A file of its own: a capture refuses work from other threads on the device, which
//! the other tests of a binary would queue beside it.)
#![cfg(feature = "cuda")]

use autograd::Var;
use nn::optim::{Adam, AdamConfig, GraphGuard, Optimizer};
use nn::NamedParameter;
use tensor::{Device, Rng, Tensor};

const GPU: Device = Device::Cuda(0);

/// The parameters' values on the host.
fn values(params: &[NamedParameter]) -> Vec<Vec<f32>> {
    params.iter().map(|p| p.var.value().to_host().unwrap().to_vec()).collect()
}

/// Writes `value` into the one-element GPU tensor `loss` in place (its address unchanged).
fn set_loss(loss: &mut Tensor, value: f32) {
    let (dev, buffer) = loss.cuda_f32_mut("set_loss").unwrap();
    dev.copy_to_device(&[value], buffer).unwrap();
}

#[test]
fn a_replayed_guarded_step_reads_its_staged_constants_and_chains_its_guard_in_place() {
    if !tensor::cuda::is_available() {
        assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no GPU");
        eprintln!("skipping: no CUDA device");
        return;
    }
    let mut rng = Rng::new(3);
    let params: Vec<NamedParameter> = [("weight", vec![24, 8]), ("bias", vec![8])]
        .into_iter()
        .map(|(name, shape)| {
            let value = Tensor::rand_normal(&shape, 0.0, 1.0, &mut rng).to_device(GPU).unwrap();
            let var = Var::parameter(value);
            var.set_grad(Some(Tensor::rand_normal(&shape, 0.0, 1.0, &mut rng).to_device(GPU).unwrap()));
            NamedParameter { name: name.into(), var }
        })
        .collect();
    let config = AdamConfig { weight_decay: 0.1, ..AdamConfig::default() };
    // The same steps eagerly, as the reference: lr 1e-2, then 3e-2.
    let twins: Vec<NamedParameter> = params
        .iter()
        .map(|p| {
            let var = Var::parameter(p.var.value().deep_copy().unwrap());
            var.set_grad(p.var.grad());
            NamedParameter { name: p.name.clone(), var }
        })
        .collect();
    let mut eager = Adam::new(twins.clone(), config);
    let mut adam = Adam::new(params.clone(), config);
    let mut loss = Tensor::from_vec(vec![2.0], &[1]).unwrap().to_device(GPU).unwrap();
    let mut guard = GraphGuard::after(None, GPU).unwrap();
    let dev = tensor::cuda::device(0).unwrap();
    let pool = dev.graph_pool();

    // Step 1 eagerly (the moments are made), step 2 in the pool, then the capture.
    for lr in [1e-2, 1e-2] {
        eager.step(lr).unwrap();
    }
    let step = |adam: &mut Adam, guard: &mut GraphGuard, loss: &Tensor| -> tensor::Result<()> {
        let verdict = guard.update(&params, loss, 1.0, f32::INFINITY)?;
        adam.apply_staged(Some(&verdict))
    };
    adam.stage(1e-2).unwrap();
    step(&mut adam, &mut guard, &loss).unwrap();
    adam.stage(1e-2).unwrap();
    dev.with_graph_pool(&pool, || step(&mut adam, &mut guard, &loss)).unwrap();
    let (graph, ()) = dev.capture(pool, || step(&mut adam, &mut guard, &loss)).unwrap();
    assert_eq!(values(&params), values(&twins), "two eager steps alike");

    // Two replays at another learning rate: the eager optimizer's steps, bit for bit.
    for _ in 0..2 {
        adam.stage(3e-2).unwrap();
        dev.replay(&graph).unwrap();
        eager.step(3e-2).unwrap();
        let verdict = guard.queue_read().unwrap().read().unwrap();
        assert_eq!((verdict.update, verdict.loss), (true, 2.0));
        assert_eq!(values(&params), values(&twins), "a replay updates as the eager step at its staged lr");
    }
    let good = values(&params);
    // A non-finite loss: skipped; then a finite one after it: skipped too.
    for (loss_value, what) in [(f32::NAN, "the non-finite step"), (2.0, "the finite step after it")] {
        set_loss(&mut loss, loss_value);
        adam.stage(3e-2).unwrap();
        dev.replay(&graph).unwrap();
        let verdict = guard.queue_read().unwrap().read().unwrap();
        assert!(!verdict.update, "{what} is skipped on the device");
        assert_eq!(values(&params), good, "{what} leaves the weights of the last good step");
    }
}
