//! Embedding lookup (index_select over rows) and its scatter-add backward
//! (`Tensor::embedding_backward`). The node keeps a clone of the batch's [`Tokens`] (an `Arc`:
//! on a GPU the backward reads their grouping from the same device buffer as the forward).

use tensor::{Result, Tensor, Tokens};

use crate::Var;

impl Var {
    /// Rows of `self: [V, C]` picked by `ids` (on `self`'s device), shaped `ids_shape + [C]`
    /// (PyTorch `F.embedding`).
    pub fn embedding(&self, ids: &Tokens, ids_shape: &[usize]) -> Result<Var> {
        let y = self.value_ref().embedding(ids, ids_shape)?;
        let vocab = self.shape()[0]; // the forward checked the weight is [V, C]
        let ids = ids.clone();
        // d/dW: dW[ids[i]] += dy[i] (a row used twice gets both gradients)
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::embedding_backward(&ids, dy, vocab)?])))
    }
}
