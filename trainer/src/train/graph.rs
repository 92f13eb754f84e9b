//! `--cuda-graph`: the training step of a single-GPU run captured once as a CUDA graph
//! (`kernels::cuda::graph`) and replayed at every later step, so the host queues one graph
//! launch per step instead of each of its few hundred launches, cuBLAS calls and memsets.
//!
//! What changes from step to step lives in device buffers the graph reads at fixed
//! addresses, which the host rewrites before each replay with ordinary copies: the
//! micro-batches' token ids ([`Tokens::refill`]), the optimizer's per-step constants
//! ([`Optimizer::stage`]) and the step guard ([`GraphGuard`], which the step rewrites in
//! place, each verdict after the one before). After each replay the guard's copy to the
//! host is queued, and the training loop reads it one step late, as it does eagerly.
//!
//! The first graph step runs eagerly, as any first step (the optimizer's state and the other
//! buffers a run keeps are made there, in the device's shared memory); the second runs
//! eagerly in the graph's memory pool (after the device's shared memory that no buffer uses
//! is returned to the driver), which leaves there every block the capture asks for, where
//! the capture will ask for it (a steady-state step frees all it allocates, and a pool
//! places a run's requests where its last run placed them); the third is captured, then
//! replayed; every later step is replayed. All of them queue the same kernels on the same data in the same
//! order as an eager step, so a run logs the losses of the eager run bit for bit
//! (`tests/cuda_train.rs`).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use kernels::cuda::{CapturedGraph, CudaDevice, GraphPool};
use models::llama::Llama;
use nn::optim::{GraphGuard, Optimizer, StepGuard};
use tensor::{Device, Tokens};

use super::accumulate::loss_and_gradients;
use crate::data::sampler::TokenBatch;

/// The shape of a step: what every replay of it computes over.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// What each micro-batch's loss is divided by (the micro-batches of the step), and the
    /// step's summed loss too, for the guard's mean.
    pub micro_batches: f32,
    /// The gradient norm the step clips to (`f32::INFINITY`: no clipping).
    pub max_norm: f32,
}

/// A training step replayed as a CUDA graph: its static inputs, its guard, and where it is
/// in its life (see the module documentation).
pub struct GraphStep {
    dev: Arc<CudaDevice>,
    vocab: usize,
    shape: StepShape,
    /// Each micro-batch's inputs and targets, refilled at every step.
    tokens: Vec<(Tokens, Tokens)>,
    guard: GraphGuard,
    phase: Option<Phase>,
}

/// The four lives of a graph step.
enum Phase {
    /// Next: an eager step, which makes what the run keeps from step to step.
    Warm(GraphPool),
    /// Next: the eager step in the pool.
    Rehearse(GraphPool),
    /// Next: the capture, then its first replay.
    Capture(GraphPool),
    /// Every step from now: a replay.
    Replay(Box<CapturedGraph>),
}

impl GraphStep {
    /// A graph step of `model` (on `device`, a GPU) over micro-batches like `first` (their
    /// count and length), after the `previous` step's guard (none for a run's first step).
    pub fn new(
        model: &Llama,
        device: Device,
        shape: StepShape,
        first: &[TokenBatch],
        previous: Option<&StepGuard>,
    ) -> Result<GraphStep> {
        let Device::Cuda(ordinal) = device else { bail!("--cuda-graph needs a CUDA device, not {device:?}") };
        let dev = tensor::cuda::device(ordinal)?;
        let mut tokens = Vec::with_capacity(first.len());
        for batch in first {
            tokens.push((Tokens::new(&batch.inputs, device)?, Tokens::labels(&batch.targets, device)?));
        }
        let phase = Some(Phase::Warm(dev.graph_pool()));
        let guard = GraphGuard::after(previous, device)?;
        Ok(GraphStep { dev, vocab: model.config.vocab_size, shape, tokens, guard, phase })
    }

    /// One step over `batches` at learning rate `lr`: the ids refilled and the update staged,
    /// then the step run in the pool, captured and replayed, or replayed. Returns the step's
    /// guard, its copy to the host queued.
    pub fn run(
        &mut self,
        model: &Llama,
        optimizer: &mut dyn Optimizer,
        batches: &[TokenBatch],
        lr: f32,
    ) -> Result<StepGuard> {
        const OP: &str = "CUDA graph step";
        if batches.len() != self.tokens.len() {
            bail!("{OP}: {} micro-batches, the graph was made for {}", batches.len(), self.tokens.len());
        }
        // A replay runs no op, so no op checks the ids: they are checked here.
        for ((inputs, targets), batch) in self.tokens.iter_mut().zip(batches) {
            inputs.refill(&batch.inputs)?;
            targets.refill(&batch.targets)?;
            inputs.check_below(OP, self.vocab)?;
            targets.check_below(OP, self.vocab)?;
        }
        optimizer.stage(lr)?;
        let (shape, tokens, guard) = (self.shape, &self.tokens, &mut self.guard);
        let mut step = || step_body(model, optimizer, tokens, shape, guard);
        self.phase = Some(match self.phase.take().context("an earlier graph step failed")? {
            Phase::Warm(pool) => {
                step()?;
                // What this step freed would sit unused beside the pool from now on (every
                // later step allocates in the pool): back to the driver with it.
                self.dev.release_cached_memory();
                Phase::Rehearse(pool)
            }
            Phase::Rehearse(pool) => {
                self.dev.with_graph_pool(&pool, step)?;
                Phase::Capture(pool)
            }
            Phase::Capture(pool) => {
                let (graph, ()) = self.dev.capture(pool, step)?;
                let copies = graph.work().device_copies;
                if copies > 0 {
                    bail!(
                        "{OP}: the captured step made {copies} device copies, which a replay would repeat into \
                         the capture's buffers: something kept a view of a parameter or of the optimizer's \
                         state alive across the step"
                    );
                }
                self.dev.replay(&graph)?;
                Phase::Replay(Box::new(graph))
            }
            Phase::Replay(graph) => {
                self.dev.replay(&graph)?;
                Phase::Replay(graph)
            }
        });
        Ok(self.guard.queue_read()?)
    }

    /// The captured graph, once the step has been captured.
    pub fn graph(&self) -> Option<&CapturedGraph> {
        match &self.phase {
            Some(Phase::Replay(graph)) => Some(graph),
            _ => None,
        }
    }
}

/// The device work of one step (what a capture records): forward and backward of every
/// micro-batch, the guard rewritten in place, and the staged update under it.
fn step_body(
    model: &Llama,
    optimizer: &mut dyn Optimizer,
    tokens: &[(Tokens, Tokens)],
    shape: StepShape,
    guard: &mut GraphGuard,
) -> Result<()> {
    let loss_sum = loss_and_gradients(model, tokens, shape.batch, shape.seq, shape.micro_batches)?;
    let verdict = guard.update(optimizer.parameters(), &loss_sum, shape.micro_batches, shape.max_norm)?;
    optimizer.apply_staged(Some(&verdict))?;
    optimizer.zero_grad();
    Ok(())
}
