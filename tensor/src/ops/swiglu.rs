//! SwiGLU gating `silu(gate) ⊙ up` in one pass (PyTorch `F.silu(gate) * up`). The formulas,
//! the kernel and its backward live in `kernels::cpu::swiglu`.

use kernels::cpu::swiglu::swiglu_forward;

use crate::{Error, Result, Tensor};

impl Tensor {
    /// `silu(self) ⊙ up` elementwise, `self` being the gate. The shapes must be equal (no
    /// broadcasting: both operands are projections of the same rows).
    pub fn swiglu(&self, up: &Tensor) -> Result<Tensor> {
        self.require_cpu("swiglu")?;
        up.require_cpu("swiglu")?;
        if self.shape != up.shape {
            return Err(Error::ShapeMismatch { op: "swiglu", lhs: self.shape.clone(), rhs: up.shape.clone() });
        }
        let (gate, up) = (self.contiguous()?, up.contiguous()?);
        let mut y = crate::pool::buffer(gate.numel());
        swiglu_forward(gate.as_slice()?, up.as_slice()?, &mut y);
        Tensor::from_vec(y, &self.shape)
    }
}
