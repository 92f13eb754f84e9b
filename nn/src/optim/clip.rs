//! Gradient clipping by global norm (PyTorch `clip_grad_norm_`).

use autograd::Result;
use kernels::cpu::reduce::sum_squares;
use tensor::ops::Binary;

use crate::NamedParameter;

/// Scales every gradient by `max_norm / total_norm` when the global L2 norm exceeds
/// `max_norm`. Returns the norm before clipping (logged as "grad norm").
pub fn clip_grad_norm(params: &[NamedParameter], max_norm: f32) -> Result<f32> {
    let mut total = 0.0f64;
    for p in params {
        if let Some(g) = p.var.grad() {
            total += sum_squares(g.contiguous()?.as_slice()?);
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
