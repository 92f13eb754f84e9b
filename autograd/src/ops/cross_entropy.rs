//! Fused cross-entropy (log-softmax + negative log-likelihood, mean over counted rows).
//! Saves the logits and the per-row log-sum-exp; probabilities are recomputed in backward.

use kernels::cpu::cross_entropy::cross_entropy_backward;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Mean cross-entropy of `self: [N, V]` logits against `targets[N]`, skipping rows
    /// whose target is `ignore_index` (PyTorch `F.cross_entropy(..., ignore_index)`).
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<Var> {
        let logits = self.value().contiguous()?;
        let out = logits.cross_entropy(targets, ignore_index)?;
        let targets = targets.to_vec();
        let (lse, count) = (out.lse, out.count);
        // d loss/d logits = (softmax(logits) − onehot(target)) / count
        Ok(Var::from_op(Tensor::scalar(out.loss), vec![self.clone()], move |dy| {
            let cols = logits.shape()[1];
            let mut dlogits = tensor::pool::zeros(logits.numel());
            if count > 0 {
                let scale = dy.item()? / count as f32;
                cross_entropy_backward(logits.as_slice()?, cols, &targets, ignore_index, &lse, scale, &mut dlogits);
            }
            Ok(vec![Tensor::from_vec(dlogits, logits.shape())?])
        }))
    }
}
