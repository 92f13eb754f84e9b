//! Gradient checks of whole modules, shared by the `nn` test files: every parameter and
//! the input are probed in place by `autograd::gradcheck_leaves` (the toolkit's
//! finite differences and f32 tolerance row) against the analytic gradient.

use autograd::{gradcheck_leaves, Elements, Result, Var};
use nn::Module;
use tensor::{Rng, Tensor};

/// Overwrites every parameter with N(0, scale²) values (so zero-initialised biases matter).
pub fn randomise(module: &dyn Module, scale: f32, rng: &mut Rng) {
    for p in module.named_parameters() {
        p.var.set_value(Tensor::rand_normal(&p.var.shape(), 0.0, scale, rng)).unwrap();
    }
}

/// Checks `d forward / d (x and every parameter)` at `samples` random elements of each
/// tensor, panicking with the failure (leaf name, element, analytic vs numeric).
pub fn check_module(module: &dyn Module, x: &Var, forward: impl Fn(&Var) -> Result<Var>, seed: u64, samples: usize) {
    let mut leaves: Vec<(String, Var)> = module.named_parameters().into_iter().map(|p| (p.name, p.var)).collect();
    leaves.push(("input".into(), x.clone()));
    let elements = Elements::Sample { per_leaf: samples, seed };
    if let Err(failure) = gradcheck_leaves(&leaves, elements, || forward(x)) {
        panic!("{failure}");
    }
}
