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
#[cfg(feature = "cuda")]
pub use guard::GraphGuard;
pub use guard::{step_guard, GuardValues, StepGuard};
pub use schedule::Schedule;
pub use sgd::Sgd;
pub use sparse_rows::{RowRule, SparseRows};

use autograd::Result;
use tensor::Tensor;

use crate::NamedParameter;

/// What every optimizer offers the training loop and the checkpoint code.
///
/// An update has a host half, [`Optimizer::stage`] (the step count, and the step's constants
/// written where the update reads them: on a GPU, device buffers at fixed addresses), and a
/// device half, [`Optimizer::apply_staged`] (the update itself, which on a GPU only queues
/// device work). [`Optimizer::step`] and [`Optimizer::step_guarded`] run both; a training
/// step captured in a CUDA graph captures the second and runs the first before each replay,
/// so every replay updates with its own step's learning rate and bias corrections.
pub trait Optimizer {
    /// Stages an update at learning rate `lr` (counts the step, writes its constants).
    fn stage(&mut self, lr: f32) -> Result<()>;

    /// Applies the staged update to every parameter that has a gradient; under a
    /// [`StepGuard`], none when the guard says the step's loss or gradient norm is not finite,
    /// otherwise the update of the gradients scaled by the guard's clipping factor. A guard
    /// on the host is applied there (the gradients scaled in place); the GPU optimizers read a GPU
    /// guard on the device, so the host need not wait for the step's verdict first.
    fn apply_staged(&mut self, guard: Option<&StepGuard>) -> Result<()>;

    /// One update with learning rate `lr` of every parameter that has a gradient.
    fn step(&mut self, lr: f32) -> Result<()> {
        self.stage(lr)?;
        self.apply_staged(None)
    }

    /// [`Optimizer::step`] under a [`StepGuard`] (see [`Optimizer::apply_staged`]).
    fn step_guarded(&mut self, lr: f32, guard: &StepGuard) -> Result<()> {
        self.stage(lr)?;
        self.apply_staged(Some(guard))
    }

    /// The parameters being optimised.
    fn parameters(&self) -> &[NamedParameter];

    /// Clears every parameter's gradient, and ends the training step for the GPUs the
    /// parameters live on (their caching allocators repeat this step's placements in the
    /// next: `kernels/src/cuda/allocator.rs`).
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.var.zero_grad();
        }
        #[cfg(feature = "cuda")]
        cuda::end_step(self.parameters());
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
