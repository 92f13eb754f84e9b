//! The GPU branch of the optimizers (feature `cuda`): one fused `kernels::cuda::optim`
//! launch per parameter tensor, in place on the parameter's device, with the state in
//! [`Slot::Device`]s beside it; and the squared gradient norm for clipping. Same update
//! rules and per-step constants as the CPU kernels, so both agree to f32 rounding.

use autograd::Result;
use kernels::cuda::optim::{adam_step, adamw_step, sgd_step, AdamHyper};
use tensor::Tensor;

use super::slot::Slot;

/// Errors unless `grad` is on `param`'s device.
fn check_same_device(op: &'static str, param: &Tensor, grad: &Tensor) -> Result<()> {
    if param.device() == grad.device() {
        Ok(())
    } else {
        Err(tensor::Error::DeviceMismatch { op, lhs: param.device(), rhs: grad.device() })
    }
}

/// One Adam (`decoupled = false`) or AdamW update of a GPU `param` from its `grad`.
pub(crate) fn adam_update(
    param: &mut Tensor,
    grad: &Tensor,
    first_moment: &mut Slot,
    second_moment: &mut Slot,
    hyper: &AdamHyper,
    decoupled: bool,
) -> Result<()> {
    const OP: &str = "adam step";
    check_same_device(OP, param, grad)?;
    let m = first_moment.device_buffer(param, OP)?;
    let v = second_moment.device_buffer(param, OP)?;
    let (dev, p) = param.cuda_f32_mut(OP)?;
    let update = if decoupled { adamw_step } else { adam_step };
    grad.with_cuda_f32(OP, |_, g| Ok(update(&dev, p, g, m, v, hyper)?))
}

/// One SGD-with-momentum update of a GPU `param` from its `grad` (PyTorch semantics).
pub(crate) fn sgd_update(
    param: &mut Tensor,
    grad: &Tensor,
    buffer: &mut Slot,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) -> Result<()> {
    const OP: &str = "sgd step";
    check_same_device(OP, param, grad)?;
    let buf = buffer.device_buffer(param, OP)?;
    let (dev, p) = param.cuda_f32_mut(OP)?;
    grad.with_cuda_f32(OP, |_, g| Ok(sgd_step(&dev, p, g, buf, lr, momentum, weight_decay, nesterov)?))
}
