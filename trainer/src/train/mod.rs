//! The language-model training loop: data, model, optimizer, schedule, gradient
//! accumulation and clipping, periodic validation, metrics, checkpoints, exact resume,
//! and a hard stop on divergence that keeps the last good checkpoint.
//!
//! - [`setup`]: every input checked at start-up (token files: format, vocabulary, one window),
//!   the model, optimizer and sampler, and the checkpoint's state on `--resume`;
//! - [`resume`]: which settings a resumed run takes from its directory, and which changes
//!   are refused or warned about;
//! - [`step`]: one optimizer step, stopped before the update when the loss or the gradient
//!   norm is not finite ([`accumulate`]: its micro-batches' forward and backward passes);
//! - [`log`]: the progress bar, the printed lines and the `metrics.jsonl` rows;
//! - [`evaluate`]: validation loss on sequential windows;
//! - [`data_parallel`]: several ranks as one run (the gradient all-reduce, the checks that
//!   keep the ranks together);
//! - [`graph`]: the step captured once as a CUDA graph and replayed (`--cuda-graph`).
//!
//! On a GPU (`config.device`), the model is built and initialised on the host (the same
//! weights as a CPU run of the same seed), then its parameters move to the device, where
//! the optimizer keeps its state too. A micro-batch's token ids and targets go to the device
//! once each (`tensor::Tokens`), read there by every op; each step's loss and gradient norm
//! come back to the host once, read after the next step is queued (the finiteness checks,
//! one step late: a step after a non-finite one is skipped on the device); checkpoints
//! download parameters and state.

mod accumulate;
mod data_parallel;
mod evaluate;
#[cfg(feature = "cuda")]
pub mod graph;
mod log;
pub mod resume;
mod setup;
pub(crate) mod step;

use std::path::{Path, PathBuf};

use anyhow::Result;
use models::llama::LlamaConfig;
use tensor::Device;

use crate::checkpoint::NonFiniteValue;
use crate::config::TrainConfig;
use crate::dist::World;

pub use evaluate::{evaluate, open_eval_data};

use log::StepLog;
use setup::Session;
use step::QueuedStep;

/// The checkpoint inside the run directory (weights, optimizer state, step, data position
/// and both configs).
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";
/// The run's training config inside the run directory (reusable with `--config`).
pub const CONFIG_FILE: &str = "config.json";
/// The per-step metrics inside the run directory, one [`crate::metrics::StepMetrics`] row a line.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What a finished run reports.
#[derive(Debug)]
pub struct TrainReport {
    /// Steps of the whole run (the configured `steps`).
    pub steps: usize,
    /// Steps this call ran: 0 when a resumed checkpoint was already at the last step.
    pub steps_run: usize,
    /// Training loss of the first step run by this call.
    pub first_loss: f32,
    /// Training loss of the last step run by this call (NaN when it ran none).
    pub final_loss: f32,
    /// The last validation loss measured, when there is a validation set.
    pub final_val_loss: Option<f32>,
    /// Training tokens of this call's steps over `seconds` (validation and saving included).
    pub tokens_per_second: f64,
    /// Wall time of this call's training loop.
    pub seconds: f64,
    /// The run's `checkpoint.safetensors`.
    pub checkpoint: PathBuf,
    /// The run's `metrics.jsonl`.
    pub metrics: PathBuf,
}

/// The error a run stops with when a loss, the gradient norm or an updated parameter turns
/// NaN or infinite: nothing of that step is applied or saved, and the checkpoint named is the
/// last good one, left untouched. Callers that compare runs (`transponder compare`) downcast
/// to it to record a divergence instead of failing.
#[derive(Debug, thiserror::Error)]
#[error("{quantity} is {value} at step {step}: stopping; the last good checkpoint is kept at {}", checkpoint.display())]
pub struct Diverged {
    /// What was not finite: `loss`, `gradient norm`, `validation loss`, or a tensor's name.
    pub quantity: String,
    /// The non-finite value (NaN or ±inf).
    pub value: f32,
    /// The step, counted from 1 as the log counts them.
    pub step: usize,
    /// The last good checkpoint, left untouched.
    pub checkpoint: PathBuf,
}

/// The model config a training config asks for, with the data's vocabulary.
pub fn model_config(config: &TrainConfig, vocab_size: usize) -> Result<LlamaConfig> {
    let mut model = LlamaConfig::preset(&config.model)?;
    if config.d_model > 0 {
        model = model.with_d_model(config.d_model);
    }
    model.vocab_size = vocab_size;
    model.seq_len = config.seq_len;
    model.variant = config.variant.clone();
    model.d_basis = config.d_basis;
    model.d_ctx = config.d_ctx;
    model.ccl_mode = config.ccl_mode.clone();
    model.ccl_ablation = config.ccl_ablation.clone();
    model.rank = config.rank;
    model.coverage = config.coverage.clone();
    model.post_ln = config.post_ln;
    model.phi = config.phi.clone();
    model.validate()?;
    Ok(model)
}

/// Trains as `config` says; with `resume`, continues from the run directory's checkpoint
/// (same weights, optimizer state, data position and step: the losses continue exactly).
/// A resumed `config` is checked against the checkpoint's ([`resume`]): changes that would
/// not fit it are refused, changes that alter the run's course are printed as warnings.
///
/// Launched as one rank of several (the environment of `transponder launch`, torchrun, srun
/// or mpirun: [`World::from_env`]), it trains data parallel: `config.batch_size` and
/// `grad_accum` are then per rank, rank 0 alone prints and writes the run's files, and a
/// GPU run takes the device of its local rank.
pub fn train(config: &TrainConfig, resume: bool) -> Result<TrainReport> {
    // Declared first, so it runs last: the run's buffers are freed, not kept for shapes
    // that will not come again.
    let _release_pool = tensor::pool::ReleaseOnDrop;
    let world = World::from_env()?;
    let mut config = config.for_world(world.as_ref().map_or(1, |w| w.world_size))?;
    if let Some(world) = &world {
        config.device = rank_device(config.device, world)?;
        if !world.is_leader() {
            crate::console::set_quiet();
        }
    }
    let mut session = Session::start(&config, resume, world)?;
    let result = run_steps(&mut session);
    match (result, session.data_parallel.take()) {
        (Ok(report), Some(data_parallel)) => {
            data_parallel.finish()?;
            Ok(report)
        }
        (Err(error), Some(data_parallel)) => {
            data_parallel.report_failure(&format!("{error:#}"));
            Err(error)
        }
        (result, None) => result,
    }
}

/// The GPU of a rank: `--device cuda` (GPU 0) means GPU `LOCAL_RANK`, round-robin when the
/// node has fewer GPUs than ranks (the emulated device is one GPU: every rank, a process of its
/// own, gets its own emulated device 0). NCCL before 2.30 refuses two ranks on one GPU.
fn rank_device(device: Device, world: &World) -> Result<Device> {
    if device != Device::Cuda(0) {
        return Ok(device);
    }
    crate::device::ensure_available(device)?;
    let gpus = crate::device::gpu_count().max(1);
    if world.is_leader() && world.local_world_size > gpus {
        crate::console::warn(format_args!(
            "{} ranks on this node and {gpus} GPU(s): local rank r uses GPU r mod {gpus}",
            world.local_world_size
        ));
    }
    Ok(Device::Cuda(world.local_rank % gpus))
}

/// The training loop of a started session, from its first step to its last.
fn run_steps(session: &mut Session) -> Result<TrainReport> {
    let metrics_path = session.metrics_path();
    let mut log =
        StepLog::start(session.config, session.start_step, session.is_leader().then_some(metrics_path.as_path()))?;
    run_and_log_steps(session, &mut log).inspect_err(|_| log.abandon())?;
    Ok(log.finish(session.checkpoint_path.clone()))
}

/// Runs and logs every step. A step's outcome is read after the next step is queued, so the
/// device runs one step while the host prepares the next; a step that validates or saves
/// (the last one does) is read at once, before its validation and its checkpoint.
fn run_and_log_steps(session: &mut Session, log: &mut StepLog) -> Result<()> {
    let config = session.config;
    let mut queued: Option<QueuedStep> = None;
    for done in session.start_step + 1..=config.steps {
        if let Some(data_parallel) = &session.data_parallel {
            data_parallel.set_step(done);
        }
        let lr = session.schedule.lr_at(done - 1, config.lr);
        let step = session.queue_step(done, lr, queued.as_ref())?;
        if let Some(previous) = queued.take() {
            let outcome = session.settle(&previous)?;
            log.record(&previous, outcome, None)?;
        }
        let is_last = done == config.steps;
        let evaluates =
            session.has_validation() && ((config.eval_every > 0 && done % config.eval_every == 0) || is_last);
        let saves = (config.save_every > 0 && done % config.save_every == 0) || is_last;
        if !(evaluates || saves) {
            queued = Some(step);
            continue;
        }
        let outcome = session.settle(&step)?;
        let val_loss = if evaluates { Some(session.validation_loss(done)?) } else { None };
        log.record(&step, outcome, val_loss)?;
        if saves {
            session.save_everywhere(done)?;
        }
    }
    Ok(())
}

/// A refused save of non-finite values is a divergence (the update before it overflowed);
/// `checkpoint` is the last good one, left as it was.
pub(crate) fn diverged_on_save(error: anyhow::Error, step: usize, checkpoint: &Path) -> anyhow::Error {
    match error.downcast::<NonFiniteValue>() {
        Ok(bad) => {
            Diverged { quantity: bad.tensor, value: bad.value, step, checkpoint: checkpoint.to_path_buf() }.into()
        }
        Err(other) => other,
    }
}
