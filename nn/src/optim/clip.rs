//! Gradient clipping by global norm (PyTorch `clip_grad_norm_`). Gradients on a GPU are
//! reduced there (`tensor::cuda::sum_squares`, one wait for the device for all of them)
//! and scaled there.

use autograd::Result;
use kernels::cpu::reduce::sum_squares;
use tensor::ops::Binary;
use tensor::Tensor;

use crate::NamedParameter;

/// Scales every gradient by `max_norm / total_norm` when the global L2 norm exceeds
/// `max_norm`. Returns the norm before clipping (logged as "grad norm").
pub fn clip_grad_norm(params: &[NamedParameter], max_norm: f32) -> Result<f32> {
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.var.grad()).collect();
    let norm = squared_norm(&grads)?.sqrt() as f32;
    if norm.is_finite() && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for p in params {
            if let Some(g) = p.var.grad() {
                p.var.set_grad(Some(g.scalar_op(Binary::Mul, scale)?));
            }
        }
    }
    Ok(norm)
}

/// `Σ g²` over all gradients in f64, each on its own device (the GPU ones together).
pub(crate) fn squared_norm(grads: &[Tensor]) -> Result<f64> {
    let (host, gpu): (Vec<&Tensor>, Vec<&Tensor>) = grads.iter().partition(|g| g.device() == tensor::Device::Cpu);
    let mut total = 0.0f64;
    for g in host {
        total += sum_squares(g.contiguous()?.as_slice()?);
    }
    if !gpu.is_empty() {
        total += gpu_squared_norm(&gpu.into_iter().cloned().collect::<Vec<_>>())?;
    }
    Ok(total)
}

#[cfg(feature = "cuda")]
fn gpu_squared_norm(grads: &[Tensor]) -> Result<f64> {
    tensor::cuda::sum_squares(grads)
}

/// Without the `cuda` feature no tensor lives on a GPU.
#[cfg(not(feature = "cuda"))]
fn gpu_squared_norm(grads: &[Tensor]) -> Result<f64> {
    Err(tensor::Error::UnsupportedDevice { op: "clip_grad_norm", device: grads[0].device() })
}
