//! `transponder`: prepare token files, train, evaluate, sample and export LLaMA models
//! with contextual modulators.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use trainer::config::TrainConfig;
use trainer::data::token_file::TokenFile;
use trainer::generate::{export_hf, load_model, sample};
use trainer::prepare::prepare;
use trainer::tokenizer::Tokenizer;
use trainer::train::{evaluate, train};
use trainer::train_image::{train_image, ImageTrainConfig};

#[derive(Parser)]
#[command(name = "transponder", version, about = "Train language models with contextual modulators")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text files into llm.c-format train.bin / val.bin.
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
    },
    /// Generate text from a checkpoint.
    Sample {
        checkpoint: PathBuf,
        #[arg(long, default_value = "ROMEO:")]
        prompt: String,
        #[arg(long, default_value = "byte")]
        tokenizer: String,
        #[arg(long, default_value_t = 200)]
        tokens: usize,
        #[arg(long, default_value_t = 0.8)]
        temperature: f32,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Write a baseline checkpoint as Hugging Face LlamaForCausalLM (config.json + model.safetensors).
    Export { checkpoint: PathBuf, out: PathBuf },
    /// The papers' analyses of a checkpoint (modulator values, CCL effective rank, gate
    /// statistics, top tokens, parameters and FLOPs), or `--throughput` of Base-64, CCL-64
    /// and Base-512.
    Analyze(Box<trainer::analyze::AnalyzeArgs>),
    /// Train a ResNet image classifier (defaults: narrow ResNet-18 on the built-in digits).
    TrainImage(Box<TrainImageArgs>),
}

/// Image-training flags; each overrides the config file, which overrides the defaults.
#[derive(Args, Default)]
struct TrainImageArgs {
    /// JSON config file (keys as in the run's config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue from the checkpoint in --out-dir.
    #[arg(long)]
    resume: bool,
    /// `resnet18` ... `resnet152`.
    #[arg(long)]
    model: Option<String>,
    /// `none`, `pixel` or `sliding-window`.
    #[arg(long)]
    modulator: Option<String>,
    /// `digits` (built in), `cifar10` or `cifar100` (with --data-dir).
    #[arg(long)]
    dataset: Option<String>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long)]
    base_width: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long)]
    weight_decay: Option<f32>,
    /// `linear`, `cosine` or `constant`.
    #[arg(long)]
    schedule: Option<String>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

impl TrainImageArgs {
    fn into_config(self) -> Result<ImageTrainConfig> {
        let mut c = match &self.config {
            Some(path) => ImageTrainConfig::from_file(path)?,
            None => ImageTrainConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field { c.$field = v; } )* };
        }
        set!(model, modulator, dataset, data_dir, base_width, batch_size, epochs, lr, weight_decay, schedule, seed);
        set!(out_dir);
        Ok(c)
    }
}

/// Training flags; each overrides the config file, which overrides the defaults.
#[derive(Args, Default)]
struct TrainArgs {
    /// JSON config file (keys as in the run's config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue from the checkpoint in --out-dir.
    #[arg(long)]
    resume: bool,
    #[arg(long)]
    model: Option<String>,
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
    /// SGD momentum.
    #[arg(long)]
    momentum: Option<f32>,
    /// Lazy row-sparse updates of the per-token tables (Adam/AdamW, SGD with momentum).
    #[arg(long)]
    lazy_tables: bool,
    #[arg(long)]
    text: Option<PathBuf>,
    #[arg(long)]
    train_data: Option<PathBuf>,
    #[arg(long)]
    val_data: Option<PathBuf>,
    #[arg(long)]
    tokenizer: Option<String>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long)]
    optimizer: Option<String>,
    #[arg(long)]
    weight_decay: Option<f32>,
    #[arg(long)]
    schedule: Option<String>,
    #[arg(long)]
    warmup: Option<usize>,
    #[arg(long)]
    grad_clip: Option<f32>,
    #[arg(long)]
    sampling: Option<String>,
    #[arg(long)]
    eval_every: Option<usize>,
    #[arg(long)]
    eval_batches: Option<usize>,
    #[arg(long)]
    save_every: Option<usize>,
    #[arg(long)]
    log_every: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

impl TrainArgs {
    fn into_config(self) -> Result<TrainConfig> {
        let mut c = match &self.config {
            Some(path) => TrainConfig::from_file(path)?,
            None => TrainConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field { c.$field = v; } )* };
        }
        set!(model, variant, text, tokenizer, batch_size, seq_len, grad_accum, steps, lr, optimizer, weight_decay);
        set!(schedule, warmup, grad_clip, sampling, eval_every, eval_batches, save_every, log_every, seed, out_dir);
        set!(d_model, d_basis, d_ctx, ccl_mode, ccl_ablation, momentum);
        c.lazy_tables |= self.lazy_tables;
        c.train_data = self.train_data.or(c.train_data);
        c.val_data = self.val_data.or(c.val_data);
        Ok(c)
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command.unwrap_or_else(|| Command::Train(Box::default())) {
        Command::Prepare { inputs, out, tokenizer, val_fraction } => {
            let tokenizer = Tokenizer::from_name(&tokenizer)?;
            let report = prepare(&inputs, &tokenizer, &out, val_fraction)?;
            println!(
                "wrote {} ({} tokens) and {} ({} tokens), vocab {}",
                report.train_path.display(),
                report.train_tokens,
                report.val_path.display(),
                report.val_tokens,
                report.vocab_size
            );
        }
        Command::Train(args) => {
            let resume = args.resume;
            let config = args.into_config()?;
            let report = train(&config, resume)?;
            println!(
                "done: {} steps in {:.1} s ({:.0} tokens/s); loss {:.4} -> {:.4}{}",
                report.steps,
                report.seconds,
                report.tokens_per_second,
                report.first_loss,
                report.final_loss,
                report.final_val_loss.map(|v| format!(", val loss {v:.4} (ppl {:.2})", v.exp())).unwrap_or_default()
            );
            println!("checkpoint: {}", report.checkpoint.display());
            println!("metrics:    {}", report.metrics.display());
        }
        Command::Eval { checkpoint, data, batch_size, batches } => {
            let (model, config) = load_model(&checkpoint)?;
            TokenFile::open(&data)?;
            let loss = evaluate(&model, &data, batch_size, config.seq_len, batches)?;
            println!("val loss {loss:.4} | perplexity {:.3}", loss.exp());
        }
        Command::Sample { checkpoint, prompt, tokenizer, tokens, temperature, top_k, seed } => {
            let tokenizer = Tokenizer::from_name(&tokenizer)?;
            let (model, config) = load_model(&checkpoint)?;
            let prompt_ids = tokenizer.encode(&prompt);
            let out = sample(&model, &config, &prompt_ids, tokens, temperature, top_k, seed).context("sampling")?;
            println!("{}", tokenizer.decode(&out));
        }
        Command::Export { checkpoint, out } => {
            let (model, config) = load_model(&checkpoint)?;
            export_hf(&model, &config, &out)?;
            println!("wrote {}/config.json and {}/model.safetensors", out.display(), out.display());
        }
        Command::Analyze(args) => trainer::analyze::run(&args)?,
        Command::TrainImage(args) => {
            let resume = args.resume;
            let config = args.into_config()?;
            let report = train_image(&config, resume)?;
            println!(
                "done: {} epochs in {:.1} s ({:.1} s/epoch); loss {:.4} -> {:.4}; eval accuracy {:.2}%",
                report.epochs,
                report.seconds,
                report.seconds_per_epoch,
                report.first_loss,
                report.final_loss,
                100.0 * report.final_accuracy()
            );
            println!("checkpoint: {}", report.checkpoint.display());
            println!("metrics:    {}", report.metrics.display());
        }
    }
    Ok(())
}
