//! Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019: decoupled weight decay).
//!
//! PyTorch equivalents: `torch.optim.Adam`, `torch.optim.AdamW`. Weight decay applies to
//! matrices only (rank ≥ 2): norm gains, biases and modulator scalars are not decayed.

use autograd::Result;
use kernels::cpu::optim::{adam_step, adamw_step, AdamHyper};
use tensor::Tensor;

use super::slot::Slot;
use super::{find_state, gradient_of, Optimizer, StepGuard};
use crate::NamedParameter;

/// Hyper-parameters of Adam / AdamW.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Decay of the first-moment (mean) estimate.
    pub beta1: f32,
    /// Decay of the second-moment (uncentred variance) estimate.
    pub beta2: f32,
    /// Added to `√v̂` in the denominator.
    pub eps: f32,
    /// The weight decay coefficient (see `decoupled`).
    pub weight_decay: f32,
    /// true = AdamW (decoupled decay), false = Adam (L2 decay added to the gradient).
    pub decoupled: bool,
}

impl Default for AdamConfig {
    /// PyTorch's AdamW defaults (β = 0.9, 0.999; eps 1e-8; decay 0.01).
    fn default() -> Self {
        AdamConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true }
    }
}

/// Adam or AdamW over a list of parameters, with first and second moments per parameter
/// (each on its parameter's device: parameters on a GPU take the fused CUDA step).
pub struct Adam {
    params: Vec<NamedParameter>,
    config: AdamConfig,
    first_moment: Vec<Slot>,
    second_moment: Vec<Slot>,
    step: u64,
    /// The learning rate of the staged update.
    lr: f32,
    /// The staged update's constants on each GPU of the parameters (`super::cuda`).
    #[cfg(feature = "cuda")]
    constants: super::cuda::DeviceScalars,
}

impl Adam {
    /// Zero moments for every parameter.
    pub fn new(params: Vec<NamedParameter>, config: AdamConfig) -> Adam {
        let zeros = |p: &NamedParameter| Slot::zeros(p.var.value_ref().numel());
        Adam {
            first_moment: params.iter().map(zeros).collect(),
            second_moment: params.iter().map(zeros).collect(),
            params,
            config,
            step: 0,
            lr: 0.0,
            #[cfg(feature = "cuda")]
            constants: super::cuda::DeviceScalars::default(),
        }
    }

    /// Number of updates applied so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }
}

/// Whether Adam decays parameter `p` (matrices do; vectors and scalars do not).
fn decays(p: &NamedParameter) -> bool {
    p.var.value_ref().rank() >= 2
}

/// The update's hyper-parameters at step `step` and learning rate `lr` for parameters that
/// `decays` or not.
fn hyper(config: &AdamConfig, step: u64, decays: bool, lr: f32) -> AdamHyper {
    AdamHyper {
        lr,
        beta1: config.beta1,
        beta2: config.beta2,
        eps: config.eps,
        weight_decay: if decays { config.weight_decay } else { 0.0 },
        step,
    }
}

impl Adam {
    /// The staged update: on the CPU one parameter at a time, on a GPU all together (one
    /// multi-tensor launch per group of parameters sharing a device and hyper-parameters:
    /// `super::cuda::adam_update`, reading the staged constants), which applies a GPU step
    /// `guard` itself when given.
    fn update(&mut self, guard: Option<&Tensor>) -> Result<()> {
        let (config, step, lr) = (self.config, self.step, self.lr);
        #[cfg(feature = "cuda")]
        let mut on_gpu = Vec::new();
        let moments = self.first_moment.iter_mut().zip(self.second_moment.iter_mut());
        for (p, (m, v)) in self.params.iter().zip(moments) {
            let Some(grad) = gradient_of(p)? else { continue };
            let decays = decays(p);
            let hyper = hyper(&config, step, decays, lr);
            #[cfg(feature = "cuda")]
            if p.var.value_ref().device() != tensor::Device::Cpu {
                on_gpu.push(super::cuda::AdamParam { var: &p.var, grad, m, v, hyper, decays });
                continue;
            }
            if let Some(guard) = guard {
                // A GPU guard clips and skips GPU updates only.
                return Err(tensor::Error::DeviceMismatch {
                    op: "adam step",
                    lhs: tensor::Device::Cpu,
                    rhs: guard.device(),
                });
            }
            let mut value = p.var.value_mut();
            let param = value.as_mut_slice()?;
            let update = if config.decoupled { adamw_step } else { adam_step };
            update(param, grad.as_slice()?, m.host()?, v.host()?, &hyper);
        }
        #[cfg(feature = "cuda")]
        super::cuda::adam_update(on_gpu, &self.constants, guard)?;
        Ok(())
    }
}

impl Optimizer for Adam {
    /// Counts the step and, for each GPU the parameters are on, writes the step's constants
    /// (`kernels::cuda::optim::adam_constants` of the decaying and the other parameters) to
    /// that GPU's constants buffer, which the update reads.
    fn stage(&mut self, lr: f32) -> Result<()> {
        self.step += 1;
        self.lr = lr;
        #[cfg(feature = "cuda")]
        for device in super::cuda::gpus_of(&self.params) {
            let groups = [true, false].map(|decays| hyper(&self.config, self.step, decays, lr));
            super::cuda::stage_adam_constants(&mut self.constants, device, &groups, self.config.decoupled)?;
        }
        Ok(())
    }

    /// A guard on a GPU (where [`super::step_guard`] puts it when every gradient is there) is
    /// read by the update on the device: no wait. When it skips the update, the step count
    /// has still advanced; the trainer stops at such a step and never saves it.
    fn apply_staged(&mut self, guard: Option<&StepGuard>) -> Result<()> {
        match guard {
            Some(guard) if guard.tensor().device() == tensor::Device::Cpu => {
                if super::guard::apply_on_host(&self.params, guard)? {
                    self.update(None)?;
                }
                Ok(())
            }
            Some(guard) => self.update(Some(guard.tensor())),
            None => self.update(None),
        }
    }

    fn parameters(&self) -> &[NamedParameter] {
        &self.params
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), Tensor::scalar(self.step as f32))];
        for (i, p) in self.params.iter().enumerate() {
            let shape = p.var.shape();
            out.push((format!("{}.exp_avg", p.name), self.first_moment[i].to_tensor(&shape)));
            out.push((format!("{}.exp_avg_sq", p.name), self.second_moment[i].to_tensor(&shape)));
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        self.step = find_state(state, "step", 1)?[0] as u64;
        for (i, p) in self.params.iter().enumerate() {
            let numel = p.var.value_ref().numel();
            self.first_moment[i] = Slot::Host(find_state(state, &format!("{}.exp_avg", p.name), numel)?);
            self.second_moment[i] = Slot::Host(find_state(state, &format!("{}.exp_avg_sq", p.name), numel)?);
        }
        Ok(())
    }
}
