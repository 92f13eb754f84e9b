//! Gradient clipping by global norm (PyTorch `clip_grad_norm_`). Gradients on a GPU are
//! reduced there (`kernels::cuda::reduce::sum_squares`, one sync each) and scaled there.

use autograd::Result;
use kernels::cpu::reduce::sum_squares;
use tensor::ops::Binary;
use tensor::Tensor;

use crate::NamedParameter;

/// Scales every gradient by `max_norm / total_norm` when the global L2 norm exceeds
/// `max_norm`. Returns the norm before clipping (logged as "grad norm").
pub fn clip_grad_norm(params: &[NamedParameter], max_norm: f32) -> Result<f32> {
    let mut total = 0.0f64;
    for p in params {
        if let Some(g) = p.var.grad() {
            total += squared_norm(&g)?;
        }
    }
    let norm = total.sqrt() as f32;
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

/// `Σ g²` in f64, on the gradient's device.
fn squared_norm(g: &Tensor) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if g.device() != tensor::Device::Cpu {
        return super::cuda::squared_norm(g);
    }
    Ok(sum_squares(g.contiguous()?.as_slice()?))
}
