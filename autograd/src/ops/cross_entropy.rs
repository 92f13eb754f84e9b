//! Fused cross-entropy (log-softmax + negative log-likelihood, mean over counted rows).
//! Saves the logits, the per-row log-sum-exp and the targets (on a GPU, the device copy the
//! forward uploaded); probabilities are recomputed in backward (`Tensor::cross_entropy_backward`),
//! which reads the loss gradient where it lives (no wait for a GPU).

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Mean cross-entropy of `self: [N, V]` logits against `targets[N]`, skipping rows
    /// whose target is `ignore_index` (PyTorch `F.cross_entropy(..., ignore_index)`).
    /// The loss is a rank-0 value on the logits' device.
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<Var> {
        let logits = self.value().contiguous()?;
        let out = logits.cross_entropy(targets, ignore_index)?;
        let (lse, count, targets) = (out.lse, out.count, out.targets);
        // d loss/d logits = dy · (softmax(logits) − onehot(target)) / count
        Ok(Var::from_op(out.loss, vec![self.clone()], move |dy| {
            Ok(vec![Tensor::cross_entropy_backward(&logits, &targets, ignore_index, &lse, dy, count)?])
        }))
    }
}
