//! The GPU branch of the optimizers (feature `cuda`): fused `kernels::cuda::optim` updates
//! in place on the parameters' device, with the state in [`Slot::Device`]s beside it (Adam:
//! one multi-tensor launch per group of up to 64 parameters, which also rewrites the bf16
//! copies bf16 products read; SGD: one launch per parameter). Same update
//! rules and per-step constants as the CPU kernels, so both agree to f32 rounding. The
//! per-step constants (Adam's bias corrections and decay, SGD's learning rate) are read on
//! the device from [`DeviceScalars`], which `Optimizer::stage` rewrites before each update.

use std::cell::RefMut;

use autograd::{Result, Var};
use kernels::cuda::optim::{
    adam_constants, adam_step, sgd_step, AdamHyper, AdamTensor, Previous, ADAM_CONSTANTS_LEN, STEP_GUARD_LEN,
};
use kernels::cuda::{DeviceBuffer, DeviceRun};
use tensor::cuda::CudaStorage;
use tensor::{Device, Storage, Tensor};

use super::slot::Slot;

/// Errors unless `grad` is on `param`'s device.
fn check_same_device(op: &'static str, param: &Tensor, grad: &Tensor) -> Result<()> {
    if param.device() == grad.device() {
        Ok(())
    } else {
        Err(tensor::Error::DeviceMismatch { op, lhs: param.device(), rhs: grad.device() })
    }
}

/// Per-step scalars an update reads on the device (Adam's constants, SGD's learning rate):
/// one small f32 tensor per GPU, rewritten in place at each step (a copy from the host into
/// the same buffer), so an update captured in a CUDA graph reads each replay's own.
#[derive(Default)]
pub(crate) struct DeviceScalars {
    per_device: Vec<(Device, Tensor)>,
}

impl DeviceScalars {
    /// Writes `values` to `device`'s buffer (made by the first write; later writes keep its
    /// length and address).
    pub(crate) fn write(&mut self, device: Device, values: &[f32]) -> Result<()> {
        const OP: &str = "optimizer step constants";
        match self.per_device.iter_mut().find(|(d, _)| *d == device) {
            Some((_, scalars)) => {
                let (dev, buffer) = scalars.cuda_f32_mut(OP)?;
                dev.copy_to_device(values, buffer)?;
            }
            None => {
                let scalars = Tensor::from_vec(values.to_vec(), &[values.len()])?.to_device(device)?;
                self.per_device.push((device, scalars));
            }
        }
        Ok(())
    }

    /// `device`'s buffer, as last written.
    pub(crate) fn buffer(&self, device: Device, op: &'static str) -> Result<&DeviceBuffer<f32>> {
        match self.per_device.iter().find(|(d, _)| *d == device) {
            Some((_, scalars)) => scalars.cuda_f32(op),
            None => Err(tensor::Error::InvalidShape {
                op,
                shape: vec![],
                reason: format!("no update was staged for {device:?} (Optimizer::stage)"),
            }),
        }
    }
}

/// The GPUs `params` live on, each once, in the order first met.
pub(crate) fn gpus_of(params: &[crate::NamedParameter]) -> Vec<Device> {
    let mut gpus: Vec<Device> = Vec::new();
    for p in params {
        let device = p.var.value_ref().device();
        if device != Device::Cpu && !gpus.contains(&device) {
            gpus.push(device);
        }
    }
    gpus
}

/// Ends a training step on each GPU `params` live on ([`kernels::cuda::CudaDevice::end_step`]):
/// the caching allocator places the next step's buffers where this step's were, so a
/// steady-state step makes no driver allocation.
pub(crate) fn end_step(params: &[crate::NamedParameter]) {
    for device in gpus_of(params) {
        if let Device::Cuda(ordinal) = device {
            // The parameters live there, so the device is open: a failure here is none.
            if let Ok(dev) = tensor::cuda::device(ordinal) {
                dev.end_step();
            }
        }
    }
}

/// Writes Adam's constants of each of `groups` (the decaying parameters', then the others')
/// for `device`: `[group 0's ADAM_CONSTANTS_LEN | group 1's]`.
pub(crate) fn stage_adam_constants(
    scalars: &mut DeviceScalars,
    device: Device,
    groups: &[AdamHyper; 2],
    decoupled: bool,
) -> Result<()> {
    let mut values = Vec::with_capacity(2 * ADAM_CONSTANTS_LEN);
    for hyper in groups {
        values.extend(adam_constants(hyper, decoupled)?);
    }
    scalars.write(device, &values)
}

/// A GPU parameter's part in an Adam step: the parameter, its gradient, its moments, its
/// hyper-parameters and whether it decays (which of the staged constants it reads).
pub(crate) struct AdamParam<'a> {
    pub var: &'a Var,
    pub grad: Tensor,
    pub m: &'a mut Slot,
    pub v: &'a mut Slot,
    pub hyper: AdamHyper,
    pub decays: bool,
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
    let tensor::Device::Cuda(ordinal) = loss_sum.device() else {
        return Err(tensor::Error::UnsupportedDevice { op: OP, device: loss_sum.device() });
    };
    let dev = tensor::cuda::device(ordinal)?;
    // Uninitialised: the kernel writes all four values (no memset launch per step).
    let mut guard = CudaStorage::alloc(&dev, STEP_GUARD_LEN)?;
    let previous = previous.map(Tensor::dense).transpose()?;
    let previous = match &previous {
        Some(p) => Previous::Guard(p.cuda_f32(OP)?),
        None => Previous::First,
    };
    launch_step_guard(grads, loss_sum, loss_divisor, max_norm, previous, guard.f32_buffer_mut(OP)?)?;
    Tensor::from_storage(Storage::Cuda(guard), &[STEP_GUARD_LEN])
}

/// [`step_guard`] written over `guard` (four values on the gradients' GPU), its verdict
/// after the one `guard` held: the guard of a step captured in a CUDA graph.
pub(crate) fn step_guard_in_place(
    grads: &[Tensor],
    loss_sum: &Tensor,
    loss_divisor: f32,
    max_norm: f32,
    guard: &mut Tensor,
) -> Result<()> {
    let (_, buffer) = guard.cuda_f32_mut("step guard")?;
    launch_step_guard(grads, loss_sum, loss_divisor, max_norm, Previous::InPlace, buffer)
}

/// The launches of a step guard into `guard`.
fn launch_step_guard(
    grads: &[Tensor],
    loss_sum: &Tensor,
    loss_divisor: f32,
    max_norm: f32,
    previous: Previous,
    guard: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "step guard";
    // A contiguous gradient is read where it is (its part of a packed gradient buffer too).
    let grads: Vec<Tensor> = grads.iter().map(Tensor::contiguous).collect::<Result<_>>()?;
    let runs = grads.iter().map(|g| g.cuda_f32_run(OP)).collect::<Result<Vec<_>>>()?;
    let loss_sum = loss_sum.dense()?;
    let tensor::Device::Cuda(ordinal) = loss_sum.device() else {
        return Err(tensor::Error::UnsupportedDevice { op: OP, device: loss_sum.device() });
    };
    let dev = tensor::cuda::device(ordinal)?;
    let loss = loss_sum.cuda_f32(OP)?;
    Ok(kernels::cuda::optim::step_guard(&dev, &runs, loss, loss_divisor, max_norm, previous, guard)?)
}

/// One Adam or AdamW step of GPU parameters with the staged `constants`: grouped by device
/// and decay (matrices decay, vectors do not), each group updated by the multi-tensor
/// kernel, one launch per `TENSORS_PER_LAUNCH` tensors (not one per tensor); under a step
/// `guard` (on the parameters' device), applied as it says on the device.
pub(crate) fn adam_update(params: Vec<AdamParam>, constants: &DeviceScalars, guard: Option<&Tensor>) -> Result<()> {
    const OP: &str = "adam step";
    let mut groups: Vec<Vec<AdamParam>> = Vec::new();
    for p in params {
        let device = p.var.value_ref().device();
        check_same_device(OP, &p.var.value_ref(), &p.grad)?;
        let key = |q: &AdamParam| (q.var.value_ref().device(), q.decays);
        match groups.iter_mut().find(|g| key(&g[0]) == (device, p.decays)) {
            Some(group) => group.push(p),
            None => groups.push(vec![p]),
        }
    }
    let guard = guard.map(|g| g.cuda_f32(OP)).transpose()?;
    for group in groups {
        let (device, decays) = (group[0].var.value_ref().device(), group[0].decays);
        let staged = constants.buffer(device, OP)?;
        let at = if decays { 0 } else { ADAM_CONSTANTS_LEN };
        update_group(group, DeviceRun::new(staged, at, ADAM_CONSTANTS_LEN)?, guard)?;
    }
    Ok(())
}

/// One multi-tensor update of parameters that share a device and their `constants`.
fn update_group(group: Vec<AdamParam>, constants: DeviceRun<f32>, guard: Option<&DeviceBuffer<f32>>) -> Result<()> {
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
    Ok(adam_step(&dev, &mut tensors, &hyper, constants, guard)?)
}

/// One SGD-with-momentum update of a GPU `param` from its `grad` (PyTorch semantics), at
/// the learning rate staged in `lr` (one element on the parameter's device).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_update(
    param: &mut Tensor,
    grad: &Tensor,
    buffer: &mut Slot,
    lr: &DeviceScalars,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) -> Result<()> {
    const OP: &str = "sgd step";
    check_same_device(OP, param, grad)?;
    let lr = lr.buffer(param.device(), OP)?;
    let buf = buffer.device_buffer(param, OP)?;
    let (dev, p) = param.cuda_f32_mut(OP)?;
    grad.with_cuda_f32(OP, |_, g| Ok(sgd_step(&dev, p, g, buf, lr, momentum, weight_decay, nesterov)?))
}
