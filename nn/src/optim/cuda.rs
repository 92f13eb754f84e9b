//! The GPU branch of the optimizers (feature `cuda`): fused `kernels::cuda::optim` updates
//! in place on the parameters' device, with the state in [`Slot::Device`]s beside it (Adam:
//! one multi-tensor launch per group of up to 64 parameters, which also rewrites the bf16
//! copies bf16 products read; SGD: one launch per parameter). Same update
//! rules and per-step constants as the CPU kernels, so both agree to f32 rounding.

use std::cell::RefMut;

use autograd::{Result, Var};
use kernels::cuda::optim::{adam_step, adamw_step, sgd_step, AdamHyper, AdamTensor, STEP_GUARD_LEN};
use tensor::cuda::CudaStorage;
use tensor::{Storage, Tensor};

use super::slot::Slot;

/// Errors unless `grad` is on `param`'s device.
fn check_same_device(op: &'static str, param: &Tensor, grad: &Tensor) -> Result<()> {
    if param.device() == grad.device() {
        Ok(())
    } else {
        Err(tensor::Error::DeviceMismatch { op, lhs: param.device(), rhs: grad.device() })
    }
}

/// A GPU parameter's part in an Adam step: the parameter, its gradient, its moments and
/// its hyper-parameters.
pub(crate) struct AdamParam<'a> {
    pub var: &'a Var,
    pub grad: Tensor,
    pub m: &'a mut Slot,
    pub v: &'a mut Slot,
    pub hyper: AdamHyper,
}

/// The step guard `[update, scale, norm, loss]` of GPU gradients `grads` and the summed loss
/// `loss_sum` (after the `previous` step's guard), all on one device, computed there without a
/// wait (`kernels::cuda::optim::step_guard`).
pub(crate) fn step_guard(
    grads: &[Tensor],
    loss_sum: &Tensor,
    loss_divisor: f32,
    max_norm: f32,
    previous: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "step guard";
    // A contiguous gradient is read where it is (its part of a packed gradient buffer too).
    let grads: Vec<Tensor> = grads.iter().map(Tensor::contiguous).collect::<Result<_>>()?;
    let runs = grads.iter().map(|g| g.cuda_f32_run(OP)).collect::<Result<Vec<_>>>()?;
    let loss_sum = loss_sum.dense()?;
    let tensor::Device::Cuda(ordinal) = loss_sum.device() else {
        return Err(tensor::Error::UnsupportedDevice { op: OP, device: loss_sum.device() });
    };
    let dev = tensor::cuda::device(ordinal)?;
    // Uninitialised: the kernel writes all four values (no memset launch per step).
    let mut guard = CudaStorage::alloc(&dev, STEP_GUARD_LEN)?;
    let buffer = guard.f32_buffer_mut(OP)?;
    let previous = previous.map(Tensor::dense).transpose()?;
    let previous = previous.as_ref().map(|p| p.cuda_f32(OP)).transpose()?;
    kernels::cuda::optim::step_guard(&dev, &runs, loss_sum.cuda_f32(OP)?, loss_divisor, max_norm, previous, buffer)?;
    Tensor::from_storage(Storage::Cuda(guard), &[STEP_GUARD_LEN])
}

/// One Adam (`decoupled = false`) or AdamW step of GPU parameters: grouped by device and
/// hyper-parameters (matrices decay, vectors do not), each group updated by the
/// multi-tensor kernel, one launch per `TENSORS_PER_LAUNCH` tensors (not one per tensor);
/// under a step `guard` (on the parameters' device), applied as it says on the device.
pub(crate) fn adam_update(params: Vec<AdamParam>, decoupled: bool, guard: Option<&Tensor>) -> Result<()> {
    const OP: &str = "adam step";
    let mut groups: Vec<Vec<AdamParam>> = Vec::new();
    for p in params {
        let device = p.var.value_ref().device();
        check_same_device(OP, &p.var.value_ref(), &p.grad)?;
        let key = |q: &AdamParam| (q.var.value_ref().device(), q.hyper.weight_decay.to_bits());
        match groups.iter_mut().find(|g| key(&g[0]) == (device, p.hyper.weight_decay.to_bits())) {
            Some(group) => group.push(p),
            None => groups.push(vec![p]),
        }
    }
    let guard = guard.map(|g| g.cuda_f32(OP)).transpose()?;
    for group in groups {
        update_group(group, decoupled, guard)?;
    }
    Ok(())
}

/// One multi-tensor update of parameters that share a device and hyper-parameters.
fn update_group(
    group: Vec<AdamParam>,
    decoupled: bool,
    guard: Option<&kernels::cuda::DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "adam step";
    let hyper = group[0].hyper;
    let mut values: Vec<RefMut<Tensor>> = group.iter().map(|p| p.var.value_mut()).collect();
    let grads: Vec<Tensor> = group.iter().map(|p| p.grad.contiguous()).collect::<Result<_>>()?;
    let mut moments = Vec::with_capacity(group.len());
    for (p, value) in group.into_iter().zip(&values) {
        moments.push((p.m.device_buffer(value, OP)?, p.v.device_buffer(value, OP)?));
    }
    let mut device = None;
    let mut tensors = Vec::with_capacity(values.len());
    for ((value, grad), (m, v)) in values.iter_mut().zip(&grads).zip(moments) {
        let (dev, param, param_bf16) = value.cuda_f32_mut_with_bf16_copy(OP)?;
        tensors.push(AdamTensor { param, param_bf16, grad: grad.cuda_f32_run(OP)?, m, v });
        device = Some(dev);
    }
    let Some(dev) = device else { return Ok(()) };
    let update = if decoupled { adamw_step } else { adam_step };
    Ok(update(&dev, &mut tensors, &hyper, guard)?)
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
