//! SGD with momentum and (coupled) weight decay, PyTorch `torch.optim.SGD` semantics:
//! `buf = μ·buf + (g + λ·p)`, `p −= lr·buf` (Nesterov: `p −= lr·(g + λp + μ·buf)`).

use autograd::Result;
use kernels::cpu::optim::sgd_step;
use tensor::Tensor;

use super::slot::Slot;
use super::{find_state, gradient_of, Optimizer};
use crate::NamedParameter;

/// SGD with a momentum buffer per parameter (on its parameter's device: parameters on a
/// GPU take the fused CUDA step).
pub struct Sgd {
    params: Vec<NamedParameter>,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
    buffers: Vec<Slot>,
}

impl Sgd {
    /// Zero momentum buffers.
    pub fn new(params: Vec<NamedParameter>, momentum: f32, weight_decay: f32, nesterov: bool) -> Sgd {
        let buffers = params.iter().map(|p| Slot::zeros(p.var.value_ref().numel())).collect();
        Sgd { params, momentum, weight_decay, nesterov, buffers }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, lr: f32) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            let Some(grad) = gradient_of(p)? else { continue };
            let mut value = p.var.value_mut();
            #[cfg(feature = "cuda")]
            if value.device() != tensor::Device::Cpu {
                let (momentum, decay, nesterov) = (self.momentum, self.weight_decay, self.nesterov);
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
