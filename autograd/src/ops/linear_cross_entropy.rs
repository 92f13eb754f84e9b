//! The LM head and its mean cross-entropy as one graph node, and the composite it must agree
//! with. The forward (`Tensor::linear_cross_entropy`) works through the rows in chunks and
//! never holds the `[N, V]` logits; it computes `d loss/d h` and `d loss/d W` for an upstream
//! gradient of 1 on the way, since each chunk's logits are gone once the next is computed.
//! So the node saves those two gradients and nothing else (no logits, no log-sum-exp), and
//! its backward multiplies them by the gradient it receives (`Tensor::scaled_by_upstream`: on
//! a GPU read there, both in one launch). Under `no_grad`, or for inputs that need no
//! gradient, the forward skips the gradient products.
//!
//! PyTorch equivalent: `F.cross_entropy(F.linear(h, W), targets, ignore_index=...)`, computed
//! as Liger-Kernel's fused linear cross-entropy computes it.

use tensor::{Result, Tensor, Tokens};

use crate::{is_grad_enabled, Var};

impl Var {
    /// Mean cross-entropy of the logits `self·weightᵀ` (`self: [N, C]`, `weight: [V, C]`, a
    /// linear layer's weight, no bias) against `targets[N]` (on `self`'s device), skipping
    /// rows whose target is `ignore_index`: [`Var::linear_cross_entropy_reference`] without
    /// its `[N, V]` logits and their gradient. A rank-0 value on `self`'s device. `max_chunk_rows` caps the rows
    /// of logits held at a time (`None`: as many as fit `tensor::ops::LOGITS_CHUNK_BYTES`).
    pub fn linear_cross_entropy(
        &self,
        weight: &Var,
        targets: &Tokens,
        ignore_index: Option<u32>,
        max_chunk_rows: Option<usize>,
    ) -> Result<Var> {
        let needs = [self.requires_grad(), weight.requires_grad()].map(|needs| needs && is_grad_enabled());
        let out = self.value().linear_cross_entropy(&weight.value(), targets, ignore_index, needs, max_chunk_rows)?;
        let (dh, dweight) = (out.dh, out.dweight);
        Ok(Var::from_op(out.loss, vec![self.clone(), weight.clone()], move |dy| {
            // d/dh = dy · (dlogits·W),  d/dW = dy · (dlogitsᵀ·h): the forward's products, scaled
            let saved: Vec<&Tensor> = dh.iter().chain(&dweight).collect();
            let mut scaled = Tensor::scaled_by_upstream(&saved, dy)?.into_iter();
            // An input that needs no gradient gets an empty placeholder the walk never reads.
            let mut grad = |saved: &Option<Tensor>| {
                saved.as_ref().and_then(|_| scaled.next()).unwrap_or_else(|| Tensor::zeros(&[0]))
            };
            Ok(vec![grad(&dh), grad(&dweight)])
        }))
    }

    /// The same loss composed from unfused ops, `self.matmul(&weight.transpose(0, 1)?)?
    /// .cross_entropy(targets.host(), ignore_index)`: the reference [`Var::linear_cross_entropy`] is
    /// tested against (it holds the `[N, V]` logits and their gradient).
    pub fn linear_cross_entropy_reference(
        &self,
        weight: &Var,
        targets: &Tokens,
        ignore_index: Option<u32>,
    ) -> Result<Var> {
        self.matmul(&weight.transpose(0, 1)?)?.cross_entropy(targets.host(), ignore_index)
    }
}
