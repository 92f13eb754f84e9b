//! Rotary position embedding (RoFormer; HF LLaMA's rotate-half layout). A rotation is
//! orthogonal, so backward is the inverse rotation of the gradient: nothing is saved.

use kernels::cpu::rope::{rope_backward, rope_table};
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Rotates `self: [B, T, H, D]`; token t sits at position `pos_offset + t`.
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Var> {
        let y = self.value_ref().rope(theta, pos_offset)?;
        let [b, t, h, d] = y.dims4("rope")?;
        // d/dx: dx = Rᵀ dy
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            let (cos, sin) = rope_table(pos_offset + t, d, theta);
            let mut dx = tensor::pool::zeros(dy.numel());
            rope_backward(dy.contiguous()?.as_slice()?, &cos, &sin, b, t, h, d, pos_offset, &mut dx);
            Ok(vec![Tensor::from_vec(dx, dy.shape())?])
        }))
    }
}
