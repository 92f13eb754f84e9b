//! Learning-rate schedules. `lr_at(step)` takes the 0-based step about to run.

/// A learning-rate schedule scaling a base rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Schedule {
    /// The base rate throughout.
    Constant,
    /// Linear warmup from 0, then cosine decay to `min_ratio · base` at `total`.
    WarmupCosine {
        /// Steps of the linear warmup.
        warmup: usize,
        /// The step at which the decay ends.
        total: usize,
        /// The final rate as a fraction of the base.
        min_ratio: f32,
    },
    /// Noam (Vaswani et al. 2017): linear warmup, then ∝ 1/√step, normalised so the
    /// peak at `warmup` is the base rate (the Transponder paper's schedule).
    Noam {
        /// Steps of the linear warmup (the peak).
        warmup: usize,
    },
    /// Linear decay from base to `end_ratio · base` over `total` steps (CoMT CIFAR).
    LinearDecay {
        /// Steps of the decay.
        total: usize,
        /// The final rate as a fraction of the base.
        end_ratio: f32,
    },
    /// OneCycle (Smith 2018, PyTorch defaults): cosine up from base/25 to base over
    /// `pct_start · total`, then cosine down to base/(25·1e4).
    OneCycle {
        /// Steps of the whole cycle.
        total: usize,
        /// The fraction of `total` spent rising.
        pct_start: f32,
    },
}

impl Schedule {
    /// Learning rate for `step` given the base (peak) rate.
    pub fn lr_at(&self, step: usize, base: f32) -> f32 {
        let cosine = |from: f32, to: f32, progress: f32| {
            to + (from - to) * 0.5 * (1.0 + (std::f32::consts::PI * progress.clamp(0.0, 1.0)).cos())
        };
        match *self {
            Schedule::Constant => base,
            Schedule::WarmupCosine { warmup, total, min_ratio } => {
                if step < warmup {
                    base * (step + 1) as f32 / warmup as f32
                } else {
                    let progress = (step - warmup) as f32 / (total.saturating_sub(warmup)).max(1) as f32;
                    cosine(base, base * min_ratio, progress)
                }
            }
            Schedule::Noam { warmup } => {
                let (s, w) = ((step + 1) as f32, warmup.max(1) as f32);
                base * (s / w).min((w / s).sqrt())
            }
            Schedule::LinearDecay { total, end_ratio } => {
                let progress = (step as f32 / total.max(1) as f32).min(1.0);
                base * (1.0 + (end_ratio - 1.0) * progress)
            }
            Schedule::OneCycle { total, pct_start } => {
                let (initial, last) = (base / 25.0, base / 25.0 / 1e4);
                let up = ((total as f32 * pct_start) as usize).max(1);
                if step < up {
                    cosine(initial, base, step as f32 / up as f32)
                } else {
                    cosine(base, last, (step - up) as f32 / (total.saturating_sub(up)).max(1) as f32)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_of_the_schedules() {
        let base = 1.0;
        let cos = Schedule::WarmupCosine { warmup: 10, total: 110, min_ratio: 0.1 };
        assert!((cos.lr_at(9, base) - 1.0).abs() < 1e-6);
        assert!((cos.lr_at(110, base) - 0.1).abs() < 1e-6);
        let noam = Schedule::Noam { warmup: 100 };
        assert!((noam.lr_at(99, base) - 1.0).abs() < 1e-6);
        assert!((noam.lr_at(399, base) - 0.5).abs() < 1e-6);
        assert!(noam.lr_at(9, base) < 0.11);
        let lin = Schedule::LinearDecay { total: 100, end_ratio: 0.01 };
        assert!((lin.lr_at(100, base) - 0.01).abs() < 1e-6);
        let one = Schedule::OneCycle { total: 100, pct_start: 0.3 };
        assert!((one.lr_at(0, base) - 0.04).abs() < 1e-6);
        assert!((one.lr_at(30, base) - 1.0).abs() < 1e-6);
        assert!(one.lr_at(100, base) < 1e-5);
    }
}
