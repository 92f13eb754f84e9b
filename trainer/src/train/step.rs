//! One optimizer step: gradients summed over `grad_accum` micro-batches, then — only when
//! the mean loss and the global gradient norm are both finite — clipping and the update.
//! A non-finite loss or norm stops the run without the update ([`Diverged`]), so no NaN ever
//! reaches the weights, the optimizer state or a checkpoint.
//!
//! In one process that decision is a step guard ([`nn::optim::step_guard`]) made where the
//! gradients are: on a GPU the update reads it on the device, and the host reads the step's
//! loss and norm one step late ([`QueuedStep`]): after it has queued the next step, so the
//! GPU never waits for the host to prepare one. A step queued after a non-finite one is
//! skipped on the device too (its guard reads the previous one), so the run stops with the
//! weights of the last good step. Data parallel decides on the host, after the all-reduce
//! that brings the loss there anyway.

use std::time::Instant;

use anyhow::Result;
use nn::optim::{clip_grad_norm, step_guard, Optimizer, StepGuard};
use tensor::{Tensor, Tokens};

use crate::data::sampler::TokenBatch;

use super::accumulate::{loss_and_gradients, max_norm};
use super::evaluate::mean_loss;
use super::setup::Session;
use super::Diverged;

/// What a completed step measured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepOutcome {
    /// Mean training loss over the step's micro-batches.
    pub loss: f32,
    /// Global L2 norm of the gradient, before clipping.
    pub grad_norm: f32,
}

/// A value that stopped a step before its update.
#[derive(Debug, PartialEq)]
pub(crate) struct NonFinite {
    pub quantity: &'static str,
    pub value: f32,
}

/// A step whose work is queued, and whose outcome the host reads with [`Session::settle`].
pub(crate) struct QueuedStep {
    /// The step, counted from 1.
    pub done: usize,
    /// Its learning rate.
    pub lr: f32,
    /// When its work was queued: the log's throughput windows end here, not when the outcome
    /// is read (a step read late and the next, read at once to save, would share one instant).
    pub queued_at: Instant,
    verdict: Verdict,
}

/// Where a queued step's outcome is.
enum Verdict {
    /// Known on the host already (data parallel decides there).
    Known(StepOutcome),
    /// In its step guard, on the device.
    Guarded(StepGuard),
}

impl Session<'_> {
    /// Queues step `done` (counted from 1) at learning rate `lr`, after the `previous` queued
    /// step, without waiting for the device ([`Session::settle`] reads the outcome). Data
    /// parallel decides on the host at once: a [`Diverged`] error, with the update not
    /// applied, when the loss or the gradient norm is not finite.
    pub fn queue_step(&mut self, done: usize, lr: f32, previous: Option<&QueuedStep>) -> Result<QueuedStep> {
        let verdict = if self.data_parallel.is_some() {
            let loss = self.accumulate_gradients_data_parallel(done)?;
            let outcome = finite_update(self.optimizer.as_mut(), loss, self.config.grad_clip, lr)?
                .map_err(|bad| self.diverged(bad.quantity, bad.value, done))?;
            if let Some(data_parallel) = &self.data_parallel {
                data_parallel.after_update(self.optimizer.parameters(), done)?;
            }
            Verdict::Known(outcome)
        } else {
            let previous = previous.and_then(|step| match &step.verdict {
                Verdict::Guarded(guard) => Some(guard),
                Verdict::Known(_) => None,
            });
            #[cfg(feature = "cuda")]
            if self.config.cuda_graph {
                let guard = self.queue_graph_step(lr, previous)?;
                return Ok(QueuedStep { done, lr, queued_at: Instant::now(), verdict: Verdict::Guarded(guard) });
            }
            let loss_sum = self.accumulate_gradients()?;
            let micro_batches = self.config.grad_accum as f32;
            let clip = self.config.grad_clip;
            Verdict::Guarded(guarded_update(self.optimizer.as_mut(), &loss_sum, micro_batches, clip, lr, previous)?)
        };
        Ok(QueuedStep { done, lr, queued_at: Instant::now(), verdict })
    }

    /// The outcome of a queued step (on a GPU, a wait for its guard, not for the work queued
    /// after it); a [`Diverged`] error naming the step when its loss or gradient norm is not
    /// finite (its update, and any queued after it, were not applied).
    pub fn settle(&self, step: &QueuedStep) -> Result<StepOutcome> {
        match &step.verdict {
            Verdict::Known(outcome) => Ok(*outcome),
            Verdict::Guarded(guard) => {
                read_verdict(guard)?.map_err(|bad| self.diverged(bad.quantity, bad.value, step.done).into())
            }
        }
    }

    /// Validation loss after step `done`; [`Diverged`] when it is not finite.
    pub fn validation_loss(&mut self, done: usize) -> Result<f32> {
        let Some(validation) = self.validation.as_mut() else {
            return Ok(f32::NAN);
        };
        let loss = mean_loss(&self.model, validation, self.config.eval_batches)?;
        if loss.is_finite() {
            Ok(loss)
        } else {
            Err(self.diverged("validation loss", loss, done).into())
        }
    }

    /// Whether the run has a validation file.
    pub fn has_validation(&self) -> bool {
        self.validation.is_some()
    }

    fn diverged(&self, quantity: &str, value: f32, step: usize) -> Diverged {
        Diverged { quantity: quantity.into(), value, step, checkpoint: self.checkpoint_path.clone() }
    }

    /// Forward and backward passes over `grad_accum` micro-batches, gradients summed (each
    /// loss scaled by `1 / (grad_accum × world_size)`). Returns the micro-batches' losses,
    /// summed where they were computed (no wait for the device). Each micro-batch's inputs
    /// and targets are uploaded once, as [`Tokens`] every op of its step reads.
    fn accumulate_gradients(&mut self) -> Result<Tensor> {
        let micro_batches = (self.config.grad_accum * self.config.world_size) as f32;
        let device = self.config.device;
        let mut tokens = Vec::with_capacity(self.config.grad_accum);
        for batch in self.next_batches()? {
            tokens.push((Tokens::new(&batch.inputs, device)?, Tokens::labels(&batch.targets, device)?));
        }
        loss_and_gradients(&self.model, &tokens, self.config.batch_size, self.config.seq_len, micro_batches)
    }

    /// The step as a CUDA graph ([`super::graph`]): made at the first step, after `previous`.
    #[cfg(feature = "cuda")]
    fn queue_graph_step(&mut self, lr: f32, previous: Option<&StepGuard>) -> Result<StepGuard> {
        let batches = self.next_batches()?;
        let graph = match &mut self.graph {
            Some(graph) => graph,
            None => {
                let shape = super::graph::StepShape {
                    batch: self.config.batch_size,
                    seq: self.config.seq_len,
                    micro_batches: self.config.grad_accum as f32,
                    max_norm: max_norm(self.config.grad_clip),
                };
                let graph = super::graph::GraphStep::new(&self.model, self.config.device, shape, &batches, previous)?;
                self.graph.insert(graph)
            }
        };
        graph.run(&self.model, self.optimizer.as_mut(), &batches, lr)
    }

    /// The step's `grad_accum` micro-batches.
    fn next_batches(&mut self) -> Result<Vec<TokenBatch>> {
        (0..self.config.grad_accum).map(|_| self.sampler.next_batch()).collect()
    }

    /// [`Session::accumulate_gradients`], then the gradients and the rank's summed loss
    /// summed over every rank in one all-reduce. Returns the mean loss of the step's global
    /// batch.
    fn accumulate_gradients_data_parallel(&mut self, done: usize) -> Result<f32> {
        let sum = self.accumulate_gradients()?;
        let micro_batches = (self.config.grad_accum * self.config.world_size) as f32;
        let data_parallel = self.data_parallel.as_mut().expect("called for data parallel runs");
        let total = data_parallel.all_reduce_gradients(self.optimizer.parameters(), &sum, done)?;
        Ok(total / micro_batches)
    }
}

/// Clips the gradients to `grad_clip` (0 disables) and queues the update at `lr`, clearing
/// the gradients, all under a step guard made from the step's summed loss `loss_sum` and
/// `micro_batches` (and the `previous` step's guard): no update when the mean loss or the
/// gradient norm is not finite, or when the previous step was not updated (the parameters and
/// moments are left as they were). Returns the guard, unread ([`read_verdict`]).
pub(crate) fn guarded_update(
    optimizer: &mut dyn Optimizer,
    loss_sum: &Tensor,
    micro_batches: f32,
    grad_clip: f32,
    lr: f32,
    previous: Option<&StepGuard>,
) -> Result<StepGuard> {
    let guard = step_guard(optimizer.parameters(), loss_sum, micro_batches, max_norm(grad_clip), previous)?;
    optimizer.step_guarded(lr, &guard)?;
    optimizer.zero_grad();
    Ok(guard)
}

/// A guarded step's outcome, read from its guard; the inner `Err` names the first non-finite value.
pub(crate) fn read_verdict(guard: &StepGuard) -> Result<Result<StepOutcome, NonFinite>> {
    let values = guard.read()?;
    if !values.loss.is_finite() {
        return Ok(Err(NonFinite { quantity: "loss", value: values.loss }));
    }
    if !values.grad_norm.is_finite() {
        return Ok(Err(NonFinite { quantity: "gradient norm", value: values.grad_norm }));
    }
    Ok(Ok(StepOutcome { loss: values.loss, grad_norm: values.grad_norm }))
}

/// Checks `loss` and the gradient norm, then clips to `grad_clip` (0 disables) and applies
/// the update at `lr`, clearing the gradients. The inner `Err` names the first non-finite
/// value; the parameters, the optimizer state and the gradients are then left as they were.
pub(crate) fn finite_update(
    optimizer: &mut dyn Optimizer,
    loss: f32,
    grad_clip: f32,
    lr: f32,
) -> Result<Result<StepOutcome, NonFinite>> {
    if !loss.is_finite() {
        return Ok(Err(NonFinite { quantity: "loss", value: loss }));
    }
    // A non-finite norm leaves the gradients unscaled (clip_grad_norm skips them).
    let grad_norm = clip_grad_norm(optimizer.parameters(), max_norm(grad_clip))?;
    if !grad_norm.is_finite() {
        return Ok(Err(NonFinite { quantity: "gradient norm", value: grad_norm }));
    }
    optimizer.step(lr)?;
    optimizer.zero_grad();
    Ok(Ok(StepOutcome { loss, grad_norm }))
}

#[cfg(test)]
mod tests {
    use autograd::Var;
    use nn::optim::{Adam, AdamConfig};
    use nn::NamedParameter;
    use tensor::Tensor;

    use super::*;

    fn optimizer_with_grad(grad: Vec<f32>) -> (Adam, Var) {
        let var = Var::parameter(Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3]).unwrap());
        var.set_grad(Some(Tensor::from_vec(grad, &[3]).unwrap()));
        let params = vec![NamedParameter { name: "w".into(), var: var.clone() }];
        (Adam::new(params, AdamConfig::default()), var)
    }

    #[test]
    fn a_nan_gradient_norm_stops_the_step_before_the_update() {
        let (mut adam, var) = optimizer_with_grad(vec![0.5, f32::NAN, 0.5]);
        let stopped = finite_update(&mut adam, 2.5, 1.0, 0.1).unwrap().unwrap_err();
        assert_eq!(stopped.quantity, "gradient norm");
        assert!(stopped.value.is_nan());
        assert_eq!(var.value().to_vec(), [1.0, 2.0, 3.0], "the update must not be applied");
        assert!(adam.state().iter().all(|(_, t)| t.to_vec().iter().all(|v| v.is_finite())));
    }

    #[test]
    fn an_infinite_loss_stops_before_the_norm_and_the_update() {
        let (mut adam, var) = optimizer_with_grad(vec![0.5, 0.5, 0.5]);
        let stopped = finite_update(&mut adam, f32::INFINITY, 0.0, 0.1).unwrap().unwrap_err();
        assert_eq!(stopped, NonFinite { quantity: "loss", value: f32::INFINITY });
        assert_eq!(var.value().to_vec(), [1.0, 2.0, 3.0]);
    }

    #[test]
    fn a_finite_step_clips_updates_and_clears_the_gradient() {
        let (mut adam, var) = optimizer_with_grad(vec![3.0, 4.0, 0.0]);
        let outcome = finite_update(&mut adam, 2.5, 1.0, 0.1).unwrap().unwrap();
        assert_eq!((outcome.loss, outcome.grad_norm), (2.5, 5.0));
        assert_ne!(var.value().to_vec(), [1.0, 2.0, 3.0]);
        assert!(var.grad().is_none_or(|g| g.to_vec().iter().all(|&v| v == 0.0)));
    }

    /// The guarded update (one process) decides as [`finite_update`] does, and clips and
    /// updates to the same bits.
    #[test]
    fn the_guarded_update_stops_clips_and_updates_as_the_host_check_does() {
        let loss_sum = |v: f32| Tensor::from_vec(vec![v], &[1]).unwrap();
        let guarded = |adam: &mut Adam, loss: f32, clip: f32, previous: Option<&StepGuard>| {
            let guard = guarded_update(adam, &loss_sum(loss), 2.0, clip, 0.1, previous).unwrap();
            (read_verdict(&guard).unwrap(), guard)
        };
        let (mut adam, var) = optimizer_with_grad(vec![0.5, f32::NAN, 0.5]);
        let (stopped, _) = guarded(&mut adam, 5.0, 1.0, None);
        assert_eq!(stopped.unwrap_err().quantity, "gradient norm");
        assert_eq!(var.value().to_vec(), [1.0, 2.0, 3.0], "the update must not be applied");
        let (mut adam, var) = optimizer_with_grad(vec![0.5, 0.5, 0.5]);
        let (stopped, bad_guard) = guarded(&mut adam, f32::INFINITY, 0.0, None);
        assert_eq!(stopped.unwrap_err(), NonFinite { quantity: "loss", value: f32::INFINITY });
        assert_eq!(var.value().to_vec(), [1.0, 2.0, 3.0]);
        // A finite step queued after the bad one is not applied either.
        var.set_grad(Some(Tensor::from_vec(vec![0.5, 0.5, 0.5], &[3]).unwrap()));
        let (after, _) = guarded(&mut adam, 5.0, 0.0, Some(&bad_guard));
        assert_eq!(after.unwrap().loss, 2.5);
        assert_eq!(var.value().to_vec(), [1.0, 2.0, 3.0], "no update after a skipped step");
        for clip in [1.0, 0.0] {
            let (mut host, host_var) = optimizer_with_grad(vec![3.0, 4.0, 0.0]);
            let want = finite_update(&mut host, 2.5, clip, 0.1).unwrap().unwrap();
            let (mut adam, guarded_var) = optimizer_with_grad(vec![3.0, 4.0, 0.0]);
            let (got, _) = guarded(&mut adam, 5.0, clip, None);
            let got = got.unwrap();
            assert_eq!((got.loss, got.grad_norm), (want.loss, want.grad_norm));
            assert_eq!(guarded_var.value().to_vec(), host_var.value().to_vec(), "clip {clip}");
            assert!(guarded_var.grad().is_none_or(|g| g.to_vec().iter().all(|&v| v == 0.0)));
        }
    }
}
