//! Everything a run holds between steps, built once: every input checked before anything is
//! written (token files: format, vocabulary, at least one window), the model, the optimizer,
//! the samplers, and on `--resume` the checkpoint's weights, optimizer state, data position
//! and step.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use models::llama::Llama;
use nn::optim::{Adam, AdamConfig, Optimizer, RowRule, Schedule, Sgd, SparseRows};
use nn::{Module, NamedParameter};
use tensor::Device;

use super::data_parallel::DataParallel;
use super::resume::check_continuation;
use super::{diverged_on_save, evaluate::open_eval_data, model_config, CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE};
use crate::checkpoint::{self, Checkpoint, CheckpointMeta};
use crate::config::{OptimizerKind, Sampling, ScheduleKind, TrainConfig};
use crate::data::sampler::{BatchSampler, RandomSampler, SequentialSampler, Shard};
use crate::data::token_file::{check_vocab, TokenFile};
use crate::device::{device_label, ensure_available, MatmulPrecision};
use crate::dist::World;
use crate::memory;
use crate::prepare::{corpus_cache_name, corpus_name, prepare_once};
use crate::run_dir::remove_if_present;
use crate::safetensors_io::atomic_write;
use crate::tokenizer::Tokenizer;

/// A run in progress: what [`super::train`] steps, evaluates and saves.
pub(super) struct Session<'a> {
    pub config: &'a TrainConfig,
    pub model: Llama,
    pub optimizer: Box<dyn Optimizer>,
    pub sampler: Box<dyn BatchSampler>,
    /// Sequential windows of the validation file, when there is one.
    pub validation: Option<SequentialSampler>,
    pub schedule: Schedule,
    pub checkpoint_path: PathBuf,
    /// Steps already done (the checkpoint's step on resume, else 0).
    pub start_step: usize,
    /// This rank's part in a data-parallel run (`None`: a single process).
    pub data_parallel: Option<DataParallel>,
    /// The step replayed as a CUDA graph (`--cuda-graph`), made at the run's first step.
    #[cfg(feature = "cuda")]
    pub graph: Option<super::graph::GraphStep>,
    train_json: String,
    model_json: String,
    /// bf16 matrix products for as long as the run lives.
    _precision: MatmulPrecision,
}

impl<'a> Session<'a> {
    /// Checks `config` and every input, builds the model, optimizer and samplers, restores
    /// the checkpoint on `resume`, writes `config.json` and prints what will run. Nothing is
    /// written to the run directory before every input has been checked. With a `world`,
    /// joins the data-parallel run first (rank 0 once it has prepared the data, so the others
    /// find it prepared) and checks that every rank starts from the same parameters.
    pub fn start(config: &'a TrainConfig, resume: bool, world: Option<World>) -> Result<Session<'a>> {
        config.validate()?;
        warn_about_warmup(config);
        ensure_available(config.device)?;
        let precision = MatmulPrecision::set(config.device, config.bf16)?;
        let checkpoint_path = config.out_dir.join(CHECKPOINT_FILE);
        let saved = if resume { Some(load_for_resume(config, &checkpoint_path)?) } else { None };

        let tokenizer = Tokenizer::from_name(&config.tokenizer)?;
        let vocab_size = tokenizer.vocab_size();
        let model_config = model_config(config, vocab_size)?;
        let bytes_per_parameter = match config.optimizer {
            OptimizerKind::Sgd => memory::SGD_BYTES_PER_PARAMETER,
            OptimizerKind::Adam | OptimizerKind::AdamW => memory::ADAM_BYTES_PER_PARAMETER,
        };
        let what = format!("{} ({})", config.model, config.variant);
        let activations = memory::llama_activations(&model_config, config.batch_size * config.seq_len);
        memory::check_fits(&what, memory::llama_parameters(&model_config), bytes_per_parameter, activations)?;
        let leader = world.as_ref().is_none_or(World::is_leader);
        let (mut world, mut data_parallel) = (world, None);
        if !leader {
            data_parallel = world.take().map(|w| DataParallel::join(w, config)).transpose()?;
        }
        let (train_path, val_path) = resolve_data(config, &tokenizer)?;
        if let Some(world) = world.take() {
            data_parallel = Some(DataParallel::join(world, config)?);
        }
        let shard =
            data_parallel.as_ref().map_or(Shard::WHOLE, |dp| Shard { rank: dp.rank(), world: config.world_size });
        let train_file = TokenFile::open_with(&train_path, config.data_format)?;
        check_vocab(&train_file, vocab_size)?;
        let mut sampler = make_sampler(config, train_file, shard)?;
        let validation = match &val_path {
            Some(path) => {
                Some(open_eval_data(path, config.data_format, vocab_size, config.batch_size, config.seq_len)?)
            }
            None => None,
        };

        let model = Llama::new(&model_config, config.seed)?;
        let (mut optimizer, table_updates) = make_optimizer(config, &model);
        let mut start_step = 0;
        if let Some(saved) = saved {
            checkpoint::load_weights(&model, &saved.weights)?;
            optimizer.load_state(&saved.optimizer_state)?;
            sampler.import_state(&saved.sampler_state)?;
            start_step = saved.step;
            crate::say!("resumed from {} at step {start_step}", checkpoint_path.display());
        }
        model.to_device(config.device)?;
        if let Some(data_parallel) = data_parallel.as_mut() {
            data_parallel.set_progress(start_step, &checkpoint_path);
            data_parallel.check_parameters(optimizer.parameters(), start_step)?;
        }
        std::fs::create_dir_all(&config.out_dir).with_context(|| format!("creating {}", config.out_dir.display()))?;
        let train_json = serde_json::to_string_pretty(config)?;
        let model_json = serde_json::to_string_pretty(&model_config)?;
        // Rank 0 alone writes into the run directory and prints the plan.
        if leader {
            if !resume {
                // A new run replaces the directory's old one: the old checkpoint must not outlive
                // the new config.json (a --resume would continue the old model).
                remove_if_present(&checkpoint_path)?;
            }
            atomic_write(&config.out_dir.join(CONFIG_FILE), train_json.as_bytes())?;
            print_plan(config, &model, table_updates);
        }
        Ok(Session {
            config,
            model,
            optimizer,
            sampler,
            validation,
            schedule: config.schedule(),
            checkpoint_path,
            start_step,
            data_parallel,
            #[cfg(feature = "cuda")]
            graph: None,
            train_json,
            model_json,
            _precision: precision,
        })
    }

    /// Whether this process writes the run's files and prints its progress (rank 0, or the
    /// only process).
    pub fn is_leader(&self) -> bool {
        self.data_parallel.as_ref().is_none_or(|dp| dp.rank() == 0)
    }

    /// Where the run's metrics go.
    pub fn metrics_path(&self) -> PathBuf {
        self.config.out_dir.join(METRICS_FILE)
    }

    /// Writes the checkpoint of `step` steps done: rank 0 does, after checking that every rank
    /// holds the same parameters; a save refused or failed on rank 0 stops every rank. A
    /// refused save of non-finite values is a [`super::Diverged`] error.
    pub fn save_everywhere(&mut self, step: usize) -> Result<()> {
        if let Some(data_parallel) = self.data_parallel.as_mut() {
            data_parallel.check_parameters(self.optimizer.parameters(), step)?;
        }
        let saved = if self.is_leader() { self.save(step) } else { Ok(()) };
        let everyone_saved = match self.data_parallel.as_mut() {
            Some(data_parallel) => data_parallel.all_ok(saved.is_ok(), step)?,
            None => saved.is_ok(),
        };
        saved.map_err(|e| diverged_on_save(e, step, &self.checkpoint_path))?;
        if !everyone_saved {
            bail!(
                "rank 0 could not save the checkpoint of step {step} (its error says why): stopping every rank; \
                 the last good checkpoint is kept at {}",
                self.checkpoint_path.display()
            );
        }
        Ok(())
    }

    /// Writes the checkpoint of `step` steps done (refused when a value is not finite).
    fn save(&self, step: usize) -> Result<()> {
        let meta = CheckpointMeta {
            step,
            sampler_state: &self.sampler.export_state(),
            train_config: &self.train_json,
            model_config: &self.model_json,
        };
        checkpoint::save(&self.checkpoint_path, &self.model, self.optimizer.as_ref(), &meta)
    }
}

/// The checkpoint to resume from, after checking `config` against the one it was saved with
/// (refused changes are errors, the others are printed as warnings) and that it is not past
/// the run's last step (at it, the run has nothing left to do and ends at once).
fn load_for_resume(config: &TrainConfig, path: &Path) -> Result<Checkpoint> {
    if !path.exists() {
        bail!("--resume: no checkpoint at {} (train without --resume to start this run)", path.display());
    }
    let saved = checkpoint::load(path)?;
    let saved_config: TrainConfig = serde_json::from_str(&saved.train_config)
        .with_context(|| format!("checkpoint {}: its 'train_config' metadata", path.display()))?;
    for warning in check_continuation(&saved_config, config)? {
        crate::console::warn(format_args!("{warning}"));
    }
    if config.steps < saved.step {
        bail!(
            "--resume: the checkpoint in {} is at step {}, past the run's {} steps \
             (pass --steps N with N > {} to train further)",
            config.out_dir.display(),
            saved.step,
            config.steps,
            saved.step
        );
    }
    if config.steps == saved.step {
        crate::say!(
            "the checkpoint is at step {} of {}: nothing left to run (pass --steps N with N > {} to train further)",
            saved.step,
            config.steps,
            saved.step
        );
    }
    Ok(saved)
}

/// Token files for training and (optionally) validation, preparing them from the text
/// corpus into `out_dir/data/<stem>-<tokenizer>-<content hash>/` ([`corpus_cache_name`]) on
/// first use. Nothing is created when the corpus cannot be read.
fn resolve_data(config: &TrainConfig, tokenizer: &Tokenizer) -> Result<(PathBuf, Option<PathBuf>)> {
    if let Some(train) = &config.train_data {
        return Ok((train.clone(), config.val_data.clone()));
    }
    let text = config.text.as_deref();
    let data_dir = config.out_dir.join("data").join(corpus_cache_name(text, tokenizer.name())?);
    let (train, val, report) =
        prepare_once(text, tokenizer, &data_dir).with_context(|| format!("preparing {}", corpus_name(text)))?;
    if let Some(report) = report {
        crate::say!(
            "prepared {} ({} train + {} val tokens, {} tokenizer) into {}",
            corpus_name(text),
            report.train_tokens,
            report.val_tokens,
            report.tokenizer,
            data_dir.display()
        );
    }
    Ok((train, Some(val)))
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
    let rule = match config.optimizer {
        OptimizerKind::Sgd => RowRule::Sgd { momentum: config.momentum, weight_decay: config.weight_decay },
        OptimizerKind::Adam | OptimizerKind::AdamW => RowRule::Adam(AdamConfig {
            beta2: config.beta2,
            weight_decay: config.weight_decay,
            decoupled: config.optimizer == OptimizerKind::AdamW,
            ..AdamConfig::default()
        }),
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

/// The training sampler `config.sampling` names, keeping `shard`'s rows; errors when the
/// file holds no window.
fn make_sampler(config: &TrainConfig, file: TokenFile, shard: Shard) -> Result<Box<dyn BatchSampler>> {
    let (b, t) = (config.batch_size, config.seq_len);
    Ok(match config.sampling {
        Sampling::Random => Box::new(RandomSampler::new(file, b, t, config.seed)?.sharded(shard)),
        Sampling::Sequential => Box::new(SequentialSampler::new(file, b, t)?.sharded(shard)),
    })
}

/// A warmup longer than the run leaves the learning rate below its peak throughout (cosine
/// and noam; the other schedules have no warmup): allowed, but said.
fn warn_about_warmup(config: &TrainConfig) {
    if matches!(config.schedule, ScheduleKind::Cosine | ScheduleKind::Noam) && config.warmup > config.steps {
        crate::console::warn(format_args!(
            "warmup {} is longer than the run's {} steps: the learning rate never reaches its peak {}",
            config.warmup, config.steps, config.lr
        ));
    }
}

/// The lines a run starts with: model, size, steps, batch, optimizer, device.
fn print_plan(config: &TrainConfig, model: &Llama, table_updates: Option<&str>) {
    crate::say!(
        "training {} ({}) with {} parameters for {} steps: batch {} x {} tokens, {} optimizer, lr {}",
        config.model,
        config.variant,
        model.num_parameters(),
        config.steps,
        config.global_batch,
        config.seq_len,
        config.optimizer,
        config.lr
    );
    if let Some(how) = table_updates {
        crate::say!("per-token tables: {how} updates");
    }
    if config.world_size > 1 {
        crate::say!(
            "data parallel: {} ranks × batch {} × grad_accum {} = {} sequences per step",
            config.world_size,
            config.batch_size,
            config.grad_accum,
            config.global_batch
        );
    }
    if config.device != Device::Cpu {
        let precision = if config.bf16 { "bf16 matrix products, f32 master weights" } else { "f32" };
        crate::say!("device {} ({precision})", device_label(config.device));
    }
}
