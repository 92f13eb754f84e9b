//! Gradient checks of whole modules, shared by the `nn` test files: every parameter and
//! the input are probed with central differences against the analytic gradient.

use autograd::{no_grad, Result, Var, F32_TOLERANCE};
use nn::Module;
use tensor::{Rng, Tensor};

/// Overwrites every parameter with N(0, scale²) values (so zero-initialised biases matter).
pub fn randomise(module: &dyn Module, scale: f32, rng: &mut Rng) {
    for p in module.named_parameters() {
        p.var.set_value(Tensor::rand_normal(&p.var.shape(), 0.0, scale, rng)).unwrap();
    }
}

/// Checks `d forward / d (x and every parameter)` against central differences, at
/// `samples` random elements of each tensor.
pub fn check_module(module: &dyn Module, x: &Var, forward: impl Fn(&Var) -> Result<Var>, seed: u64, samples: usize) {
    let mut rng = Rng::new(seed);
    let mut leaves: Vec<(String, Var)> = module.named_parameters().into_iter().map(|p| (p.name, p.var)).collect();
    leaves.push(("input".into(), x.clone()));
    for (_, v) in &leaves {
        v.zero_grad();
    }
    let y = forward(x).unwrap();
    let weights = Tensor::rand_uniform(&y.shape(), -1.0, 1.0, &mut rng);
    y.backward_with(weights.clone()).unwrap();
    let weighted = || -> f64 {
        let y = no_grad(|| forward(x)).unwrap().value().to_vec();
        y.iter().zip(weights.to_vec()).map(|(&a, b)| a as f64 * b as f64).sum()
    };
    let tol = F32_TOLERANCE;
    for (name, var) in &leaves {
        let grad = var.grad().unwrap_or_else(|| panic!("{name} got no gradient")).to_vec();
        let base = var.value().to_vec();
        for _ in 0..samples.min(base.len()) {
            let j = rng.below(base.len() as u64) as usize;
            let h = tol.step * 1f64.max(base[j].abs() as f64);
            let probe = |delta: f64| -> (f64, f64) {
                let mut data = base.clone();
                data[j] = (base[j] as f64 + delta) as f32;
                var.set_value(Tensor::from_vec(data.clone(), &var.shape()).unwrap()).unwrap();
                (weighted(), data[j] as f64)
            };
            let ((up, x_up), (down, x_down)) = (probe(h), probe(-h));
            var.set_value(Tensor::from_vec(base.clone(), &var.shape()).unwrap()).unwrap();
            let numeric = (up - down) / (x_up - x_down);
            let analytic = grad[j] as f64;
            assert!(
                (analytic - numeric).abs() <= tol.atol + tol.rtol * numeric.abs(),
                "{name}[{j}]: analytic {analytic:.6e} vs numeric {numeric:.6e}"
            );
        }
    }
}
