//! One tolerance table per dtype: the finite-difference step and how far an analytic
//! gradient (or a second implementation's output) may sit from the reference.

/// The dtype a forward pass is evaluated in when its slope is taken by finite differences.
/// The engine computes in f32; its kernels are checked against f64 oracles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// Differences of an f64 oracle: the numeric side is exact to ~1e-10, so the tolerance
    /// only covers the f32 rounding of the analytic side.
    F64,
    /// Differences of an f32 forward (the engine's own): the numeric side carries the
    /// forward's rounding divided by the step.
    F32,
}

/// `|got − want| ≤ atol + rtol·|want|` passes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Absolute part.
    pub atol: f64,
    /// Relative part.
    pub rtol: f64,
}

impl Tolerance {
    /// The same bound absolute and relative, `|got − want| ≤ tol·(1 + |want|)`: absolute near
    /// 0, relative for large values.
    pub const fn uniform(tol: f64) -> Tolerance {
        Tolerance { atol: tol, rtol: tol }
    }

    /// How many tolerances `got` is away from `want`: above 1 fails.
    pub fn ratio(self, got: f64, want: f64) -> f64 {
        let bound = self.atol + self.rtol * want.abs();
        if got == want {
            0.0
        } else if got.is_nan() || want.is_nan() {
            f64::INFINITY
        } else {
            (got - want).abs() / bound
        }
    }
}

/// The settings of one dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Table {
    /// First finite-difference step, relative to `max(1, |x|)`; [`crate::derivative`]
    /// halves it while Richardson extrapolation keeps improving.
    pub step: f64,
    /// Analytic gradient against the numeric one.
    pub gradient: Tolerance,
    /// Two f32 implementations of one forward (or one training step) against each other:
    /// the engine against PyTorch in the whole-model parity test.
    pub agreement: Tolerance,
}

impl Dtype {
    /// The table of this dtype. Why these numbers:
    /// - `F64`: the oracle's differences are exact to ~1e-10 after extrapolation; the f32
    ///   analytic side of a kernel rounds at ~1e-7 relative per operation and accumulates
    ///   over reductions of up to a few hundred terms in the tests: 2e-5.
    /// - `F32`: one output's rounding (6e-8 relative) over a step of 1e-2, extrapolated
    ///   (×3), over up to ~100 outputs that move with one input (√100): ~2e-5 for O(1)
    ///   values; 1e-4 leaves a factor 5. That rejects an erf GELU with the tanh
    ///   approximation's slope (8.7e-4 worst) at 4× the tolerance.
    pub const fn table(self) -> Table {
        match self {
            Dtype::F64 => Table {
                step: 1e-3,
                gradient: Tolerance { atol: 2e-5, rtol: 2e-5 },
                agreement: Tolerance { atol: 1e-6, rtol: 1e-6 },
            },
            Dtype::F32 => Table {
                step: 1e-2,
                gradient: Tolerance { atol: 1e-4, rtol: 1e-4 },
                agreement: Tolerance { atol: 3e-7, rtol: 3e-5 },
            },
        }
    }

    /// `x` rounded to this dtype (the point a forward in this dtype actually sees).
    pub fn round(self, x: f64) -> f64 {
        match self {
            Dtype::F64 => x,
            Dtype::F32 => x as f32 as f64,
        }
    }
}
