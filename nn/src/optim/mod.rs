//! Optimizers (SGD with momentum, Adam, AdamW, row-sparse table updates), gradient clipping
//! and learning-rate schedules. Updates run in place through the fused kernels of
//! `kernels::cpu::optim` (or `kernels::cuda::optim` for parameters on a GPU, feature
//! `cuda`), one pass per parameter tensor, outside the autograd graph. Optimizer state
//! lives on its parameter's device (`slot.rs`).

mod adam;
mod clip;
#[cfg(feature = "cuda")]
mod cuda;
mod guard;
mod schedule;
mod sgd;
mod slot;
mod sparse_rows;

pub use adam::{Adam, AdamConfig};
pub use clip::clip_grad_norm;
pub use guard::{step_guard, GuardValues, StepGuard};
pub use schedule::Schedule;
pub use sgd::Sgd;
pub use sparse_rows::{RowRule, SparseRows};

use autograd::Result;
use tensor::Tensor;

use crate::NamedParameter;

/// What every optimizer offers the training loop and the checkpoint code.
pub trait Optimizer {
    /// Applies one update with learning rate `lr` to every parameter that has a gradient.
    fn step(&mut self, lr: f32) -> Result<()>;

    /// [`Optimizer::step`] under a [`StepGuard`]: no update when the guard says the step's
    /// loss or gradient norm is not finite, otherwise the update of the gradients scaled by
    /// the guard's clipping factor. This default reads the guard on the host; the GPU Adam
    /// reads it on the device, so the host need not wait for the step's verdict first.
    fn step_guarded(&mut self, lr: f32, guard: &StepGuard) -> Result<()> {
        if guard::apply_on_host(self.parameters(), guard)? {
            self.step(lr)?;
        }
        Ok(())
    }

    /// The parameters being optimised.
    fn parameters(&self) -> &[NamedParameter];

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.var.zero_grad();
        }
    }

    /// Internal state as named tensors (moments, step count) for checkpoints. A tensor may
    /// live on its parameter's GPU (download it with `Tensor::to_host` to save it).
    fn state(&self) -> Vec<(String, Tensor)>;

    /// Restores state saved by [`Optimizer::state`] (host or GPU tensors; the next step
    /// moves each entry to its parameter's device); errors name a missing or misshapen entry.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()>;
}

/// Looks `name` up in saved optimizer state, checking the element count.
pub(crate) fn find_state(state: &[(String, Tensor)], name: &str, numel: usize) -> Result<Vec<f32>> {
    let (_, t) = state.iter().find(|(n, _)| n == name).ok_or_else(|| tensor::Error::InvalidShape {
        op: "load optimizer state",
        shape: vec![],
        reason: format!("entry {name} is missing"),
    })?;
    if t.numel() != numel {
        return Err(tensor::Error::ShapeMismatch {
            op: "load optimizer state",
            lhs: vec![numel],
            rhs: t.shape().to_vec(),
        });
    }
    Ok(t.to_host()?.to_vec())
}

/// A parameter's gradient as a contiguous f32 vector, if it has one.
pub(crate) fn gradient_of(p: &NamedParameter) -> Result<Option<Tensor>> {
    p.var.grad().map(|g| g.contiguous()).transpose()
}
