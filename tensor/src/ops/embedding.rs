//! Embedding lookup (rows of `[V, C]` picked by token ids, PyTorch `F.embedding`) and its
//! weight gradient. The ids are a batch's [`Tokens`], on the weight's device: on a GPU the
//! lookup reads them, and the backward their grouping by id, from the Tokens' device buffer
//! (nothing is uploaded here). Kernels: `kernels::cpu::embedding` (`kernels::cuda::embedding`
//! on the GPU).

use kernels::cpu::embedding;

use crate::{Error, Result, Tensor, Tokens};

impl Tensor {
    /// Rows of `self: [V, C]` picked by `ids` (on `self`'s device); the output has shape
    /// `ids_shape + [C]` (PyTorch `F.embedding`, also `index_select` over dimension 0).
    pub fn embedding(&self, ids: &Tokens, ids_shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "embedding";
        let &[vocab, dim] = self.shape.as_slice() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape.clone(),
                reason: "weight must be [V, C]".into(),
            });
        };
        if ids_shape.iter().product::<usize>() != ids.len() {
            return Err(Error::ShapeMismatch { op: OP, lhs: ids_shape.to_vec(), rhs: vec![ids.len()] });
        }
        ids.check_device(OP, self.device)?;
        ids.check_below(OP, vocab)?;
        let out_shape = [ids_shape, &[dim]].concat();
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::embedding(self, ids, &out_shape);
        }
        self.require_cpu(OP)?;
        let w = self.contiguous()?;
        let mut out = crate::pool::buffer(ids.len() * dim);
        embedding::embedding_forward(w.as_slice()?, dim, ids.host(), &mut out);
        Tensor::from_vec(out, &out_shape)
    }

    /// The weight gradient `[vocab, C]` of [`Tensor::embedding`] for the gradient `dy`
    /// (`ids_shape + [C]`, on the ids' device) of its output: `dW[ids[i]] += dy[i]` (a row
    /// used twice gets both).
    pub fn embedding_backward(ids: &Tokens, dy: &Tensor, vocab: usize) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        let dim = dy.last_dim(OP)?;
        if dy.numel() != ids.len() * dim {
            return Err(Error::ShapeMismatch { op: OP, lhs: dy.shape.clone(), rhs: vec![ids.len(), dim] });
        }
        ids.check_device(OP, dy.device)?;
        ids.check_below(OP, vocab)?;
        #[cfg(feature = "cuda")]
        if dy.cuda_storage().is_some() {
            return cuda::embedding_backward(ids, dy, vocab, dim);
        }
        dy.require_cpu(OP)?;
        let mut dw = crate::pool::buffer(vocab * dim);
        embedding::embedding_backward(ids.host(), dy.contiguous()?.as_slice()?, dim, &mut dw);
        Tensor::from_vec(dw, &[vocab, dim])
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of the embedding lookup in `ops/embedding.rs` and its scatter-add
    //! backward, reading the (range-checked) ids and their grouping in place from the Tokens'
    //! device buffer.

    use kernels::cuda::embedding as launch;

    use crate::cuda::output;
    use crate::{Result, Tensor, Tokens};

    /// Rows of `weight: [V, C]` picked by `ids`, as a tensor of `out_shape` (`ids_shape + [C]`).
    pub(crate) fn embedding(weight: &Tensor, ids: &Tokens, out_shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "embedding";
        let dev = weight.cuda_device(OP)?;
        let dim = weight.dim(OP, 1)?;
        let weight = weight.dense()?;
        let ids = ids.device_ids(OP)?;
        output(&dev, OP, out_shape, |out| Ok(launch::embedding_forward(&dev, weight.cuda_f32(OP)?, dim, ids, out)?))
    }

    /// `dW: [vocab, dim]` with `dW[v] = Σ_{i : ids[i] = v} dy[i]`, each id's rows summed in
    /// position order: the CPU's result bit for bit, the same on every run.
    pub(crate) fn embedding_backward(ids: &Tokens, dy: &Tensor, vocab: usize, dim: usize) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        let dev = dy.cuda_device(OP)?;
        let dy = dy.dense()?;
        let grouping = ids.device_grouping(OP)?;
        output(&dev, OP, &[vocab, dim], |dw| Ok(launch::embedding_backward(&dev, grouping, dy.cuda_f32(OP)?, dim, dw)?))
    }
}
