//! `transponder analyze`: the analyses of the papers on a trained checkpoint, written as
//! CSV/JSON with SVG plots, plus the throughput comparison of CCL Table 2.
//!
//! | analysis | paper | module | files |
//! |---|---|---|---|
//! | scalar modulator per token, layer and projection | Transponder Fig. 2 | [`modulators`] | `modulator_scalar.{csv,svg}`, `modulator_stats.json` |
//! | channel modulator over tokens × channels, per layer | Transponder Fig. 3 | [`modulators`] | `modulator_channel_<proj>_layer<l>.csv`, `modulator_channel_<proj>.svg` |
//! | singular spectrum / effective rank of `{W_eff(t)}` | CCL Fig. 5 | [`ccl`] | `ccl_spectrum.{csv,svg}`, `ccl_rank.json` |
//! | gate histogram, entropy, share in (0.1, 0.9) | CCL Fig. 6 | [`ccl`] | `ccl_gate_histogram.{csv,svg}`, `ccl_gates.json` |
//! | top tokens per basis gate | CCL Table 3 | [`ccl`] | `ccl_top_tokens.{csv,json}` |
//! | parameters, FLOPs per token | CCL Table 2 | [`cost`] | `summary.json` |
//! | tokens/s of Base-64, CCL-64, Base-512 at batch 64 × 64 | CCL Table 2 | [`cost`] | `throughput.json` |
//!
//! The checkpoint's model runs once, without a graph, over the first `--tokens-max` tokens
//! of the input as one sequence, through [`models::llama::Llama::forward_with_trace`], on
//! `--device` (the analyses themselves read the values back on the host).

pub mod ccl;
pub mod cost;
pub mod linalg;
pub mod modulators;
pub mod svg;

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use autograd::no_grad;
use models::llama::{GateTrace, Llama, LlamaConfig};
use nn::Module;
use tensor::{Device, Tokens};

use crate::checkpoint;
use crate::data::token_file::TokenFile;
use crate::device::{ensure_available, parse_device};
use crate::tokenizer::{trained_tokenizer, Tokenizer};

/// `transponder analyze` flags.
#[derive(clap::Args, Clone, Debug)]
pub struct AnalyzeArgs {
    /// A checkpoint written by `transponder train` (required unless --throughput).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Plain text to run through the model (tokenized with the run's tokenizer).
    #[arg(long, conflicts_with = "tokens")]
    pub text: Option<PathBuf>,
    /// A token file (llm.c or nanoGPT format) to run through the model.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Output directory.
    #[arg(long, default_value = "analysis")]
    pub out: PathBuf,
    /// Tokens analysed, from the start of the input.
    #[arg(long, default_value_t = 128)]
    pub tokens_max: usize,
    /// Tokenizer for --text and token labels (default: the checkpoint's).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Projection whose channel modulators are drawn over tokens × channels (Figure 3).
    #[arg(long, default_value = "down_proj")]
    pub projection: String,
    /// Tokens listed per CCL basis gate (Table 3).
    #[arg(long, default_value_t = 5)]
    pub top_tokens: usize,
    /// Time Base-64, CCL-64 and Base-512 (CCL Table 2) instead of analysing a checkpoint.
    #[arg(long)]
    pub throughput: bool,
    /// Preset the throughput models are built from (depth, heads, FFN ratio).
    #[arg(long, default_value = "llama-tiny")]
    pub model: String,
    /// Vocabulary of the throughput models (256: byte level; the paper's GPT-2 is 50257).
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    /// Throughput batch size.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Throughput sequence length.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Timed repetitions per model (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Where the models run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
}

impl Default for AnalyzeArgs {
    fn default() -> Self {
        AnalyzeArgs {
            checkpoint: None,
            text: None,
            tokens: None,
            out: PathBuf::from("analysis"),
            tokens_max: 128,
            tokenizer: None,
            projection: "down_proj".into(),
            top_tokens: 5,
            throughput: false,
            model: "llama-tiny".into(),
            vocab: 256,
            batch: 64,
            seq: 64,
            repeats: 3,
            device: Device::Cpu,
        }
    }
}

/// Files written into the output directory, in order.
pub struct Output {
    /// The output directory.
    pub dir: PathBuf,
    /// Every file written so far, in order.
    pub files: Vec<PathBuf>,
}

impl Output {
    /// Creates `dir`.
    pub fn new(dir: &Path) -> Result<Output> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Output { dir: dir.to_path_buf(), files: Vec::new() })
    }

    /// Writes `name` inside the directory, atomically (a full disk leaves no torn file).
    pub fn write(&mut self, name: &str, contents: impl AsRef<[u8]>) -> Result<()> {
        let path = self.dir.join(name);
        crate::safetensors_io::atomic_write(&path, contents.as_ref())?;
        self.files.push(path);
        Ok(())
    }

    /// Writes `value` as pretty JSON.
    pub fn json(&mut self, name: &str, value: &serde_json::Value) -> Result<()> {
        self.write(name, serde_json::to_string_pretty(value)? + "\n")
    }
}

/// A CSV field, quoted when it holds a comma, quote or line break.
pub fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// The analysed sequence: token ids and a printable label for each.
pub struct Sequence {
    /// The token ids fed to the model.
    pub ids: Vec<u32>,
    /// One printable label per token (the byte or the tokenizer's piece), for tables and plots.
    pub labels: Vec<String>,
}

/// A readable label for one token: its text with whitespace made visible.
pub fn token_label(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id]).replace('\n', "\\n").replace('\t', "\\t").replace(' ', "␣")
}

/// What [`analyze_checkpoint`] produced.
pub struct AnalysisReport {
    /// Every file written.
    pub files: Vec<PathBuf>,
    /// The contents of `summary.json`.
    pub summary: serde_json::Value,
}

/// Runs the command: throughput or a checkpoint analysis, printing a short report.
pub fn run(args: &AnalyzeArgs) -> Result<()> {
    ensure_available(args.device)?;
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    let _lock = crate::dir_lock::DirLock::acquire(&args.out)?;
    if args.throughput {
        let rows = cost::throughput(args)?;
        let mut out = Output::new(&args.out)?;
        out.json("throughput.json", &serde_json::to_value(&rows)?)?;
        crate::say!("wrote {}", out.dir.join("throughput.json").display());
        return Ok(());
    }
    let report = analyze_checkpoint(args)?;
    crate::say!("{}", serde_json::to_string_pretty(&report.summary["highlights"])?);
    crate::say!("wrote {} files into {}", report.files.len(), args.out.display());
    Ok(())
}

/// Reads the first `--tokens-max` tokens of `--text` or `--tokens`, at most `context` (the
/// model's training context: the forward pass's memory grows with the square of the length,
/// and past the context the model was never trained).
fn read_sequence(args: &AnalyzeArgs, tokenizer: &Tokenizer, vocab: usize, context: usize) -> Result<Sequence> {
    let max = args.tokens_max.min(context);
    if args.tokens_max > context {
        eprintln!(
            "note: --tokens-max {} exceeds the model's context length: analysing the first {context} tokens",
            args.tokens_max
        );
    }
    let ids: Vec<u32> = match (&args.text, &args.tokens) {
        (Some(text), None) => {
            let text = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
            let mut ids = tokenizer.encode(&text);
            ids.truncate(max);
            ids
        }
        (None, Some(path)) => {
            let file = TokenFile::open(path)?;
            let n = file.len().min(max);
            let mut ids = vec![0; n];
            file.copy_window(0, n, &mut ids)?;
            ids
        }
        _ => bail!("analyze needs exactly one of --text FILE or --tokens FILE"),
    };
    if ids.len() < 2 {
        bail!("analyze needs at least 2 tokens of input, got {}", ids.len());
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token {bad} is outside the model's vocabulary of {vocab}; is --tokenizer right?");
    }
    let labels = ids.iter().map(|&id| token_label(tokenizer, id)).collect();
    Ok(Sequence { ids, labels })
}

/// Every analysis that applies to the checkpoint's model, into `args.out`.
pub fn analyze_checkpoint(args: &AnalyzeArgs) -> Result<AnalysisReport> {
    let path = args.checkpoint.as_ref().context("analyze needs --checkpoint PATH (or --throughput)")?;
    ensure!(
        modulators::ORDER.contains(&args.projection.as_str()),
        "unknown --projection '{}'; valid: {}",
        args.projection,
        modulators::ORDER.join(", ")
    );
    let saved = checkpoint::load(path)?;
    checkpoint::ensure_kind(path, &saved.train_config, checkpoint::CheckpointKind::Language)?;
    checkpoint::ensure_finite_weights(path, &saved.weights)?;
    let config: LlamaConfig = serde_json::from_str(&saved.model_config).context("checkpoint model config")?;
    crate::model_fit::check_model_config(path, &config, &saved.weights)?;
    let model = Llama::new(&config, 0)?;
    checkpoint::load_weights(&model, &saved.weights).with_context(|| format!("checkpoint {}", path.display()))?;
    model.to_device(args.device)?;
    let tokenizer_name = args.tokenizer.clone().unwrap_or_else(|| trained_tokenizer(&saved.train_config));
    let tokenizer = Tokenizer::from_name(&tokenizer_name)?;
    tokenizer.ensure_vocab(config.vocab_size)?;
    let sequence = read_sequence(args, &tokenizer, config.vocab_size, config.seq_len)?;
    let seq = sequence.ids.len();
    let ids = Tokens::new(&sequence.ids, args.device)?;
    let (logits, traces) = no_grad(|| model.forward_with_trace(&ids, 1, seq))?;
    let next_token_loss = mean_next_token_loss(&logits.value().to_host()?.to_vec(), &sequence.ids, config.vocab_size);

    let mut out = Output::new(&args.out)?;
    let model_cost = cost::model_cost(&model, seq);
    let mut summary = serde_json::json!({
        "checkpoint": path.display().to_string(),
        "step": saved.step,
        "variant": config.variant,
        "preset": config.preset,
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "tokenizer": tokenizer.name(),
        "tokens": seq,
        "next_token_loss": next_token_loss,
        "cost": serde_json::to_value(&model_cost)?,
    });
    let mut highlights = serde_json::json!({
        "variant": config.variant,
        "tokens": seq,
        "next_token_loss": next_token_loss,
        "parameters": model_cost.parameters,
        "mflops_per_token": model_cost.flops_per_token as f64 / 1e6,
    });
    let gates: Vec<&GateTrace> = traces.iter().filter(|t| t.kind == "gate").collect();
    if !gates.is_empty() {
        let found = modulators::write(&mut out, &gates, &sequence, config.n_layers, &args.projection)?;
        summary["modulators"] = found.clone();
        highlights["modulators"] = found["highlights"].clone();
    }
    let ccl_traces: Vec<&GateTrace> = traces.iter().filter(|t| t.kind.starts_with("gate_")).collect();
    if config.variant == "ccl" {
        let found = ccl::write(&mut out, &model, &ccl_traces, &sequence, args.top_tokens)?;
        summary["ccl"] = found.clone();
        highlights["ccl"] = found["highlights"].clone();
    }
    summary["highlights"] = highlights;
    out.json("summary.json", &summary)?;
    Ok(AnalysisReport { files: out.files, summary })
}

/// Mean cross-entropy of `ids[t + 1]` given positions ≤ t, over the first T − 1 positions
/// of `logits: [T, V]` (computed in f64).
fn mean_next_token_loss(logits: &[f32], ids: &[u32], vocab: usize) -> f64 {
    let positions = ids.len().saturating_sub(1);
    let total: f64 = (0..positions)
        .map(|t| {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let log_sum = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
            log_sum - row[ids[t + 1] as usize] as f64
        })
        .sum();
    total / positions.max(1) as f64
}
