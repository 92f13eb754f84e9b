//! The step guard: gradient-norm clipping and the finiteness check of a training step,
//! computed where the gradients are and handed to the optimizer, which applies it itself.
//!
//! A training step must not update the weights when its loss or gradient norm is not
//! finite, and clips its gradients to a global norm (PyTorch's `clip_grad_norm_`). Deciding
//! that on the host means reading the loss and the norm back from the GPU before the update
//! can be queued: two waits per step. Here the verdict is four numbers `[update, scale,
//! norm, loss]` written on the gradients' device ([`step_guard`]); the GPU Adam update reads
//! it there (skipping itself, or scaling every gradient as it reads it), and the host reads
//! it once ([`StepGuard::read`]), as late as it likes: a training loop reads it after it has
//! queued the next step, whose guard then also forbids that step's update when this one's did
//! (`previous`). On the CPU the same numbers are computed on the host, and the update is the
//! same as clipping first, bit for bit.

use std::cell::{Cell, RefCell};

use autograd::Result;
use tensor::ops::Binary;
use tensor::{HostLater, Tensor};

use super::clip::squared_norm;
use crate::NamedParameter;

/// Where the step's verdict lives: `[update (1 or 0), clipping factor, gradient norm, mean
/// loss]` as an f32 tensor on the gradients' device, and those four values on their way to
/// the host (the copy is queued when the guard is made, so reading it waits for the guard
/// alone, not for the update or a next step queued after it).
pub struct StepGuard {
    tensor: Tensor,
    /// The copy of `tensor` to the host, queued when the guard was made, until read.
    queued: RefCell<Option<HostLater>>,
    /// The values, once read.
    values: Cell<Option<GuardValues>>,
}

/// The step guard's numbers, read on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GuardValues {
    /// Whether the update runs: the loss and the gradient norm are both finite.
    pub update: bool,
    /// The factor every gradient is multiplied by (1 without clipping).
    pub scale: f32,
    /// The global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The step's mean loss.
    pub loss: f32,
}

impl StepGuard {
    /// The guard of four values `tensor`, whose copy to the host is queued now.
    fn new(tensor: Tensor) -> Result<StepGuard> {
        let queued = RefCell::new(Some(tensor.read_later()?));
        Ok(StepGuard { tensor, queued, values: Cell::new(None) })
    }

    /// The guard of four values `tensor`, with no copy to the host queued (read waits for
    /// the device).
    #[cfg(feature = "cuda")]
    fn unread(tensor: Tensor) -> StepGuard {
        StepGuard { tensor, queued: RefCell::new(None), values: Cell::new(None) }
    }

    /// The guard as a tensor of four values on its device (for the GPU optimizers).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Reads the four values: on a GPU, a wait for the guard's own copy (queued when it was
    /// made), not for the work queued after it.
    pub fn read(&self) -> Result<GuardValues> {
        if let Some(values) = self.values.get() {
            return Ok(values);
        }
        let host = match self.queued.borrow_mut().take() {
            Some(queued) => queued.wait()?,
            // A wait that failed before took the queued copy: read the guard directly.
            None => self.tensor.to_host()?,
        };
        let v = host.to_vec();
        let values = GuardValues { update: v[0] != 0.0, scale: v[1], grad_norm: v[2], loss: v[3] };
        self.values.set(Some(values));
        Ok(values)
    }
}

/// The verdict of a step whose summed loss is `loss_sum` (one element; the mean loss is
/// `loss_sum / loss_divisor`), over the gradients of `params`, clipping their global norm to
/// `max_norm` (`f32::INFINITY`: no clipping). With the `previous` step's guard, the update
/// runs only when that step's did too: a host that reads each guard one step late (after
/// queueing the next step) stops a run whose weights then stay at the last good step.
/// Computed on the GPU without a wait when the gradients, the loss and the previous guard
/// all live on one; otherwise on the host.
pub fn step_guard(
    params: &[NamedParameter],
    loss_sum: &Tensor,
    loss_divisor: f32,
    max_norm: f32,
    previous: Option<&StepGuard>,
) -> Result<StepGuard> {
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.var.grad()).collect();
    #[cfg(feature = "cuda")]
    {
        let device = loss_sum.device();
        let on_device = |t: &Tensor| t.device() == device;
        if device != tensor::Device::Cpu && grads.iter().all(on_device) && previous.is_none_or(|p| on_device(&p.tensor))
        {
            let previous = previous.map(StepGuard::tensor);
            return StepGuard::new(super::cuda::step_guard(&grads, loss_sum, loss_divisor, max_norm, previous)?);
        }
    }
    let norm = squared_norm(&grads)?.sqrt() as f32;
    let loss = loss_sum.to_host()?.item()? / loss_divisor;
    let allowed = match previous {
        Some(previous) => previous.read()?.update,
        None => true,
    };
    let update = loss.is_finite() && norm.is_finite() && allowed;
    let scale = if update && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
    let values = vec![f32::from(u8::from(update)), scale, norm, loss];
    StepGuard::new(Tensor::from_vec(values, &[4])?)
}

/// The step guard of a training step captured in a CUDA graph: one buffer of four values on
/// the GPU that the step rewrites in place at every replay (its verdict after the one the
/// buffer held: the step before's), and that the host reads after each replay.
#[cfg(feature = "cuda")]
pub struct GraphGuard {
    tensor: Tensor,
}

#[cfg(feature = "cuda")]
impl GraphGuard {
    /// The guard on `device` of a step after `previous` (its values copied), or, without one,
    /// of a run's first step.
    pub fn after(previous: Option<&StepGuard>, device: tensor::Device) -> Result<GraphGuard> {
        let tensor = match previous {
            Some(previous) => previous.tensor.deep_copy()?.to_device(device)?,
            // [update, scale, norm, loss]: "the step before updated".
            None => Tensor::from_vec(vec![1.0, 1.0, 0.0, 0.0], &[4])?.to_device(device)?,
        };
        Ok(GraphGuard { tensor })
    }

    /// This step's verdict over the gradients of `params` and the summed loss `loss_sum`
    /// ([`step_guard`]'s), written over the buffer on the GPU, as the guard the optimizer
    /// applies ([`super::Optimizer::apply_staged`]); nothing is copied to the host.
    pub fn update(
        &mut self,
        params: &[NamedParameter],
        loss_sum: &Tensor,
        loss_divisor: f32,
        max_norm: f32,
    ) -> Result<StepGuard> {
        let grads: Vec<Tensor> = params.iter().filter_map(|p| p.var.grad()).collect();
        super::cuda::step_guard_in_place(&grads, loss_sum, loss_divisor, max_norm, &mut self.tensor)?;
        Ok(StepGuard::unread(self.tensor.clone()))
    }

    /// The verdict the buffer holds now (after a replay): a copy of it on the device (the
    /// next replay rewrites the buffer), whose copy to the host is queued now.
    pub fn queue_read(&self) -> Result<StepGuard> {
        StepGuard::new(self.tensor.deep_copy()?)
    }
}

/// The host's side of a guarded update (what an optimizer's `apply_staged` does with a
/// guard on the host, and SGD's with any guard): `false` when the guard says not to update, otherwise `true` with every gradient of
/// `params` scaled by its factor, as `clip_grad_norm` does.
pub(crate) fn apply_on_host(params: &[NamedParameter], guard: &StepGuard) -> Result<bool> {
    let values = guard.read()?;
    if !values.update {
        return Ok(false);
    }
    if values.scale != 1.0 {
        for p in params {
            if let Some(g) = p.var.grad() {
                p.var.set_grad(Some(g.scalar_op(Binary::Mul, values.scale)?));
            }
        }
    }
    Ok(true)
}
