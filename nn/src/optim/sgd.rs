//! SGD with momentum and (coupled) weight decay, PyTorch `torch.optim.SGD` semantics:
//! `buf = μ·buf + (g + λ·p)`, `p −= lr·buf` (Nesterov: `p −= lr·(g + λp + μ·buf)`).

use autograd::Result;
use kernels::cpu::optim::sgd_step;
use tensor::Tensor;

use super::slot::Slot;
use super::{find_state, gradient_of, Optimizer, StepGuard};
use crate::NamedParameter;

/// SGD with a momentum buffer per parameter (on its parameter's device: parameters on a
/// GPU take the fused CUDA step).
pub struct Sgd {
    params: Vec<NamedParameter>,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
    buffers: Vec<Slot>,
    /// The learning rate of the staged update.
    lr: f32,
    /// That learning rate on each GPU of the parameters, where the update reads it.
    #[cfg(feature = "cuda")]
    lr_on_device: super::cuda::DeviceScalars,
}

impl Sgd {
    /// Zero momentum buffers.
    pub fn new(params: Vec<NamedParameter>, momentum: f32, weight_decay: f32, nesterov: bool) -> Sgd {
        let buffers = params.iter().map(|p| Slot::zeros(p.var.value_ref().numel())).collect();
        Sgd {
            params,
            momentum,
            weight_decay,
            nesterov,
            buffers,
            lr: 0.0,
            #[cfg(feature = "cuda")]
            lr_on_device: super::cuda::DeviceScalars::default(),
        }
    }
}

impl Optimizer for Sgd {
    /// Keeps `lr`, and writes it to each GPU the parameters are on.
    fn stage(&mut self, lr: f32) -> Result<()> {
        self.lr = lr;
        #[cfg(feature = "cuda")]
        for device in super::cuda::gpus_of(&self.params) {
            self.lr_on_device.write(device, &[lr])?;
        }
        Ok(())
    }

    /// The update at the staged learning rate; a guard is applied on the host.
    fn apply_staged(&mut self, guard: Option<&StepGuard>) -> Result<()> {
        if let Some(guard) = guard {
            if !super::guard::apply_on_host(&self.params, guard)? {
                return Ok(());
            }
        }
        let lr = self.lr;
        for (i, p) in self.params.iter().enumerate() {
            let Some(grad) = gradient_of(p)? else { continue };
            let mut value = p.var.value_mut();
            #[cfg(feature = "cuda")]
            if value.device() != tensor::Device::Cpu {
                let (momentum, decay, nesterov) = (self.momentum, self.weight_decay, self.nesterov);
                let lr = &self.lr_on_device;
                super::cuda::sgd_update(&mut value, &grad, &mut self.buffers[i], lr, momentum, decay, nesterov)?;
                continue;
            }
            let param = value.as_mut_slice()?;
            sgd_step(
                param,
                grad.as_slice()?,
                self.buffers[i].host()?,
                lr,
                self.momentum,
                self.weight_decay,
                self.nesterov,
            );
        }
        Ok(())
    }

    fn parameters(&self) -> &[NamedParameter] {
        &self.params
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .zip(&self.buffers)
            .map(|(p, b)| (format!("{}.momentum_buffer", p.name), b.to_tensor(&p.var.shape())))
            .collect()
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            let numel = p.var.value_ref().numel();
            self.buffers[i] = Slot::Host(find_state(state, &format!("{}.momentum_buffer", p.name), numel)?);
        }
        Ok(())
    }
}
