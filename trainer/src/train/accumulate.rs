//! The forward and backward passes of one step's micro-batches, what an eager step and a
//! step replayed as a CUDA graph (`graph.rs`) both run, and the norm a step clips to.

use anyhow::Result;
use models::llama::Llama;
use tensor::{Tensor, Tokens};

/// Forward and backward passes of `model` over micro-batches of token ids (`(inputs,
/// targets)`, `batch` sequences of `seq` each), gradients summed onto the parameters' (each
/// loss scaled by `1 / micro_batches` when that is not 1). Returns the micro-batches'
/// losses, summed where they were computed (no wait for the device).
pub(crate) fn loss_and_gradients(
    model: &Llama,
    tokens: &[(Tokens, Tokens)],
    batch: usize,
    seq: usize,
    micro_batches: f32,
) -> Result<Tensor> {
    let mut sum: Option<Tensor> = None;
    for (inputs, targets) in tokens {
        let loss = model.loss(inputs, targets, batch, seq)?;
        sum = Some(match sum {
            None => loss.value(),
            Some(sum) => sum.add(&loss.value())?,
        });
        // A scale of 1 changes no bit: the loss alone is backpropagated (two launches fewer).
        if micro_batches == 1.0 {
            loss.backward()?;
        } else {
            loss.mul_scalar(1.0 / micro_batches)?.backward()?;
        }
    }
    sum.ok_or_else(|| anyhow::anyhow!("a step needs at least one micro-batch"))
}

/// The gradient norm a step clips to: `grad_clip`, or no clipping (∞) when it is 0.
pub(crate) fn max_norm(grad_clip: f32) -> f32 {
    if grad_clip > 0.0 {
        grad_clip
    } else {
        f32::INFINITY
    }
}
