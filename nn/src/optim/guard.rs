//! The step guard: gradient-norm clipping and the finiteness check of a training step,
//! computed where the gradients are and handed to the optimizer, which applies it itself.
//!
//! A training step must not update the weights when its loss or gradient norm is not
//! finite, and clips its gradients to a global norm (PyTorch's `clip_grad_norm_`). Deciding
//! that on the host means reading the loss and the norm back from the GPU before the update
//! can be queued: two waits per step. Here the verdict is four numbers `[update, scale,
//! norm, loss]` written on the gradients' device ([`step_guard`]); the GPU Adam update reads
//! it there (skipping itself, or scaling every gradient as it reads it), and the host reads
//! it once, after the whole step is queued ([`StepGuard::read`]). On the CPU the same numbers
//! are computed on the host, and the update is the same as clipping first, bit for bit.

use autograd::Result;
use tensor::ops::Binary;
use tensor::Tensor;

use super::clip::squared_norm;
use crate::NamedParameter;

/// Where the step's verdict lives: `[update (1 or 0), clipping factor, gradient norm, mean
/// loss]` as an f32 tensor on the gradients' device.
#[derive(Clone, Debug)]
pub struct StepGuard(Tensor);

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
    /// The guard as a tensor of four values on its device (for the GPU optimizers).
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// Reads the four values (a wait for the device when the guard lives on a GPU).
    pub fn read(&self) -> Result<GuardValues> {
        let values = self.0.to_host()?.to_vec();
        Ok(GuardValues { update: values[0] != 0.0, scale: values[1], grad_norm: values[2], loss: values[3] })
    }
}

/// The verdict of a step whose summed loss is `loss_sum` (one element; the mean loss is
/// `loss_sum / loss_divisor`), over the gradients of `params`, clipping their global norm to
/// `max_norm` (`f32::INFINITY`: no clipping). Computed on the GPU without a wait when the
/// gradients and the loss all live on one; otherwise on the host.
pub fn step_guard(params: &[NamedParameter], loss_sum: &Tensor, loss_divisor: f32, max_norm: f32) -> Result<StepGuard> {
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.var.grad()).collect();
    #[cfg(feature = "cuda")]
    if loss_sum.device() != tensor::Device::Cpu && grads.iter().all(|g| g.device() == loss_sum.device()) {
        return super::cuda::step_guard(&grads, loss_sum, loss_divisor, max_norm).map(StepGuard);
    }
    let norm = squared_norm(&grads)?.sqrt() as f32;
    let loss = loss_sum.to_host()?.item()? / loss_divisor;
    let update = loss.is_finite() && norm.is_finite();
    let scale = if update && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
    let values = vec![f32::from(u8::from(update)), scale, norm, loss];
    Ok(StepGuard(Tensor::from_vec(values, &[4])?))
}

/// The host's side of a guarded update ([`super::Optimizer::step_guarded`]'s default):
/// `false` when the guard says not to update, otherwise `true` with every gradient of
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
