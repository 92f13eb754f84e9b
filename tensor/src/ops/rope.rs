//! Rotary position embedding of `[B, T, H, D]` (HF LLaMA rotate-half convention) and its
//! backward, the inverse rotation. Kernels: `kernels::cpu::rope` (`kernels::cuda::rope` on
//! the GPU); the cos/sin tables come from [`super::rope_table`].

use kernels::cpu::rope;

use super::rope_table::rope_table;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// [`Tensor::dims4`] with an even head dim (rotary embedding pairs its halves).
    fn rope_dims(&self, op: &'static str) -> Result<[usize; 4]> {
        let dims = self.dims4(op)?;
        if dims[3] % 2 != 0 {
            return Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "head dim must be even".into() });
        }
        Ok(dims)
    }

    /// Rotary position embedding of `x: [B, T, H, D]` (HF LLaMA rotate-half convention),
    /// token t at position `pos_offset + t`, base `theta` (10000 in LLaMA).
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [b, t, h, d] = self.rope_dims("rope")?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::rope::rope(self, theta, pos_offset, false);
        }
        let x = self.contiguous()?;
        let table = rope_table(pos_offset + t, d, theta);
        let mut y = crate::pool::buffer(x.numel());
        rope::rope_forward(x.as_slice()?, &table.cos, &table.sin, b, t, h, d, pos_offset, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// The backward of [`Tensor::rope`] for the gradient `self = dy` of its output: the
    /// inverse rotation `dx = Rᵀ dy` (a rotation is orthogonal; nothing is saved).
    pub fn rope_backward(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [b, t, h, d] = self.rope_dims("rope_backward")?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::rope::rope(self, theta, pos_offset, true);
        }
        let dy = self.contiguous()?;
        let table = rope_table(pos_offset + t, d, theta);
        let mut dx = crate::pool::buffer(dy.numel());
        rope::rope_backward(dy.as_slice()?, &table.cos, &table.sin, b, t, h, d, pos_offset, &mut dx, false);
        Tensor::from_vec(dx, &self.shape)
    }
}
