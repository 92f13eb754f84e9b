//! `transponder compare` flags, their CPU-sized defaults, and the command's entry point.
//!
//! Defaults were measured on two shared CPU cores: llama-tiny with Transponder at batch 8 ×
//! seq 128 trains ~6,000 tokens/s, so one 200-step run (validation every 25 steps) takes
//! ~35 s and a 6-row grid at 3 seeds ~10 minutes; the narrow ResNet-18 on the digits takes
//! ~2-3 s per epoch, ~25 s per 10-epoch run.

use std::path::PathBuf;

use anyhow::Result;
use tensor::Device;

use super::{compare, grids, CompareOptions, RUNS_CSV, TABLE_CSV, TABLE_MD, VAL_CURVES_SVG};
use crate::config::{OptimizerKind, ScheduleKind, TrainConfig};
use crate::device::{ensure_available, parse_device};
use crate::train_image::ImageTrainConfig;

/// `transponder compare` flags. Every row of a grid shares these; each row then sets only
/// its own fields (variant, rank, coverage, ...). `--list` shows the grids and their rows.
#[derive(clap::Args, Clone, Debug)]
pub struct CompareArgs {
    /// Named grid: transponder-variants, baselines, post-ln, contextual-ablation, coverage,
    /// rank, ccl, resnet, per-token, headline, fashion-resnet18, fashion-resnet50.
    #[arg(long, conflicts_with = "variants")]
    pub grid: Option<String>,
    /// A custom list of LLaMA variants compared against the first, e.g. `pre-ln,transponder`.
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Only these rows of the grid, e.g. `--rows transponder-r2,transponder-r32` (the
    /// baseline row is always kept).
    #[arg(long, value_delimiter = ',')]
    pub rows: Vec<String>,
    /// List the grids with their rows and exit.
    #[arg(long)]
    pub list: bool,
    /// Seeds per row: --seed, --seed + 1, ...
    #[arg(long, default_value_t = 3)]
    pub seeds: usize,
    /// The first seed (initialisation and batch sampling).
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Model preset of the language grids (widths of the `ccl` grid are set on top of it).
    #[arg(long, default_value = "llama-tiny")]
    pub model: String,
    /// Optimizer steps per language run.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Sequences per step of the language runs (the ResNet grid uses train-image's 64).
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Peak learning rate of the language runs.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// `adamw`, `adam` or `sgd`.
    #[arg(long, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    /// `cosine`, `noam`, `constant`, `linear` or `onecycle`.
    #[arg(long, default_value = "cosine")]
    pub schedule: ScheduleKind,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Steps between validations (the points of val_curves.svg).
    #[arg(long, default_value_t = 25)]
    pub eval_every: usize,
    /// Validation batches (the same first windows of the validation file for every run).
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Steps between checkpoints (what an interrupted run resumes from).
    #[arg(long, default_value_t = 50)]
    pub save_every: usize,
    /// Plain-text corpus, tokenized once into <out-dir>/data/ when no token files are given
    /// (default: the built-in tinyshakespeare).
    #[arg(long, conflicts_with = "train_data")]
    pub text: Option<PathBuf>,
    /// Token files (llm.c or nanoGPT format) instead of --text.
    #[arg(long, requires = "val_data")]
    pub train_data: Option<PathBuf>,
    /// Validation token file (required with --train-data).
    #[arg(long, requires = "train_data")]
    pub val_data: Option<PathBuf>,
    /// `byte` or `gpt2`.
    #[arg(long, default_value = "byte")]
    pub tokenizer: String,
    /// Epochs per ResNet run (`--grid resnet`; the model is train-image's default).
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// Where digits.csv.gz (or the IDX / CIFAR files) are, for the ResNet grids.
    #[arg(long, default_value = "data")]
    pub data_dir: PathBuf,
    /// ResNet runs train on the first N training images only (0: all).
    #[arg(long, default_value_t = 0)]
    pub train_images: usize,
    /// Channels of the ResNets' first stage (train-image's narrow default 16).
    #[arg(long, default_value_t = 16)]
    pub base_width: usize,
    /// Root of the grids' directories (`runs/`, ignored by git, by default; the committed
    /// grids of RESULTS.md are under `results/compare/`: pass that to rerun into them).
    #[arg(long, default_value = "runs/compare")]
    pub out_dir: PathBuf,
    /// Where every run computes: cpu, cuda or cuda:N (not part of a run's saved config:
    /// finished runs are reused whichever device made them).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
}

impl CompareArgs {
    /// The comparison these flags ask for; `command` is quoted in the table.
    pub fn options(&self, command: String) -> CompareOptions {
        let base = TrainConfig {
            model: self.model.clone(),
            steps: self.steps,
            batch_size: self.batch_size,
            seq_len: self.seq_len,
            lr: self.lr,
            optimizer: self.optimizer,
            schedule: self.schedule,
            warmup: self.warmup,
            eval_every: self.eval_every,
            eval_batches: self.eval_batches,
            save_every: self.save_every,
            // One console line per validation keeps a run's output short.
            log_every: self.eval_every.max(1),
            text: self.text.clone(),
            train_data: self.train_data.clone(),
            val_data: self.val_data.clone(),
            tokenizer: self.tokenizer.clone(),
            seed: self.seed,
            device: self.device,
            ..TrainConfig::default()
        };
        let image_base = ImageTrainConfig {
            epochs: self.epochs,
            data_dir: self.data_dir.clone(),
            train_images: self.train_images,
            base_width: self.base_width,
            seed: self.seed,
            device: self.device,
            ..ImageTrainConfig::default()
        };
        CompareOptions {
            grid: self.grid.clone(),
            variants: self.variants.clone(),
            rows: self.rows.clone(),
            seeds: self.seeds,
            base,
            image_base,
            out_dir: self.out_dir.clone(),
            command,
        }
    }
}

/// The command line as typed (arguments with spaces or quotes single-quoted).
pub fn command_line() -> String {
    let quote = |arg: String| {
        if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || "'\"$`\\".contains(c)) {
            format!("'{}'", arg.replace('\'', r"'\''"))
        } else {
            arg
        }
    };
    let mut args = std::env::args();
    let program = args.next().map(|p| {
        let path = PathBuf::from(p);
        path.file_name().map_or("transponder".into(), |n| n.to_string_lossy().into_owned())
    });
    program.into_iter().chain(args.map(quote)).collect::<Vec<_>>().join(" ")
}

/// `transponder compare`: lists the grids, or runs one and prints its table.
pub fn run(args: &CompareArgs) -> Result<()> {
    if args.list {
        crate::emit!("{}", grids::listing()?.trim_end())?;
        return Ok(());
    }
    ensure_available(args.device)?;
    let outcome = compare(&args.options(command_line()))?;
    crate::say!("\n{}", outcome.markdown);
    crate::say!(
        "{} runs: {} started, {} resumed, {} finished earlier",
        outcome.results.len(),
        outcome.started,
        outcome.resumed,
        outcome.skipped
    );
    for name in [TABLE_MD, TABLE_CSV, RUNS_CSV, VAL_CURVES_SVG] {
        crate::say!("wrote {}", outcome.dir.join(name).display());
    }
    Ok(())
}
