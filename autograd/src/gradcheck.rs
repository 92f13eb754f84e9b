//! Gradient checking: analytic gradients from `backward` against central finite
//! differences accumulated in f64.
//!
//! The function's output `y` is reduced to the scalar `L = Σ wᵢ·yᵢ` with fixed random
//! weights `w` (so every output element matters and errors cannot cancel). The analytic
//! side back-propagates `w`; the numeric side computes `D(h) = (L(x+h) − L(x−h)) / 2h` with
//! the sum taken in f64 from the f32 outputs, one input element at a time. An element that
//! misses the tolerance gets a second estimate, `(4·D(h/2) − D(h)) / 3` (Richardson
//! extrapolation: the O(h²) truncation error cancels), and keeps the closer of the two: deep
//! compositions (LayerNorm, gates and SwiGLU in a row) curve enough that the plain central
//! difference missed a correct gradient by ~1.1-1.4× on about one random draw in a thousand.

use tensor::{Result, Rng, Tensor};

use crate::{no_grad, Var};

/// Step and tolerances of a check: an element passes when
/// `|analytic − numeric| ≤ atol + rtol·|numeric|`.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub step: f64,
    pub atol: f64,
    pub rtol: f64,
}

/// The tolerance for f32 compute: the forward's rounding (~1e-7 relative) divided by the
/// step (1e-3) bounds the numeric noise near 1e-4; O(h²) truncation is far below that.
pub const F32_TOLERANCE: Tolerance = Tolerance { step: 1e-3, atol: 2e-3, rtol: 2e-3 };

/// The worst element found by [`gradcheck`].
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Which input (position in the `inputs` slice).
    pub input: usize,
    /// Flat index into that input.
    pub index: usize,
    pub analytic: f64,
    pub numeric: f64,
    /// `|analytic − numeric| / (atol + rtol·|numeric|)`: above 1 fails.
    pub ratio: f64,
}

/// Why a gradient check failed.
#[derive(Debug)]
pub enum GradcheckFailure {
    /// The function itself returned an error.
    Op(tensor::Error),
    /// An input received no gradient although the output depends on it.
    MissingGradient { input: usize },
    /// The worst element is outside the tolerance.
    Mismatch(GradcheckReport),
}

impl std::fmt::Display for GradcheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GradcheckFailure::Op(e) => write!(f, "gradcheck: the function failed: {e}"),
            GradcheckFailure::MissingGradient { input } => write!(f, "gradcheck: input {input} got no gradient"),
            GradcheckFailure::Mismatch(r) => write!(
                f,
                "gradcheck: input {} element {}: analytic {:.6e} vs numeric {:.6e} ({:.2}× the tolerance)",
                r.input, r.index, r.analytic, r.numeric, r.ratio
            ),
        }
    }
}

impl std::error::Error for GradcheckFailure {}

impl From<tensor::Error> for GradcheckFailure {
    fn from(e: tensor::Error) -> Self {
        GradcheckFailure::Op(e)
    }
}

/// Checks the gradients of `f` at `inputs` and returns the worst element, or a failure
/// naming it. Every input is treated as a parameter.
pub fn gradcheck(
    f: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
    tol: Tolerance,
) -> std::result::Result<GradcheckReport, GradcheckFailure> {
    let params: Vec<Var> = inputs.iter().map(|t| Var::parameter(t.contiguous().expect("contiguous copy"))).collect();
    let y = f(&params)?;
    let mut rng = Rng::new(0x6772_6164);
    let weights: Vec<f32> = (0..y.value_ref().numel()).map(|_| rng.uniform_range(-1.0, 1.0)).collect();
    y.backward_with(Tensor::from_vec(weights.clone(), &y.shape())?)?;

    let weighted_sum = |xs: &[Tensor]| -> Result<f64> {
        let vars: Vec<Var> = xs.iter().cloned().map(Var::constant).collect();
        let y = no_grad(|| f(&vars))?;
        Ok(y.value().to_vec().iter().zip(&weights).map(|(&v, &w)| v as f64 * w as f64).sum())
    };

    let mut worst = GradcheckReport { input: 0, index: 0, analytic: 0.0, numeric: 0.0, ratio: 0.0 };
    for (i, param) in params.iter().enumerate() {
        let analytic = match param.grad() {
            Some(g) => g.to_vec(),
            None => vec![0.0; inputs[i].numel()],
        };
        let base = inputs[i].to_vec();
        let mut numeric_all_zero = true;
        for j in 0..base.len() {
            let h = tol.step * (1.0f64).max(base[j].abs() as f64);
            let mut shifted: Vec<Tensor> = params.iter().map(Var::value).collect();
            let mut probe = |delta: f64| -> Result<f64> {
                let mut data = base.clone();
                data[j] = (base[j] as f64 + delta) as f32;
                shifted[i] = Tensor::from_vec(data, inputs[i].shape())?;
                weighted_sum(&shifted)
            };
            // The step actually taken in f32, so rounding of x±h does not bias the slope.
            let mut central = |h: f64| -> Result<f64> {
                let (up, down) = ((base[j] as f64 + h) as f32 as f64, (base[j] as f64 - h) as f32 as f64);
                Ok((probe(up - base[j] as f64)? - probe(down - base[j] as f64)?) / (up - down))
            };
            let a = analytic[j] as f64;
            let ratio_of = |numeric: f64| (a - numeric).abs() / (tol.atol + tol.rtol * numeric.abs());
            let mut numeric = central(h)?;
            numeric_all_zero &= numeric.abs() < tol.atol;
            if ratio_of(numeric) > 1.0 {
                // Strongly curved functions: Richardson extrapolation cancels the O(h²) term.
                let extrapolated = (4.0 * central(h / 2.0)? - numeric) / 3.0;
                if ratio_of(extrapolated) < ratio_of(numeric) {
                    numeric = extrapolated;
                }
            }
            let ratio = ratio_of(numeric);
            if ratio > worst.ratio {
                worst = GradcheckReport { input: i, index: j, analytic: a, numeric, ratio };
            }
        }
        if param.grad().is_none() && !numeric_all_zero {
            return Err(GradcheckFailure::MissingGradient { input: i });
        }
    }
    if worst.ratio > 1.0 {
        return Err(GradcheckFailure::Mismatch(worst));
    }
    Ok(worst)
}
