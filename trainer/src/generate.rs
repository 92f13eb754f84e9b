//! Loading a trained model back and generating text from it: a batch of prompts, each run
//! through the model in one forward pass, then one token per step per sequence from a KV
//! cache ([`generate`]); [`generate_uncached`] recomputes the whole prefix each step (the
//! reference the cache is checked and benchmarked against).
//!
//! Sampling happens on the host from the last position's logits: `softmax(logits / T)`
//! restricted to the `top_k` most likely tokens (0 = all) and then to the smallest set whose
//! probability reaches `top_p` (1 = all); temperature 0 picks the most likely token. One
//! seeded generator draws for every sequence in order, so a run is reproducible.
//!
//! The model reads at most its training context (`seq_len`) positions: prompts must be
//! shorter, and generation stops, saying so, when the longest sequence reaches it (no
//! sliding window: RoPE positions past the training context are untrained).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autograd::no_grad;
use models::llama::{DecodeCache, Llama, LlamaConfig};
use nn::Module;
use tensor::{Rng, Tokens};

use crate::checkpoint;
use crate::tokenizer::{trained_tokenizer, Tokenizer};

/// A model rebuilt from a checkpoint file, with its config.
pub fn load_model(path: &Path) -> Result<(Llama, LlamaConfig)> {
    let (model, config, _) = load_model_and_tokenizer(path)?;
    Ok((model, config))
}

/// A model rebuilt from a checkpoint file, with its config and the tokenizer it was trained
/// with (its training config's `tokenizer`; `byte` for checkpoints that do not name one).
pub fn load_model_and_tokenizer(path: &Path) -> Result<(Llama, LlamaConfig, Tokenizer)> {
    let saved = checkpoint::load(path)?;
    checkpoint::ensure_kind(path, &saved.train_config, checkpoint::CheckpointKind::Language)?;
    checkpoint::ensure_finite_weights(path, &saved.weights)?;
    let config: LlamaConfig = serde_json::from_str(&saved.model_config).context("checkpoint model config")?;
    crate::model_fit::check_model_config(path, &config, &saved.weights)?;
    let model = Llama::new(&config, 0)?;
    checkpoint::load_weights(&model, &saved.weights).with_context(|| format!("checkpoint {}", path.display()))?;
    let tokenizer = Tokenizer::from_name(&trained_tokenizer(&saved.train_config))
        .with_context(|| format!("the tokenizer of {}", path.display()))?;
    Ok((model, config, tokenizer))
}

/// How many tokens to generate and how to pick each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingOptions {
    /// New tokens per prompt, at most (generation stops earlier at the context length).
    pub max_new_tokens: usize,
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1 = all).
    pub top_p: f32,
    /// Seed of the sampling generator.
    pub seed: u64,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions { max_new_tokens: 200, temperature: 0.8, top_k: 40, top_p: 1.0, seed: 0 }
    }
}

impl SamplingOptions {
    /// Errors on a temperature or top-p outside its range.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature must be 0 (greedy) or positive, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must be in (0, 1], got {}", self.top_p);
        }
        Ok(())
    }
}

/// What a generation run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Each prompt followed by its new tokens (all prompts get the same number).
    pub sequences: Vec<Vec<u32>>,
    /// New tokens per sequence.
    pub new_tokens: usize,
    /// Set when generation stopped at the model's context length before `max_new_tokens`.
    pub stopped_at_context: Option<usize>,
    /// Wall time of the whole run (prompt passes included).
    pub seconds: f64,
}

impl Generation {
    /// New tokens over all sequences per second of wall time.
    pub fn tokens_per_second(&self) -> f64 {
        (self.new_tokens * self.sequences.len()) as f64 / self.seconds.max(1e-9)
    }
}

/// Checks the prompts against the model and returns the most new tokens that fit the context.
fn room_for_new_tokens(config: &LlamaConfig, prompts: &[Vec<u32>], options: &SamplingOptions) -> Result<usize> {
    options.validate()?;
    if prompts.is_empty() {
        bail!("generation needs at least one prompt");
    }
    let context = config.seq_len;
    for (i, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            bail!("prompt {i} is empty; sampling needs a prompt of at least one token");
        }
        if prompt.len() >= context {
            bail!(
                "prompt {i} has {} tokens; the model's context is {context}, leaving no room to generate",
                prompt.len()
            );
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= config.vocab_size) {
            bail!("prompt {i} has token {bad}, outside the model's vocabulary of {}", config.vocab_size);
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    Ok(options.max_new_tokens.min(context - longest))
}

/// Extends every prompt by up to `options.max_new_tokens` sampled tokens with a KV cache:
/// each prompt in one forward pass, then one forward pass per step over the batch's newest
/// tokens (one position each), on the model's device. The steps' token ids share one
/// [`Tokens`], refilled in place each step.
pub fn generate(model: &Llama, prompts: &[Vec<u32>], options: &SamplingOptions) -> Result<Generation> {
    let steps = room_for_new_tokens(&model.config, prompts, options)?;
    let start = Instant::now();
    let device = model.device();
    let mut rng = Rng::new(options.seed);
    let mut sequences = prompts.to_vec();
    let mut caches = Vec::with_capacity(prompts.len());
    let mut logits = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut cache = DecodeCache::new(model, 1);
        let all = model.forward_cached(&Tokens::new(prompt, device)?, 1, prompt.len(), &mut cache)?.value();
        logits.push(all.narrow(0, prompt.len() - 1, 1)?.to_host()?.to_vec());
        caches.push(cache);
    }
    let mut cache = DecodeCache::stack(caches)?;
    let vocab = model.config.vocab_size;
    let mut newest: Option<Tokens> = None;
    for step in 0..steps {
        let next: Vec<u32> = logits.iter().map(|row| pick(row, options, &mut rng)).collect();
        for (sequence, &token) in sequences.iter_mut().zip(&next) {
            sequence.push(token);
        }
        if step + 1 == steps {
            break;
        }
        let ids = match &mut newest {
            Some(ids) => {
                ids.refill(&next)?;
                ids
            }
            None => newest.insert(Tokens::new(&next, device)?),
        };
        let all = model.forward_cached(ids, next.len(), 1, &mut cache)?.value().to_host()?.to_vec();
        logits = all.chunks(vocab).map(<[f32]>::to_vec).collect();
    }
    Ok(finish(sequences, prompts, steps, options, start))
}

/// [`generate`] without a cache: every step runs the model over each whole sequence so far
/// (one sequence at a time) and keeps the last position's logits. Same tokens for the same
/// seed up to float rounding; for checking and benchmarking the cached path.
pub fn generate_uncached(model: &Llama, prompts: &[Vec<u32>], options: &SamplingOptions) -> Result<Generation> {
    let steps = room_for_new_tokens(&model.config, prompts, options)?;
    let start = Instant::now();
    let mut rng = Rng::new(options.seed);
    let mut sequences = prompts.to_vec();
    for _ in 0..steps {
        for sequence in sequences.iter_mut() {
            // The sequence grows by a token per step, so this step's buffer sizes do not recur.
            let _release_pool = tensor::pool::ReleaseOnDrop;
            let ids = Tokens::new(sequence, model.device())?;
            let logits = no_grad(|| model.forward(&ids, 1, sequence.len()))?.value();
            let last = logits.narrow(0, sequence.len() - 1, 1)?.to_host()?.to_vec();
            sequence.push(pick(&last, options, &mut rng));
        }
    }
    Ok(finish(sequences, prompts, steps, options, start))
}

fn finish(
    sequences: Vec<Vec<u32>>,
    prompts: &[Vec<u32>],
    steps: usize,
    options: &SamplingOptions,
    start: Instant,
) -> Generation {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    Generation {
        sequences,
        new_tokens: steps,
        stopped_at_context: (steps < options.max_new_tokens).then_some(longest + steps),
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// Samples one index from `logits` with temperature, top-k and top-p (see the module doc).
fn pick(logits: &[f32], options: &SamplingOptions, rng: &mut Rng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if options.temperature == 0.0 {
        return order[0] as u32;
    }
    if options.top_k > 0 {
        order.truncate(options.top_k);
    }
    let max = logits[order[0]];
    let mut weights: Vec<f64> =
        order.iter().map(|&i| (((logits[i] - max) / options.temperature) as f64).exp()).collect();
    if options.top_p < 1.0 {
        let total: f64 = weights.iter().sum();
        let mut cumulative = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                cumulative += w / total;
                cumulative >= options.top_p as f64
            })
            .map_or(weights.len(), |last| last + 1);
        weights.truncate(keep);
        order.truncate(keep);
    }
    let mut target = rng.uniform() as f64 * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        target -= w;
        if target <= 0.0 {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(temperature: f32, top_k: usize, top_p: f32) -> SamplingOptions {
        SamplingOptions { max_new_tokens: 1, temperature, top_k, top_p, seed: 3 }
    }

    #[test]
    fn greedy_top_k_and_top_p_keep_only_the_allowed_tokens() {
        let logits = [0.0, 3.0, 2.9, -1.0, 1.0];
        let mut rng = Rng::new(1);
        assert_eq!(pick(&logits, &options(0.0, 0, 1.0), &mut rng), 1);
        for _ in 0..200 {
            assert!([1, 2].contains(&pick(&logits, &options(1.0, 2, 1.0), &mut rng)));
            // p(1) ≈ 0.47, p(2) ≈ 0.43: 0.5 needs both, 0.4 only the first.
            assert!([1, 2].contains(&pick(&logits, &options(1.0, 0, 0.5), &mut rng)));
            assert_eq!(pick(&logits, &options(1.0, 0, 0.4), &mut rng), 1);
        }
        let seen: std::collections::BTreeSet<u32> =
            (0..500).map(|_| pick(&logits, &options(1.0, 0, 1.0), &mut rng)).collect();
        assert_eq!(seen.len(), 5, "{seen:?}");
    }

    #[test]
    fn bad_options_and_prompts_are_errors() {
        assert!(options(-1.0, 0, 1.0).validate().is_err());
        assert!(options(1.0, 0, 0.0).validate().is_err());
        assert!(options(1.0, 0, 1.5).validate().is_err());
        let config = LlamaConfig { vocab_size: 10, seq_len: 4, ..LlamaConfig::default() };
        let ok = options(1.0, 0, 1.0);
        assert!(room_for_new_tokens(&config, &[], &ok).is_err());
        assert!(room_for_new_tokens(&config, &[vec![]], &ok).is_err());
        assert!(room_for_new_tokens(&config, &[vec![1, 2, 3, 4]], &ok).unwrap_err().to_string().contains("context"));
        assert!(room_for_new_tokens(&config, &[vec![10]], &ok).unwrap_err().to_string().contains("vocabulary"));
        let many = SamplingOptions { max_new_tokens: 100, ..ok };
        assert_eq!(room_for_new_tokens(&config, &[vec![1], vec![1, 2]], &many).unwrap(), 2);
    }
}
