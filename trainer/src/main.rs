//! `transponder`: prepare token files, train, evaluate, sample and export LLaMA models
//! with contextual modulators.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use nn::Module;
use tensor::Device;
use trainer::config::{OptimizerKind, Sampling, ScheduleKind, TrainConfig};
use trainer::console::StdoutError;
use trainer::data::DataFormat;
use trainer::device::{device_name, ensure_available, parse_device};
use trainer::dir_lock::DirLock;
use trainer::export::{export_hf, ExportKind};
use trainer::generate::{generate, generate_uncached, load_model, load_model_and_tokenizer, SamplingOptions};
use trainer::prepare::{prepare_split, ValSplit};
use trainer::run_dir::{claim, Claim};
use trainer::tokenizer::Tokenizer;
use trainer::train::{evaluate, open_eval_data, train};
use trainer::train_image::{train_image, ImageTrainConfig};
use trainer::{emit, say};

#[derive(Parser)]
#[command(name = "transponder", version, about = "Train language models with contextual modulators")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text files (plain or .gz) into llm.c-format train.bin / val.bin.
    Prepare {
        /// Input text files.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Output directory.
        #[arg(long, default_value = "data/prepared")]
        out: PathBuf,
        /// `byte` or `gpt2`.
        #[arg(long, default_value = "byte")]
        tokenizer: String,
        /// Share of tokens held out for validation.
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
        /// Hold out the last share of each file (validation then covers every file), not
        /// of all files together.
        #[arg(long)]
        val_per_file: bool,
    },
    /// Train a model (defaults: llama-tiny + transponder on the built-in tinyshakespeare).
    Train(Box<TrainArgs>),
    /// Validation loss and perplexity of a checkpoint on a token file.
    Eval {
        checkpoint: PathBuf,
        data: PathBuf,
        #[arg(long, default_value_t = 8)]
        batch_size: usize,
        #[arg(long, default_value_t = 50)]
        batches: usize,
        /// Token file format: auto (detect llm.c by its header), llmc or nanogpt.
        #[arg(long, default_value = "auto")]
        data_format: DataFormat,
        /// Where the model runs: cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu", value_parser = parse_device)]
        device: Device,
    },
    /// Generate text from a checkpoint: each prompt in one pass, then a token per step from
    /// a KV cache; stops at the model's context length. Prints tokens/s at the end.
    Sample(Box<SampleArgs>),
    /// Write a checkpoint as a Hugging Face model directory: pre-ln as LlamaForCausalLM, every
    /// other variant with modeling_transponder.py (load with trust_remote_code=True).
    Export { checkpoint: PathBuf, out: PathBuf },
    /// The papers' analyses of a checkpoint (modulator values, CCL effective rank, gate
    /// statistics, top tokens, parameters and FLOPs), or `--throughput` of Base-64, CCL-64
    /// and Base-512.
    Analyze(Box<trainer::analyze::AnalyzeArgs>),
    /// Train a ResNet image classifier (defaults: narrow ResNet-18 on the built-in digits).
    TrainImage(Box<TrainImageArgs>),
    /// Run this node's ranks of a data-parallel job (`launch --nproc-per-node 2 -- train ...`):
    /// torchrun's environment, output prefixed `[rank r]`, a failed rank stops the job.
    Launch(Box<trainer::dist::LaunchArgs>),
    /// Reproduce a paper's table: train every row of a grid (or --variants) under identical
    /// data, seeds, steps and schedule; print and write the table (mean ± SE over seeds, Δ%,
    /// parameters, throughput) and the validation curves. Defaults: llama-tiny, 200 steps of
    /// batch 8 × seq 128, 3 seeds (~35 s per run on two CPU cores). Reruns skip finished runs.
    Compare(Box<trainer::compare::cli::CompareArgs>),
}

/// Sampling flags.
#[derive(Args)]
struct SampleArgs {
    checkpoint: PathBuf,
    /// A prompt; repeat the flag for a batch of prompts (default "ROMEO:").
    #[arg(long)]
    prompt: Vec<String>,
    /// `byte` or `gpt2` (default: the tokenizer the checkpoint was trained with).
    #[arg(long)]
    tokenizer: Option<String>,
    /// New tokens per prompt, at most.
    #[arg(long, alias = "tokens", default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 picks the most likely token.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sample among the most likely tokens whose probability reaches p (1 = all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Recompute the whole prefix for every token (the reference path, for comparison).
    #[arg(long)]
    no_cache: bool,
    /// Where the model runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
}

/// Image-training flags; each overrides the config file, which overrides the defaults.
#[derive(Args, Default)]
struct TrainImageArgs {
    /// JSON config file (keys as in the run's config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue the run in --out-dir with its saved settings; other flags override only what
    /// they name.
    #[arg(long)]
    resume: bool,
    /// Replace the run in --out-dir (without it, a directory holding a run is refused).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// `resnet18` ... `resnet152`.
    #[arg(long)]
    model: Option<String>,
    /// `none`, `pixel` or `sliding-window`.
    #[arg(long)]
    modulator: Option<String>,
    /// `digits` (built in), `mnist`, `fashion-mnist`, `cifar10` or `cifar100` (with --data-dir).
    #[arg(long)]
    dataset: Option<String>,
    /// Folder with digits.csv.gz, the IDX files (plain or .gz) or the CIFAR binary files (default data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Train on the first N training images only (default 0: all of them).
    #[arg(long)]
    train_images: Option<usize>,
    /// Channels of the first stage (default 16; the papers' ResNets use 64).
    #[arg(long)]
    base_width: Option<usize>,
    /// Images per step (default 64).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Epochs (default 10).
    #[arg(long)]
    epochs: Option<usize>,
    /// Peak learning rate of SGD with momentum 0.9 (default 0.05).
    #[arg(long)]
    lr: Option<f32>,
    /// Weight decay (default 0).
    #[arg(long)]
    weight_decay: Option<f32>,
    /// `linear`, `cosine` or `constant`.
    #[arg(long)]
    schedule: Option<String>,
    /// Seed of the initialisation, shuffling and augmentation (default 1337).
    #[arg(long)]
    seed: Option<u64>,
    /// Run directory (default runs/resnet-digits).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Where the run computes: cpu (default), cuda or cuda:N.
    #[arg(long, value_parser = parse_device)]
    device: Option<Device>,
}

impl TrainImageArgs {
    fn into_config(self) -> Result<ImageTrainConfig> {
        let mut c = ImageTrainConfig::base(self.config.as_deref(), self.out_dir.as_deref(), self.resume)?;
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field { c.$field = v; } )* };
        }
        set!(model, modulator, dataset, data_dir, base_width, batch_size, epochs, lr, weight_decay, schedule, seed);
        set!(out_dir, device, train_images);
        Ok(c)
    }
}

/// Training flags; each overrides the config file, which overrides the defaults.
#[derive(Args, Default)]
struct TrainArgs {
    /// JSON config file (keys as in the run's config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue the run in --out-dir with its saved settings; other flags override only what
    /// they name (changes that do not fit the checkpoint are refused, others warned about).
    #[arg(long)]
    resume: bool,
    /// Replace the run in --out-dir. Without it a fresh run into a directory holding one is
    /// refused; the default directory moves on to runs/default-2, -3, ...
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Model preset: llama-tiny (default), llama-small, llama-60m, llama-130m, llama-250m, llama-350m, llama-1b.
    #[arg(long)]
    model: Option<String>,
    /// Modulator variant or baseline (default transponder; pre-ln is the plain LLaMA; an unknown name lists all).
    #[arg(long)]
    variant: Option<String>,
    /// Model width override (0 = the preset's); the FFN width scales with it.
    #[arg(long)]
    d_model: Option<usize>,
    /// CCL basis size (`--variant ccl`).
    #[arg(long)]
    d_basis: Option<usize>,
    /// CCL context width (`--variant ccl`).
    #[arg(long)]
    d_ctx: Option<usize>,
    /// CCL context mode: token or causal-mean.
    #[arg(long)]
    ccl_mode: Option<String>,
    /// CCL ablation: none, static, no-out-gate, no-basis-gate.
    #[arg(long)]
    ccl_ablation: Option<String>,
    /// Transponder modulator rank r (default 8).
    #[arg(long)]
    rank: Option<usize>,
    /// Projections with modulators: all, attn, mlp, only-first, only-last, only-qk, no-up-gate.
    #[arg(long)]
    coverage: Option<String>,
    /// Post-LN residuals `Norm(x + F(x))` for the variant (Transponder Table 3).
    #[arg(long)]
    post_ln: bool,
    /// Modulator nonlinearity φ: sigmoid (default), silu or relu.
    #[arg(long)]
    phi: Option<String>,
    /// SGD momentum.
    #[arg(long)]
    momentum: Option<f32>,
    /// Lazy row-sparse updates of the per-token tables (Adam/AdamW, SGD with momentum).
    #[arg(long)]
    lazy_tables: bool,
    /// Plain-text corpus, tokenized on first use into <out-dir>/data (default: the built-in tinyshakespeare).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Training token file (llm.c or nanoGPT format) instead of --text.
    #[arg(long)]
    train_data: Option<PathBuf>,
    /// Validation token file.
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// Token file format: auto (default; detect llm.c by its header), llmc or nanogpt.
    #[arg(long)]
    data_format: Option<DataFormat>,
    /// Tokenizer for --text: byte (default) or gpt2.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Sequences per micro-batch (default 16).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Tokens per sequence (default 128).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Micro-batches summed per optimizer step on each rank (default 1).
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Sequences per optimizer step over all ranks; --grad-accum is then derived from it and the
    /// world size (a resumed run keeps its global batch unless --batch-size or --grad-accum is given).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Seconds a gradient all-reduce may take before every rank stops (data parallel; default 600).
    #[arg(long)]
    collective_timeout: Option<u64>,
    /// Seconds the ranks wait for each other at start-up (data parallel; default 300).
    #[arg(long)]
    rendezvous_timeout: Option<u64>,
    /// Optimizer steps (default 300).
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate (default 3e-3).
    #[arg(long)]
    lr: Option<f32>,
    /// adamw (default), adam or sgd.
    #[arg(long)]
    optimizer: Option<OptimizerKind>,
    /// Weight decay (default 0.01; decoupled for adamw).
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Learning-rate schedule: cosine (default, with linear warmup), noam, constant, linear, onecycle.
    #[arg(long)]
    schedule: Option<ScheduleKind>,
    /// Warmup steps (default 30).
    #[arg(long)]
    warmup: Option<usize>,
    /// Clip the global gradient norm to this (default 1.0; 0 disables).
    #[arg(long)]
    grad_clip: Option<f32>,
    /// Batch sampling: random (seeded windows, default) or sequential.
    #[arg(long)]
    sampling: Option<Sampling>,
    /// Steps between validations (default 100).
    #[arg(long)]
    eval_every: Option<usize>,
    /// Validation batches per evaluation (default 8).
    #[arg(long)]
    eval_batches: Option<usize>,
    /// Steps between checkpoints (default 100; the last step always saves).
    #[arg(long)]
    save_every: Option<usize>,
    /// Steps between printed loss lines (default 10).
    #[arg(long)]
    log_every: Option<usize>,
    /// Seed of the initialisation and the batch sampling (default 1337).
    #[arg(long)]
    seed: Option<u64>,
    /// Run directory: checkpoint, config.json, metrics.jsonl (default runs/default).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Where the run computes: cpu (default), cuda or cuda:N (needs a build with --features cuda).
    #[arg(long, value_parser = parse_device)]
    device: Option<Device>,
    /// bf16 inputs to the GPU's matrix products, f32 master weights (needs --device cuda).
    #[arg(long)]
    bf16: bool,
    /// Capture the training step once as a CUDA graph and replay it every step (one GPU,
    /// Adam/AdamW): one launch per step for the host to queue; the same losses.
    #[arg(long)]
    cuda_graph: bool,
}

impl TrainArgs {
    fn into_config(self) -> Result<TrainConfig> {
        let mut c = trainer::train::resume::base_config(self.config.as_deref(), self.out_dir.as_deref(), self.resume)?;
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field { c.$field = v; } )* };
        }
        // A data flag replaces the whole data source (a resumed run may switch from its text to
        // token files or back); two sources named together are refused below.
        if self.text.is_some() {
            (c.train_data, c.val_data) = (None, None);
        }
        if self.train_data.is_some() {
            c.text = None;
        }
        c.text = self.text.or(c.text);
        // A new batch split re-derives the global batch; else a resumed run keeps its own
        // (and its grad_accum follows the world size).
        if self.batch_size.is_some_and(|b| b != c.batch_size) || self.grad_accum.is_some_and(|a| a != c.grad_accum) {
            c.global_batch = 0;
        }
        set!(global_batch, collective_timeout, rendezvous_timeout);
        set!(model, variant, tokenizer, batch_size, seq_len, grad_accum, steps, lr, optimizer, weight_decay);
        set!(schedule, warmup, grad_clip, sampling, eval_every, eval_batches, save_every, log_every, seed, out_dir);
        set!(d_model, d_basis, d_ctx, ccl_mode, ccl_ablation, momentum, rank, coverage, phi, device, data_format);
        c.lazy_tables |= self.lazy_tables;
        c.bf16 |= self.bf16;
        c.cuda_graph = self.cuda_graph;
        c.post_ln |= self.post_ln;
        c.train_data = self.train_data.or(c.train_data);
        c.val_data = self.val_data.or(c.val_data);
        c.check_data_source()?;
        Ok(c)
    }
}

/// `transponder sample`: generates from every prompt and prints the texts, then the speed.
fn sample(args: SampleArgs) -> Result<()> {
    ensure_available(args.device)?;
    let (model, config, trained_with) = load_model_and_tokenizer(&args.checkpoint)?;
    let tokenizer = match &args.tokenizer {
        Some(name) => Tokenizer::from_name(name)?,
        None => trained_with,
    };
    tokenizer.ensure_vocab(config.vocab_size)?;
    model.to_device(args.device)?;
    let prompts = if args.prompt.is_empty() { vec!["ROMEO:".to_string()] } else { args.prompt };
    let prompt_ids: Vec<Vec<u32>> = prompts.iter().map(|p| tokenizer.encode(p)).collect();
    let options = SamplingOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let run = if args.no_cache { generate_uncached } else { generate };
    let generation = run(&model, &prompt_ids, &options).context("sampling")?;
    for (i, sequence) in generation.sequences.iter().enumerate() {
        if i > 0 {
            emit!("---")?;
        }
        emit!("{}", tokenizer.decode(sequence))?;
    }
    if let Some(length) = generation.stopped_at_context {
        eprintln!(
            "stopped after {} new tokens: the longest sequence reached the model's context length ({length} tokens)",
            generation.new_tokens
        );
    }
    eprintln!(
        "{} new tokens x {} sequences in {:.2} s: {:.1} tokens/s ({}, {} tokenizer, {})",
        generation.new_tokens,
        generation.sequences.len(),
        generation.seconds,
        generation.tokens_per_second(),
        if args.no_cache { "no cache" } else { "KV cache" },
        tokenizer.name(),
        device_name(args.device)
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let error = match trainer::threads::on_worker_pool(None, || run(cli)) {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(error)) | Err(error) => error,
    };
    // A closed pipe (`| head`) ends a command quietly, as it does Unix tools.
    if error.downcast_ref::<StdoutError>().is_some_and(StdoutError::is_closed_pipe) {
        return ExitCode::SUCCESS;
    }
    // Best effort: with stderr gone too, the exit status is all that is left.
    let _ = writeln!(std::io::stderr(), "Error: {error:?}");
    ExitCode::FAILURE
}

fn run(cli: Cli) -> Result<()> {
    match cli.command.unwrap_or_else(|| Command::Train(Box::default())) {
        Command::Prepare { inputs, out, tokenizer, val_fraction, val_per_file } => {
            let tokenizer = Tokenizer::from_name(&tokenizer)?;
            let split = if val_per_file { ValSplit::EachFileTail } else { ValSplit::StreamTail };
            let _lock = DirLock::acquire(&out)?;
            let report = prepare_split(&inputs, &tokenizer, &out, val_fraction, split)?;
            emit!(
                "wrote {} ({} tokens) and {} ({} tokens), vocab {}",
                report.train_path.display(),
                report.train_tokens,
                report.val_path.display(),
                report.val_tokens,
                report.vocab_size
            )?;
        }
        Command::Train(args) => {
            let (resume, overwrite, named) = (args.resume, args.overwrite, args.out_dir.is_some());
            let mut config = args.into_config()?;
            // Data parallel: every rank uses the directory named; rank 0 alone claims it (and
            // writes into it).
            let world = trainer::dist::World::from_env()?;
            let named = named || config.out_dir != TrainConfig::default().out_dir || world.is_some();
            let _lock = match world {
                Some(world) if !world.is_leader() => None,
                _ => {
                    let (out_dir, lock) = claim(&config.out_dir, Claim::from_flags(resume, overwrite, named))?;
                    config.out_dir = out_dir;
                    Some(lock)
                }
            };
            let report = train(&config, resume)?;
            if report.steps_run == 0 {
                say!("done: nothing left to train; the run is complete at step {}", report.steps);
                return Ok(());
            }
            say!(
                "done: {} steps in {:.1} s ({:.0} tokens/s); loss {:.4} -> {:.4}{}",
                report.steps,
                report.seconds,
                report.tokens_per_second,
                report.first_loss,
                report.final_loss,
                report.final_val_loss.map(|v| format!(", val loss {v:.4} (ppl {:.2})", v.exp())).unwrap_or_default()
            );
            say!("checkpoint: {}", report.checkpoint.display());
            say!("metrics:    {}", report.metrics.display());
        }
        Command::Eval { checkpoint, data, batch_size, batches, data_format, device } => {
            anyhow::ensure!(batches >= 1, "--batches must be at least 1");
            ensure_available(device)?;
            let (model, config) = load_model(&checkpoint)?;
            model.to_device(device)?;
            let mut data = open_eval_data(&data, data_format, config.vocab_size, batch_size, config.seq_len)?;
            let windows = (data.file().len() - 1) / config.seq_len;
            anyhow::ensure!(
                batch_size <= windows,
                "--batch-size {batch_size} exceeds the {windows} windows of {} + 1 tokens in {}",
                config.seq_len,
                data.file().path().display()
            );
            let loss = evaluate(&model, &mut data, batches)?;
            emit!("val loss {loss:.6} | perplexity {:.3}", loss.exp())?;
        }
        Command::Sample(args) => sample(*args)?,
        Command::Export { checkpoint, out } => {
            let (model, config) = load_model(&checkpoint)?;
            let _lock = DirLock::acquire(&out)?;
            let exported = export_hf(&model, &config, &out)?;
            let class = match exported.kind {
                ExportKind::Llama => "LlamaForCausalLM",
                ExportKind::Transponder => "TransponderForCausalLM (from_pretrained(..., trust_remote_code=True))",
            };
            for file in &exported.files {
                emit!("wrote {}", file.display())?;
            }
            emit!("loads in transformers as {class}")?;
        }
        Command::Analyze(args) => trainer::analyze::run(&args)?,
        Command::Launch(args) => match trainer::dist::launch(&args)? {
            0 => {}
            // The failing rank's code; it already said why on stderr.
            code => std::process::exit(code),
        },
        Command::Compare(args) => trainer::compare::cli::run(&args)?,
        Command::TrainImage(args) => {
            let (resume, overwrite, named) = (args.resume, args.overwrite, args.out_dir.is_some());
            let mut config = args.into_config()?;
            let named = named || config.out_dir != ImageTrainConfig::default().out_dir;
            let (out_dir, _lock) = claim(&config.out_dir, Claim::from_flags(resume, overwrite, named))?;
            config.out_dir = out_dir;
            let report = train_image(&config, resume)?;
            say!(
                "done: {} epochs in {:.1} s ({:.1} s/epoch); loss {:.4} -> {:.4}; eval accuracy {:.2}%",
                report.epochs,
                report.seconds,
                report.seconds_per_epoch,
                report.first_loss,
                report.final_loss,
                100.0 * report.final_accuracy()
            );
            say!("checkpoint: {}", report.checkpoint.display());
            say!("metrics:    {}", report.metrics.display());
        }
    }
    Ok(())
}
