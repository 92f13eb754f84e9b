//! Embedding lookup (index_select over rows) and its scatter-add backward
//! (`Tensor::embedding_backward`).

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Rows of `self: [V, C]` picked by `ids`, shaped `ids_shape + [C]` (PyTorch `F.embedding`).
    pub fn embedding(&self, ids: &[u32], ids_shape: &[usize]) -> Result<Var> {
        let y = self.value_ref().embedding(ids, ids_shape)?;
        let vocab = self.shape()[0]; // the forward checked the weight is [V, C]
        let ids = ids.to_vec();
        // d/dW: dW[ids[i]] += dy[i] (a row used twice gets both gradients)
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::embedding_backward(&ids, dy, vocab)?])))
    }
}
