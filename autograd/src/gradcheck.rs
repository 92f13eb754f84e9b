//! The engine-level gradient check: analytic gradients from `backward` against numeric
//! ones from the toolkit's one finite-difference helper ([`gradcheck::derivative`],
//! Richardson-extrapolated central differences) over the engine's own f32 forward, held to
//! the [`Dtype::F32`] row of the toolkit's tolerance table.
//!
//! The output `y` is reduced to the scalar `L = Σ wᵢ·yᵢ` with fixed random weights
//! `0.5 ≤ |wᵢ| ≤ 1` (so every output element matters, errors cannot cancel and none hides
//! behind a small weight), summed in f64 from the f32
//! outputs. The analytic side back-propagates `w` once; the numeric side perturbs one leaf
//! element at a time in place and re-runs the forward under [`no_grad`].

use ::gradcheck::{derivative, Dtype};
use tensor::{Result, Rng, Tensor};

use crate::{no_grad, Var};

/// The worst element found by a check.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Which leaf (its name, or `input {i}` for [`gradcheck`]).
    pub leaf: String,
    /// Flat index into that leaf.
    pub index: usize,
    pub analytic: f64,
    pub numeric: f64,
    /// The finite difference's own error estimate (the extrapolation table's spread).
    pub numeric_error: f64,
    /// `|analytic − numeric| / (atol + rtol·|numeric|)`: above 1 fails.
    pub ratio: f64,
}

/// Why a gradient check failed.
#[derive(Debug)]
pub enum GradcheckFailure {
    /// The function itself returned an error.
    Op(tensor::Error),
    /// A leaf received no gradient although the output depends on it.
    MissingGradient { leaf: String },
    /// The worst element is outside the tolerance.
    Mismatch(GradcheckReport),
}

impl std::fmt::Display for GradcheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GradcheckFailure::Op(e) => write!(f, "gradcheck: the function failed: {e}"),
            GradcheckFailure::MissingGradient { leaf } => write!(f, "gradcheck: {leaf} got no gradient"),
            GradcheckFailure::Mismatch(r) => {
                let tol = Dtype::F32.table().gradient;
                write!(
                    f,
                    "gradcheck: {} element {}: analytic {:.6e} vs numeric {:.6e} (±{:.1e}), off by {:.2e} = \
                     {:.2}× the tolerance (atol {:.0e}, rtol {:.0e})",
                    r.leaf,
                    r.index,
                    r.analytic,
                    r.numeric,
                    r.numeric_error,
                    (r.analytic - r.numeric).abs(),
                    r.ratio,
                    tol.atol,
                    tol.rtol
                )
            }
        }
    }
}

impl std::error::Error for GradcheckFailure {}

impl From<tensor::Error> for GradcheckFailure {
    fn from(e: tensor::Error) -> Self {
        GradcheckFailure::Op(e)
    }
}

/// Which elements of each leaf a check probes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Elements {
    /// Every element.
    All,
    /// Up to `per_leaf` elements drawn at random (with replacement) from `seed`: for
    /// modules whose parameters are too many to probe one by one.
    Sample { per_leaf: usize, seed: u64 },
}

/// Checks the gradients of `f` at `inputs`, every element of every input, and returns the
/// worst element or a failure naming it. Every input is treated as a parameter.
pub fn gradcheck(
    f: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
) -> std::result::Result<GradcheckReport, GradcheckFailure> {
    let params = inputs.iter().map(|t| Ok(Var::parameter(t.contiguous()?))).collect::<Result<Vec<Var>>>()?;
    let leaves: Vec<(String, Var)> = params.iter().enumerate().map(|(i, p)| (format!("input {i}"), p.clone())).collect();
    gradcheck_leaves(&leaves, Elements::All, || f(&params))
}

/// Checks `d forward() / d leaf` for every named leaf (module parameters, inputs), which
/// `forward` reads from the graph; each probe sets the leaf's value in place and restores it.
pub fn gradcheck_leaves(
    leaves: &[(String, Var)],
    elements: Elements,
    forward: impl Fn() -> Result<Var>,
) -> std::result::Result<GradcheckReport, GradcheckFailure> {
    let table = Dtype::F32.table();
    for (_, leaf) in leaves {
        leaf.zero_grad();
    }
    let y = forward()?;
    let mut rng = Rng::new(0x6772_6164);
    // |w| ≥ 0.5: an error in one output's slope cannot hide behind a tiny weight.
    let weights: Vec<f32> = (0..y.value_ref().numel())
        .map(|_| {
            let w = rng.uniform_range(0.5, 1.0);
            if rng.below(2) == 0 {
                -w
            } else {
                w
            }
        })
        .collect();
    y.backward_with(Tensor::from_vec(weights.clone(), &y.shape())?)?;
    drop(y);
    let weighted_sum = || -> Result<f64> {
        let y = no_grad(&forward)?.value().to_vec();
        Ok(y.iter().zip(&weights).map(|(&v, &w)| v as f64 * w as f64).sum())
    };

    let mut pick = match elements {
        Elements::All => None,
        Elements::Sample { seed, .. } => Some(Rng::new(seed)),
    };
    let mut worst = GradcheckReport {
        leaf: String::new(),
        index: 0,
        analytic: 0.0,
        numeric: 0.0,
        numeric_error: 0.0,
        ratio: 0.0,
    };
    for (name, leaf) in leaves {
        let grad = leaf.grad();
        let base_tensor = leaf.value();
        let base = base_tensor.to_vec();
        let analytic = grad.as_ref().map(Tensor::to_vec).unwrap_or_else(|| vec![0.0; base.len()]);
        let indices: Vec<usize> = match (elements, pick.as_mut()) {
            (Elements::Sample { per_leaf, .. }, Some(pick)) => {
                (0..per_leaf.min(base.len())).map(|_| pick.below(base.len() as u64) as usize).collect()
            }
            _ => (0..base.len()).collect(),
        };
        let mut depends = false;
        for j in indices {
            let mut failed = None;
            let estimate = derivative(base[j] as f64, Dtype::F32, |t| {
                let mut data = base.clone();
                data[j] = t as f32;
                let probe = Tensor::from_vec(data, base_tensor.shape()).and_then(|v| leaf.set_value(v));
                match probe.and_then(|()| weighted_sum()) {
                    Ok(sum) => sum,
                    Err(e) => {
                        failed = Some(e);
                        f64::NAN
                    }
                }
            });
            leaf.set_value(base_tensor.clone())?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            depends |= estimate.value.abs() > table.gradient.atol;
            let a = analytic[j] as f64;
            let ratio = table.gradient.ratio(a, estimate.value);
            if ratio > worst.ratio || worst.leaf.is_empty() {
                worst = GradcheckReport {
                    leaf: name.clone(),
                    index: j,
                    analytic: a,
                    numeric: estimate.value,
                    numeric_error: estimate.error,
                    ratio,
                };
            }
        }
        if grad.is_none() && depends {
            return Err(GradcheckFailure::MissingGradient { leaf: name.clone() });
        }
    }
    if worst.ratio > 1.0 {
        return Err(GradcheckFailure::Mismatch(worst));
    }
    Ok(worst)
}
