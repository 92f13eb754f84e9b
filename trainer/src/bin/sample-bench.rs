//! `sample-bench`: generation speed with and without the KV cache.
//!
//! Protocol: a LLaMA preset of `--variant` (random init, seed 1, byte vocabulary 256, context
//! prompt + new tokens), one prompt of `--prompt-tokens` random byte ids, `--new-tokens`
//! greedy tokens through [`generate`] (KV cache) and [`generate_uncached`] (the whole prefix
//! each step), `--repeats` times each, alternating; tokens/s = new tokens / wall time of the
//! whole call (prompt pass included), the median over repeats. Both paths must pick the same
//! tokens (greedy), which the bench checks. Prints one line per path and a JSON summary.
//!
//! ```text
//! cargo run --release -p trainer --bin sample-bench -- --model llama-small --new-tokens 256
//! ```

use anyhow::{bail, Result};
use clap::Parser;
use models::llama::{Llama, LlamaConfig};
use nn::Module;
use tensor::{Device, Rng};
use trainer::device::{device_name, ensure_available, parse_device};
use trainer::generate::{generate, generate_uncached, Generation, SamplingOptions};

#[derive(Parser)]
#[command(name = "sample-bench", about = "Generation tokens/s with and without the KV cache")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "llama-tiny")]
    model: String,
    /// Variant.
    #[arg(long, default_value = "pre-ln")]
    variant: String,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// New tokens generated.
    #[arg(long, default_value_t = 256)]
    new_tokens: usize,
    /// Timed runs of each path (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    trainer::threads::on_worker_pool(args.threads, || run(&args))?
}

fn run(args: &Args) -> Result<()> {
    ensure_available(args.device)?;
    if args.repeats == 0 || args.prompt_tokens == 0 {
        bail!("--repeats and --prompt-tokens must be positive");
    }
    let config = LlamaConfig {
        vocab_size: 256,
        seq_len: args.prompt_tokens + args.new_tokens,
        variant: args.variant.clone(),
        ..LlamaConfig::preset(&args.model)?
    };
    let model = Llama::new(&config, 1)?;
    model.to_device(args.device)?;
    let mut rng = Rng::new(2);
    let prompt: Vec<u32> = (0..args.prompt_tokens).map(|_| rng.below(256) as u32).collect();
    let options = SamplingOptions { max_new_tokens: args.new_tokens, temperature: 0.0, ..SamplingOptions::default() };
    let prompts = [prompt];
    // One untimed run of each warms the buffer pools and the RoPE tables.
    generate(&model, &prompts, &options)?;
    generate_uncached(&model, &prompts, &options)?;
    let (mut cached, mut uncached): (Vec<Generation>, Vec<Generation>) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats {
        cached.push(generate(&model, &prompts, &options)?);
        uncached.push(generate_uncached(&model, &prompts, &options)?);
    }
    let same = cached[0].sequences == uncached[0].sequences;
    let speed = |runs: &[Generation]| median(runs.iter().map(Generation::tokens_per_second).collect());
    let (with_cache, without_cache) = (speed(&cached), speed(&uncached));
    let device = device_name(args.device);
    let parameters = model.num_parameters();
    for (path, tokens_per_second) in [("KV cache", with_cache), ("no cache", without_cache)] {
        println!(
            "{} {} ({parameters} parameters), prompt {} + {} new tokens, {path}: {tokens_per_second:.1} tokens/s on {device}",
            args.model, args.variant, args.prompt_tokens, args.new_tokens
        );
    }
    println!(
        "{}",
        serde_json::json!({
            "model": args.model,
            "variant": args.variant,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "tokens_per_second_cached": with_cache,
            "tokens_per_second_uncached": without_cache,
            "speedup": with_cache / without_cache,
            "same_tokens": same,
            "device": device,
        })
    );
    if !same {
        bail!("the cached and uncached paths picked different greedy tokens");
    }
    Ok(())
}
