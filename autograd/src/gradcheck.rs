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

use ::gradcheck::{derivative_with_noise, Dtype};
use tensor::{Result, Rng, Tensor};

use crate::{no_grad, Var};

/// The relative error allowed for one f32 output of a forward: 4 units of f32 roundoff
/// (2⁻²⁴ each), for the few roundings a composite op stacks up before its output.
const ROUNDING: f64 = 1.0 / (1u64 << 22) as f64;

/// The worst element found by a check.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Which leaf (its name, or `input {i}` for [`gradcheck`]).
    pub leaf: String,
    /// Flat index into that leaf.
    pub index: usize,
    /// The gradient from the tape.
    pub analytic: f64,
    /// The gradient from finite differences of the forward.
    pub numeric: f64,
    /// The finite difference's own error estimate (the extrapolation table's spread).
    pub numeric_error: f64,
    /// The bound on the numeric slope's share of f32 rounding: 4 f32 roundoffs (2⁻²²) of
    /// every weighted output that moved, carried through the differences.
    pub rounding_floor: f64,
    /// `|analytic − numeric| / (atol + rtol·|numeric| + rounding_floor)`: above 1 fails.
    pub ratio: f64,
}

/// Why a gradient check failed.
#[derive(Debug)]
pub enum GradcheckFailure {
    /// The function itself returned an error.
    Op(tensor::Error),
    /// A leaf received no gradient although the output depends on it.
    MissingGradient {
        /// The leaf's name (or `input {i}`).
        leaf: String,
    },
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
                     {:.2}× the tolerance (atol {:.0e} + rtol {:.0e}·|numeric| + rounding floor {:.1e})",
                    r.leaf,
                    r.index,
                    r.analytic,
                    r.numeric,
                    r.numeric_error,
                    (r.analytic - r.numeric).abs(),
                    r.ratio,
                    tol.atol,
                    tol.rtol,
                    r.rounding_floor
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
    Sample {
        /// How many elements each leaf gets probed at.
        per_leaf: usize,
        /// The seed of the draw.
        seed: u64,
    },
}

/// Checks the gradients of `f` at `inputs`, every element of every input, and returns the
/// worst element or a failure naming it. Every input is treated as a parameter.
pub fn gradcheck(
    f: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
) -> std::result::Result<GradcheckReport, GradcheckFailure> {
    let params = inputs.iter().map(|t| Ok(Var::parameter(t.contiguous()?))).collect::<Result<Vec<Var>>>()?;
    let leaves: Vec<(String, Var)> =
        params.iter().enumerate().map(|(i, p)| (format!("input {i}"), p.clone())).collect();
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
    let base_output = no_grad(&forward)?.value().to_vec();
    drop(y);
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
        rounding_floor: 0.0,
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
            // The forward's outputs with element j of this leaf set to t (restored after).
            let outputs_at = |t: f64| -> Result<Vec<f32>> {
                let mut data = base.clone();
                data[j] = t as f32;
                leaf.set_value(Tensor::from_vec(data, base_tensor.shape())?)?;
                let y = no_grad(&forward).map(|y| y.value().to_vec());
                leaf.set_value(base_tensor.clone())?;
                y
            };
            // Which outputs depend on element j: those a step 16× the first one moves.
            let far = outputs_at(base[j] as f64 + 16.0 * table.step * (base[j] as f64).abs().max(1.0))?;
            let moves: Vec<bool> = far.iter().zip(&base_output).map(|(a, b)| a != b).collect();
            // `L` at t, and a bound on its rounding: ROUNDING·|wᵢ·yᵢ| for every output that
            // depends on element j (the others are bit-identical at every probe and cancel).
            let mut failed = None;
            let estimate = derivative_with_noise(base[j] as f64, Dtype::F32, |t| match outputs_at(t) {
                Ok(y) => {
                    let (mut sum, mut noise) = (0.0, 0.0);
                    for ((&v, &w), &moved) in y.iter().zip(&weights).zip(&moves) {
                        let term = v as f64 * w as f64;
                        sum += term;
                        noise += if moved { ROUNDING * term.abs() } else { 0.0 };
                    }
                    (sum, noise)
                }
                Err(e) => {
                    failed = Some(e);
                    (f64::NAN, 0.0)
                }
            });
            if let Some(e) = failed {
                return Err(e.into());
            }
            depends |= estimate.value.abs() > table.gradient.atol;
            let a = analytic[j] as f64;
            // The check cannot resolve below the forward's rounding floor: it widens the bound.
            let bound = table.gradient.atol + table.gradient.rtol * estimate.value.abs() + estimate.noise;
            let ratio = if a == estimate.value { 0.0 } else { (a - estimate.value).abs() / bound };
            if ratio > worst.ratio || worst.leaf.is_empty() {
                worst = GradcheckReport {
                    leaf: name.clone(),
                    index: j,
                    analytic: a,
                    numeric: estimate.value,
                    numeric_error: estimate.error,
                    rounding_floor: estimate.noise,
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
