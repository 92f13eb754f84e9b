//! Decoding with a KV cache gives the logits of the full forward pass at every position,
//! for every LLaMA variant and the option combinations that change what a block reads
//! (CCL's causal running mean, post-ln, coverage, φ): two sequences of different lengths,
//! each prompt run alone, then a two-token chunk and single tokens for the pair as a batch.
//! The same check runs on a CUDA device (real or emulated) when there is one.

use autograd::no_grad;
use models::llama::{DecodeCache, Llama, LlamaConfig, VARIANTS};
use nn::Module;
use tensor::{Device, Rng, Tensor, Tokens};

const VOCAB: usize = 40;
/// The two sequences: (prompt length, total length); both leave 7 tokens to decode.
const SEQUENCES: [(usize, usize); 2] = [(5, 12), (3, 10)];
const ATOL: f32 = 2e-5;
const RTOL: f32 = 1e-4;

/// A small model of every block part: 4 layers (so mix-ln has a post-ln layer), head dim 8.
fn small(variant: &str) -> LlamaConfig {
    let ccl = variant == "ccl";
    LlamaConfig {
        d_model: 32,
        ffn_hidden: 48,
        n_layers: 4,
        n_heads: 4,
        vocab_size: VOCAB,
        seq_len: 32,
        rank: 4,
        d_basis: if ccl { 8 } else { 64 },
        d_ctx: if ccl { 8 } else { 64 },
        per_token_rank: 4,
        variant: variant.into(),
        ..LlamaConfig::default()
    }
}

/// The model with every parameter moved off its init (zero-initialised parts such as the
/// per-token `U`, ReZero's α and LAuReL's `B` and γ would otherwise hide a wrong cache).
fn perturbed_model(config: &LlamaConfig, device: Device) -> Llama {
    let model = Llama::new(config, 11).unwrap_or_else(|e| panic!("{}: {e}", config.variant));
    let mut rng = Rng::new(5);
    for p in model.named_parameters() {
        let value = p.var.value();
        let noise = Tensor::rand_normal(value.shape(), 0.0, 0.1, &mut rng);
        p.var.set_value(value.add(&noise).unwrap()).unwrap();
    }
    model.to_device(device).unwrap();
    model
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(VOCAB as u64) as u32).collect()
}

/// `ids` on `model`'s device.
fn on(model: &Llama, ids: &[u32]) -> Tokens {
    Tokens::new(ids, model.device()).unwrap()
}

/// Rows of a `[N, V]` logits tensor, on the host.
fn rows(logits: &Tensor) -> Vec<Vec<f32>> {
    logits.to_host().unwrap().to_vec().chunks(VOCAB).map(<[f32]>::to_vec).collect()
}

/// Logits of every position of each sequence, decoded through a cache: prompts alone, then
/// a 2-token chunk per sequence, then one token at a time, the sequences as one batch.
fn cached_logits(model: &Llama, sequences: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    let mut out: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut caches = Vec::new();
    for (sequence, &(prompt, _)) in sequences.iter().zip(&SEQUENCES) {
        let mut cache = DecodeCache::new(model, 1);
        let logits = model.forward_cached(&on(model, &sequence[..prompt]), 1, prompt, &mut cache).unwrap();
        out.push(rows(&logits.value()));
        caches.push(cache);
    }
    let mut cache = DecodeCache::stack(caches).unwrap();
    let remaining = SEQUENCES[0].1 - SEQUENCES[0].0;
    let mut done = 0;
    while done < remaining {
        let chunk = if done == 0 { 2 } else { 1 };
        let ids: Vec<u32> = sequences
            .iter()
            .zip(&SEQUENCES)
            .flat_map(|(s, &(prompt, _))| s[prompt + done..prompt + done + chunk].to_vec())
            .collect();
        let logits = rows(&model.forward_cached(&on(model, &ids), sequences.len(), chunk, &mut cache).unwrap().value());
        for (i, chunk_rows) in logits.chunks(chunk).enumerate() {
            out[i].extend(chunk_rows.iter().cloned());
        }
        done += chunk;
    }
    let lengths: Vec<usize> = SEQUENCES.iter().map(|&(_, total)| total).collect();
    assert_eq!(cache.lengths(), lengths, "cache lengths after decoding");
    out
}

/// Asserts the cached and full-forward logits of `config`'s model agree at every position.
fn check(config: &LlamaConfig, device: Device) {
    let what = format!(
        "{} (post_ln {}, coverage {}, ccl {})",
        config.variant, config.post_ln, config.coverage, config.ccl_mode
    );
    let model = perturbed_model(config, device);
    let sequences: Vec<Vec<u32>> = SEQUENCES.iter().enumerate().map(|(i, &(_, n))| tokens(n, 20 + i as u64)).collect();
    let cached = cached_logits(&model, &sequences);
    for (i, sequence) in sequences.iter().enumerate() {
        let full = rows(&no_grad(|| model.forward(&on(&model, sequence), 1, sequence.len())).unwrap().value());
        assert_eq!(cached[i].len(), full.len(), "{what}: positions of sequence {i}");
        for (t, (got, want)) in cached[i].iter().zip(&full).enumerate() {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= ATOL + RTOL * scale,
                    "{what} on {device:?}, sequence {i} position {t}: cached {g} vs full {w}"
                );
            }
        }
    }
}

/// Option combinations whose blocks read something the plain variants do not.
fn combinations() -> Vec<LlamaConfig> {
    vec![
        LlamaConfig { ccl_mode: "causal-mean".into(), ..small("ccl") },
        LlamaConfig { ccl_ablation: "static".into(), ..small("ccl") },
        LlamaConfig { post_ln: true, ..small("transponder") },
        LlamaConfig { coverage: "only-qk".into(), phi: "silu".into(), ..small("comt") },
        LlamaConfig { fused: false, ..small("transponder") },
    ]
}

#[test]
fn cached_decoding_matches_the_full_forward_for_every_variant() {
    for (_, name) in VARIANTS {
        check(&small(name), Device::Cpu);
    }
    for config in combinations() {
        check(&config, Device::Cpu);
    }
}

#[test]
fn a_cache_for_another_batch_or_model_is_an_error() {
    let model = Llama::new(&small("pre-ln"), 1).unwrap();
    let mut cache = DecodeCache::new(&model, 2);
    let err = model.forward_cached(&on(&model, &[1, 2]), 1, 2, &mut cache).unwrap_err().to_string();
    assert!(err.contains("2 sequences"), "{err}");
    let deeper = Llama::new(&LlamaConfig { n_layers: 5, ..small("pre-ln") }, 1).unwrap();
    let mut other = DecodeCache::new(&deeper, 1);
    assert!(model.forward_cached(&on(&model, &[1]), 1, 1, &mut other).is_err());
    assert!(DecodeCache::stack(vec![DecodeCache::new(&model, 1), other]).is_err());
}

#[cfg(feature = "cuda")]
#[test]
fn cached_decoding_matches_the_full_forward_on_cuda() {
    if !tensor::cuda::is_available() {
        let required = std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_some();
        assert!(!required, "TRANSPONDER_REQUIRE_CUDA is set: no CUDA device");
        eprintln!("skipping: no CUDA device");
        return;
    }
    let variants = ["pre-ln", "transponder", "path-channel", "comt", "per-token", "token-scale", "ccl", "laurel-pa"];
    for name in variants {
        check(&small(name), Device::Cuda(0));
    }
    check(&LlamaConfig { post_ln: true, ..small("transponder") }, Device::Cuda(0));
}
