//! Embedding lookup (index_select over rows) and its scatter-add backward.

use kernels::cpu::embedding::embedding_backward;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Rows of `self: [V, C]` picked by `ids`, shaped `ids_shape + [C]` (PyTorch `F.embedding`).
    pub fn embedding(&self, ids: &[u32], ids_shape: &[usize]) -> Result<Var> {
        let weight_shape = self.shape();
        let y = self.value_ref().embedding(ids, ids_shape)?;
        let ids = ids.to_vec();
        // d/dW: dW[ids[i]] += dy[i] (a row used twice gets both gradients)
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            let mut dw = tensor::pool::zeros(weight_shape.iter().product());
            embedding_backward(&ids, dy.contiguous()?.as_slice()?, weight_shape[1], &mut dw);
            Ok(vec![Tensor::from_vec(dw, &weight_shape)?])
        }))
    }
}
