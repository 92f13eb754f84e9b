//! Rotary position embedding (RoFormer; HF LLaMA's rotate-half layout). A rotation is
//! orthogonal, so backward is the inverse rotation of the gradient (`Tensor::rope_backward`):
//! nothing is saved.

use tensor::Result;

use crate::Var;

impl Var {
    /// Rotates `self: [B, T, H, D]`; token t sits at position `pos_offset + t`.
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Var> {
        let y = self.value_ref().rope(theta, pos_offset)?;
        // d/dx: dx = Rᵀ dy
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.rope_backward(theta, pos_offset)?])))
    }
}
