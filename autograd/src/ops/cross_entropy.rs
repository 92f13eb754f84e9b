//! Fused cross-entropy (log-softmax + negative log-likelihood, mean over counted rows).
//! Saves the logits and the per-row log-sum-exp; probabilities are recomputed in backward
//! (`Tensor::cross_entropy_backward`).

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Mean cross-entropy of `self: [N, V]` logits against `targets[N]`, skipping rows
    /// whose target is `ignore_index` (PyTorch `F.cross_entropy(..., ignore_index)`).
    /// The loss is a rank-0 value on the logits' device.
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<Var> {
        let logits = self.value().contiguous()?;
        let out = logits.cross_entropy(targets, ignore_index)?;
        let targets = targets.to_vec();
        let (lse, count) = (out.lse, out.count);
        // d loss/d logits = (softmax(logits) − onehot(target)) / count
        Ok(Var::from_op(out.loss, vec![self.clone()], move |dy| {
            let scale = if count > 0 { dy.to_host()?.item()? / count as f32 } else { 0.0 };
            Ok(vec![Tensor::cross_entropy_backward(&logits, &targets, ignore_index, &lse, scale)?])
        }))
    }
}
