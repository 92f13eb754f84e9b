//! The language-model training loop: data, model, optimizer, schedule, gradient
//! accumulation and clipping, periodic validation, metrics, checkpoints, exact resume,
//! and a hard stop on a non-finite loss that keeps the last good checkpoint.
//!
//! On a GPU (`config.device`), the model is built and initialised on the host (the same
//! weights as a CPU run of the same seed), then its parameters move to the device, where
//! the optimizer keeps its state too. Token ids stay host slices (the embedding and the
//! loss take them as such); each step's loss comes back to the host once, after the
//! backward pass, for the non-finite check; checkpoints download parameters and state.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use autograd::no_grad;
use indicatif::{ProgressBar, ProgressStyle};
use models::llama::{Llama, LlamaConfig};
use nn::optim::{clip_grad_norm, Adam, AdamConfig, Optimizer, RowRule, Sgd, SparseRows};
use nn::{Module, NamedParameter};
use tensor::Device;

use crate::checkpoint::{self, CheckpointMeta};
use crate::config::TrainConfig;
use crate::data::sampler::{BatchSampler, RandomSampler, SequentialSampler};
use crate::data::token_file::{check_vocab, TokenFile};
use crate::device::{device_label, ensure_available, MatmulPrecision};
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::prepare::prepare_once;
use crate::safetensors_io::atomic_write;
use crate::tokenizer::Tokenizer;

/// File names inside the run directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What a finished run reports.
#[derive(Debug)]
pub struct TrainReport {
    pub steps: usize,
    pub first_loss: f32,
    pub final_loss: f32,
    pub final_val_loss: Option<f32>,
    pub tokens_per_second: f64,
    pub seconds: f64,
    pub checkpoint: PathBuf,
    pub metrics: PathBuf,
}

/// The error a run stops with when the loss turns NaN or infinite; the checkpoint named is
/// the last good one, left untouched. Callers that compare runs (`transponder compare`)
/// downcast to it to record a divergence instead of failing.
#[derive(Debug, thiserror::Error)]
#[error("loss is {value} at step {step}: stopping; the last good checkpoint is kept at {}", checkpoint.display())]
pub struct NonFiniteLoss {
    pub value: f32,
    /// The 0-based step whose loss was not finite.
    pub step: usize,
    pub checkpoint: PathBuf,
}

/// Token files for training and (optionally) validation, preparing them from the text
/// corpus into `out_dir/data` on first use.
fn resolve_data(config: &TrainConfig, tokenizer: &Tokenizer) -> Result<(PathBuf, Option<PathBuf>)> {
    if let Some(train) = &config.train_data {
        return Ok((train.clone(), config.val_data.clone()));
    }
    let data_dir = config.out_dir.join("data");
    let (train, val, report) = prepare_once(&config.text, tokenizer, &data_dir)
        .with_context(|| format!("preparing {}", config.text.display()))?;
    if let Some(report) = report {
        println!(
            "prepared {} ({} train + {} val tokens, {} tokenizer) into {}",
            config.text.display(),
            report.train_tokens,
            report.val_tokens,
            report.tokenizer,
            data_dir.display()
        );
    }
    Ok((train, Some(val)))
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

/// Per-token tables (`[V, ...]`, one row per token id): the `per-token` transforms' `M` and
/// the `token-scale` `E`. The token embedding is left to the dense optimizer.
fn is_token_table(name: &str) -> bool {
    name.ends_with(".per_token.table") || name.ends_with(".token_scale.weight")
}

/// The configured optimizer. Per-token tables get row-sparse updates ([`SparseRows`]) when
/// that is exact (SGD without momentum and decay) or when `lazy_tables` asks for it, on the
/// CPU only (on a GPU the dense update, which the exact row-sparse one equals, runs instead).
fn make_optimizer(config: &TrainConfig, model: &Llama) -> (Box<dyn Optimizer>, Option<&'static str>) {
    let adam = AdamConfig {
        beta2: config.beta2,
        weight_decay: config.weight_decay,
        decoupled: config.optimizer == "adamw",
        ..AdamConfig::default()
    };
    let rule = match config.optimizer.as_str() {
        "sgd" => RowRule::Sgd { momentum: config.momentum, weight_decay: config.weight_decay },
        _ => RowRule::Adam(adam),
    };
    let build = |params: Vec<NamedParameter>| -> Box<dyn Optimizer> {
        match rule {
            RowRule::Sgd { momentum, weight_decay } => Box::new(Sgd::new(params, momentum, weight_decay, false)),
            RowRule::Adam(adam) => Box::new(Adam::new(params, adam)),
        }
    };
    let (tables, dense): (Vec<_>, Vec<_>) = model.named_parameters().into_iter().partition(|p| is_token_table(&p.name));
    if tables.is_empty() || !(rule.is_exact() || config.lazy_tables) || config.device != Device::Cpu {
        return (build(model.named_parameters()), None);
    }
    let how = if rule.is_exact() { "row-sparse (exact: plain SGD)" } else { "row-sparse (lazy: unseen rows frozen)" };
    (Box::new(SparseRows::new(build(dense), tables, rule)), Some(how))
}

fn make_sampler(config: &TrainConfig, file: TokenFile) -> Result<Box<dyn BatchSampler>> {
    Ok(match config.sampling.as_str() {
        "sequential" => Box::new(SequentialSampler::new(file, config.batch_size, config.seq_len)?),
        _ => Box::new(RandomSampler::new(file, config.batch_size, config.seq_len, config.seed)?),
    })
}

/// Mean validation loss over the first `batches` sequential windows of `path` (on the
/// model's device).
pub fn evaluate(model: &Llama, path: &Path, batch_size: usize, seq_len: usize, batches: usize) -> Result<f32> {
    let file = TokenFile::open(path)?;
    let mut sampler = SequentialSampler::new(file, batch_size, seq_len)?;
    let batches = batches.min(sampler.batches_per_pass()).max(1);
    let mut total = 0.0f64;
    for _ in 0..batches {
        let batch = sampler.next_batch()?;
        let loss = no_grad(|| model.loss(&batch.inputs, &batch.targets, batch_size, seq_len))?;
        total += loss.value().to_host()?.item()? as f64;
    }
    Ok((total / batches as f64) as f32)
}

/// Trains as `config` says; with `resume`, continues from the run directory's checkpoint
/// (same weights, optimizer state, data position and step: the losses continue exactly).
pub fn train(config: &TrainConfig, resume: bool) -> Result<TrainReport> {
    // Declared first, so it runs last: the run's buffers are freed, not kept for shapes
    // that will not come again.
    let _release_pool = tensor::pool::ReleaseOnDrop;
    config.validate()?;
    ensure_available(config.device)?;
    let _precision = MatmulPrecision::set(config.device, config.bf16)?;
    std::fs::create_dir_all(&config.out_dir).with_context(|| format!("creating {}", config.out_dir.display()))?;
    let checkpoint_path = config.out_dir.join(CHECKPOINT_FILE);
    let tokenizer = Tokenizer::from_name(&config.tokenizer)?;
    let (train_path, val_path) = resolve_data(config, &tokenizer)?;
    let train_file = TokenFile::open(&train_path)?;
    check_vocab(&train_file, tokenizer.vocab_size())?;

    let model_config = model_config(config, tokenizer.vocab_size())?;
    let model = Llama::new(&model_config, config.seed)?;
    let (mut optimizer, table_updates) = make_optimizer(config, &model);
    let mut sampler = make_sampler(config, train_file)?;
    let mut start_step = 0;
    if resume {
        let saved = checkpoint::load(&checkpoint_path)?;
        checkpoint::load_weights(&model, &saved.weights)?;
        optimizer.load_state(&saved.optimizer_state)?;
        sampler.import_state(&saved.sampler_state)?;
        start_step = saved.step;
        println!("resumed from {} at step {start_step}", checkpoint_path.display());
    }
    model.to_device(config.device)?;
    let train_json = serde_json::to_string_pretty(config)?;
    let model_json = serde_json::to_string_pretty(&model_config)?;
    atomic_write(&config.out_dir.join(CONFIG_FILE), train_json.as_bytes())?;
    let mut metrics = MetricsWriter::open(&config.out_dir.join(METRICS_FILE))?;
    println!(
        "training {} ({}) with {} parameters for {} steps: batch {} x {} tokens, {} optimizer, lr {}",
        config.model,
        config.variant,
        model.num_parameters(),
        config.steps,
        config.batch_size * config.grad_accum,
        config.seq_len,
        config.optimizer,
        config.lr
    );
    if let Some(how) = table_updates {
        println!("per-token tables: {how} updates");
    }
    if config.device != Device::Cpu {
        let precision = if config.bf16 { "bf16 matrix products, f32 master weights" } else { "f32" };
        println!("device {} ({precision})", device_label(config.device));
    }

    let schedule = config.schedule();
    let tokens_per_step = config.batch_size * config.seq_len * config.grad_accum;
    let progress = ProgressBar::new(config.steps as u64).with_position(start_step as u64);
    progress.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}").context("progress bar template")?,
    );
    let started = Instant::now();
    let (mut first_loss, mut last_loss, mut last_val) = (None, f32::NAN, None);
    let mut window_start = (Instant::now(), start_step);
    let save = |optimizer: &dyn Optimizer, sampler: &dyn BatchSampler, step: usize| -> Result<()> {
        let meta = CheckpointMeta {
            step,
            sampler_state: &sampler.export_state(),
            train_config: &train_json,
            model_config: &model_json,
        };
        checkpoint::save(&checkpoint_path, &model, optimizer, &meta)
    };

    for step in start_step..config.steps {
        let lr = schedule.lr_at(step, config.lr);
        // The losses stay where they were computed until every backward pass is queued:
        // reading one waits for the device, which then idles while the host queues the rest.
        let mut losses = Vec::with_capacity(config.grad_accum);
        for _ in 0..config.grad_accum {
            let batch = sampler.next_batch()?;
            let loss = model.loss(&batch.inputs, &batch.targets, config.batch_size, config.seq_len)?;
            losses.push(loss.value());
            loss.mul_scalar(1.0 / config.grad_accum as f32)?.backward()?;
        }
        let mut loss_sum = 0.0f32;
        for value in losses {
            let value = value.to_host()?.item()?;
            if !value.is_finite() {
                progress.abandon();
                return Err(NonFiniteLoss { value, step, checkpoint: checkpoint_path.clone() }.into());
            }
            loss_sum += value;
        }
        let loss = loss_sum / config.grad_accum as f32;
        let done = step + 1;
        let is_last = done == config.steps;
        let evaluates = val_path.is_some() && ((config.eval_every > 0 && done % config.eval_every == 0) || is_last);
        let logs = done % config.log_every == 0 || is_last || evaluates;
        // Without clipping, the norm is only for the log (on a GPU it costs a sync per tensor).
        let grad_norm = if config.grad_clip > 0.0 {
            clip_grad_norm(optimizer.parameters(), config.grad_clip)?
        } else if logs {
            clip_grad_norm(optimizer.parameters(), f32::INFINITY)?
        } else {
            f32::NAN
        };
        optimizer.step(lr)?;
        optimizer.zero_grad();
        first_loss.get_or_insert(loss);
        last_loss = loss;
        progress.inc(1);

        let mut row = StepMetrics { step: done, loss, lr, grad_norm, ..StepMetrics::default() };
        if done % config.log_every == 0 || is_last {
            let elapsed = window_start.0.elapsed().as_secs_f64();
            row.tokens_per_second = ((done - window_start.1) * tokens_per_step) as f32 / elapsed as f32;
            window_start = (Instant::now(), done);
        }
        if let Some(val) = &val_path {
            if evaluates {
                let val_loss = evaluate(&model, val, config.batch_size, config.seq_len, config.eval_batches)?;
                row.val_loss = Some(val_loss);
                row.val_perplexity = Some(val_loss.exp());
                last_val = Some(val_loss);
            }
        }
        if logs {
            let val = row.val_loss.map(|v| format!(" | val loss {v:.4} (ppl {:.2})", v.exp())).unwrap_or_default();
            let speed = if row.tokens_per_second > 0.0 {
                format!(" | {:.0} tok/s", row.tokens_per_second)
            } else {
                String::new()
            };
            progress.suspend(|| {
                println!(
                    "step {done:>5}/{} | loss {loss:.4} | lr {lr:.2e} | grad norm {grad_norm:.3}{speed}{val}",
                    config.steps
                )
            });
            progress.set_message(format!("loss {loss:.4}"));
            metrics.write(&row)?;
        }
        if (config.save_every > 0 && done % config.save_every == 0) || is_last {
            save(optimizer.as_ref(), sampler.as_ref(), done)?;
        }
    }
    progress.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let steps_run = config.steps.saturating_sub(start_step);
    Ok(TrainReport {
        steps: config.steps,
        first_loss: first_loss.unwrap_or(f32::NAN),
        final_loss: last_loss,
        final_val_loss: last_val,
        tokens_per_second: (steps_run * tokens_per_step) as f64 / seconds.max(1e-9),
        seconds,
        checkpoint: checkpoint_path,
        metrics: metrics.path().to_path_buf(),
    })
}
