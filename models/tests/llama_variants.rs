//! Every LLaMA variant builds, runs forward and backward with a finite loss and a finite
//! gradient for every parameter; names are checked; parameter overheads of llama-60m match
//! SPEC §6; the baseline and Transponder overfit a fixed batch.

use std::time::Instant;

use autograd::Var;
use models::llama::{Llama, LlamaConfig, TRANSPONDER_ALIAS, VARIANTS};
use nn::optim::{Adam, AdamConfig, Optimizer};
use nn::Module;
use tensor::{Device, Rng, Tokens};

const BATCH: usize = 2;
const SEQ: usize = 16;

/// llama-tiny with a byte vocabulary and a short context, for speed.
fn tiny(variant: &str) -> LlamaConfig {
    LlamaConfig { vocab_size: 256, seq_len: SEQ, variant: variant.into(), ..LlamaConfig::preset("llama-tiny").unwrap() }
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// `ids` on the CPU, as the models read them.
fn cpu(ids: &[u32]) -> Tokens {
    Tokens::new(ids, Device::Cpu).unwrap()
}

/// One forward and backward; returns the loss after checking every gradient.
fn loss_and_check_gradients(config: &LlamaConfig) -> f32 {
    let model = Llama::new(config, 7).unwrap_or_else(|e| panic!("{}: {e}", config.variant));
    let ids = cpu(&tokens(BATCH * SEQ, config.vocab_size, 1));
    let targets = cpu(&tokens(BATCH * SEQ, config.vocab_size, 2));
    let loss = model.loss(&ids, &targets, BATCH, SEQ).unwrap();
    loss.backward().unwrap();
    let value = loss.value().item().unwrap();
    assert!(value.is_finite(), "{}: loss {value}", config.variant);
    let params = model.named_parameters();
    let mut nonzero = 0;
    for p in &params {
        let grad = p.var.grad().unwrap_or_else(|| panic!("{} {}: no gradient", config.variant, p.name)).to_vec();
        assert!(grad.iter().all(|g| g.is_finite()), "{} {}: non-finite gradient", config.variant, p.name);
        nonzero += usize::from(grad.iter().any(|&g| g != 0.0));
    }
    // ReZero starts with α = 0, which zeroes every gradient inside the blocks; everything
    // else must move most of its parameters from step one.
    let expected = if config.variant == "rezero" { 3 } else { params.len() / 2 };
    assert!(nonzero >= expected, "{}: only {nonzero} of {} gradients are nonzero", config.variant, params.len());
    value
}

#[test]
fn every_variant_runs_forward_and_backward() {
    let start = Instant::now();
    let mut names: Vec<&str> = VARIANTS.iter().map(|(_, n)| *n).collect();
    names.push(TRANSPONDER_ALIAS);
    for name in names {
        let loss = loss_and_check_gradients(&tiny(name));
        // Small init: the first loss sits near ln V for every variant.
        assert!((loss - (256f32).ln()).abs() < 0.5, "{name}: initial loss {loss}");
    }
    println!("{} variants in {:.2?}", VARIANTS.len() + 1, start.elapsed());
}

/// A change applied to a tiny config.
type Change = fn(&mut LlamaConfig);

#[test]
fn combinations_run_forward_and_backward() {
    let combos: [(&str, Change); 10] = [
        ("transponder", |c| c.post_ln = true),
        ("comt", |c| c.post_ln = true),
        ("layer-channel-scalar", |c| c.coverage = "only-qk".into()),
        ("layer-scalar", |c| c.coverage = "no-up-gate".into()),
        ("comt", |c| c.coverage = "only-last".into()),
        ("path-channel", |c| c.coverage = "mlp".into()),
        ("transponder", |c| c.phi = "relu".into()),
        ("transponder", |c| c.fused = false),
        ("layer-channel", |c| c.fixed_alpha = true),
        ("non-contextual", |c| c.coverage = "only-first".into()),
    ];
    for (variant, change) in combos {
        let mut config = tiny(variant);
        change(&mut config);
        loss_and_check_gradients(&config);
    }
}

#[test]
fn parameter_names_follow_hugging_face() {
    let names = |variant: &str| -> Vec<String> {
        Llama::new(&tiny(variant), 0).unwrap().named_parameters().into_iter().map(|p| p.name).collect()
    };
    let base = names("pre-ln");
    for expected in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(base.iter().any(|n| n == expected), "missing {expected}");
    }
    assert_eq!(base.len(), 2 + 4 * 9 + 1);
    let transponder = names("transponder");
    assert!(transponder.iter().any(|n| n == "model.layers.0.self_attn.q_proj.modulator_channel.A"));
    assert!(transponder.iter().any(|n| n == "model.layers.2.mlp.up_proj.modulator_scalar.alpha"));
    // fixed-alpha: α is a constant, not a parameter.
    assert!(!names("fixed-alpha").iter().any(|n| n.ends_with("alpha")));
    assert!(names("sdpa-gate").iter().any(|n| n == "model.layers.0.self_attn.sdpa_gate.weight"));
    assert!(names("rezero").iter().any(|n| n == "model.layers.0.resweight"));
}

#[test]
fn unknown_names_error_and_list_the_valid_ones() {
    let error = |change: Change| {
        let mut config = tiny("pre-ln");
        change(&mut config);
        Llama::new(&config, 0).err().expect("invalid config must be an error").to_string()
    };
    let e = error(|c| c.variant = "transformer".into());
    assert!(e.contains("layer-channel-scalar") && e.contains("sdpa-gate") && e.contains("dyt"), "{e}");
    let e = error(|c| c.coverage = "everything".into());
    assert!(e.contains("only-first") && e.contains("no-up-gate"), "{e}");
    let e = error(|c| c.phi = "tanh".into());
    assert!(e.contains("sigmoid") && e.contains("relu"), "{e}");
    let e = error(|c| {
        c.variant = "deepnorm".into();
        c.post_ln = true;
    });
    assert!(e.contains("post_ln"), "{e}");
    let e = LlamaConfig::preset("llama-2").unwrap_err().to_string();
    assert!(e.contains("llama-60m") && e.contains("llama-350m"), "{e}");
}

#[test]
fn llama_60m_parameter_overheads_match_the_papers() {
    // The vocabulary only sizes the embedding and the LM head (V × d each), so the variants
    // are built with V = 2 and shifted to V = 32,000: drawing 33M normals per model costs
    // seconds, and the gates' own counts do not depend on V.
    const SMALL_VOCAB: usize = 2;
    let preset = LlamaConfig::preset("llama-60m").unwrap();
    let count = |variant: &str, vocab_size: usize| -> usize {
        let config = LlamaConfig { variant: variant.into(), vocab_size, ..preset.clone() };
        Llama::new(&config, 0).unwrap().num_parameters()
    };
    let base = count("pre-ln", preset.vocab_size);
    let vocab_shift = 2 * (preset.vocab_size - SMALL_VOCAB) * preset.d_model;
    let overhead = |variant: &str| -> f64 {
        let extra = (count(variant, SMALL_VOCAB) + vocab_shift) as f64 / base as f64 - 1.0;
        println!("llama-60m {variant}: +{:.2}%", 100.0 * extra);
        100.0 * extra
    };
    println!("llama-60m pre-ln: {base} parameters ({:.2}M)", base as f64 / 1e6);
    assert!((55_000_000..61_000_000).contains(&base), "{base}");
    assert!(overhead("pre-ln").abs() < 1e-9, "the vocabulary shift must be exact");
    let transponder = overhead("transponder");
    assert!((0.8..2.5).contains(&transponder), "{transponder}");
    let sdpa = overhead("sdpa-gate");
    assert!((12.0..17.0).contains(&sdpa), "{sdpa}");
    let all = overhead("all-gate");
    assert!((40.0..48.0).contains(&all), "{all}");
}

/// Adam on one fixed batch (vocab 32, B = 2, T = 16); returns the final loss.
fn overfit(variant: &str, steps: usize) -> f32 {
    let config = LlamaConfig { vocab_size: 32, ..tiny(variant) };
    let model = Llama::new(&config, 3).unwrap();
    let ids = tokens(BATCH * SEQ + 1, 32, 11);
    let (inputs, targets) = (cpu(&ids[..BATCH * SEQ]), cpu(&ids[1..]));
    let config = AdamConfig { weight_decay: 0.0, ..AdamConfig::default() };
    let mut optimizer = Adam::new(model.named_parameters(), config);
    let mut loss = f32::INFINITY;
    for _ in 0..steps {
        optimizer.zero_grad();
        let l: Var = model.loss(&inputs, &targets, BATCH, SEQ).unwrap();
        l.backward().unwrap();
        optimizer.step(3e-3).unwrap();
        loss = l.value().item().unwrap();
    }
    loss
}

#[test]
fn pre_ln_overfits_a_fixed_batch() {
    let start = Instant::now();
    let loss = overfit("pre-ln", 120);
    println!("pre-ln: loss {loss:.4} after 120 steps in {:.2?}", start.elapsed());
    assert!(loss < 0.3, "{loss}");
}

#[test]
fn transponder_overfits_a_fixed_batch() {
    let start = Instant::now();
    let loss = overfit("transponder", 120);
    println!("transponder: loss {loss:.4} after 120 steps in {:.2?}", start.elapsed());
    assert!(loss < 0.3, "{loss}");
}

#[test]
fn fused_and_unfused_transponder_agree() {
    let run = |fused: bool| {
        let model = Llama::new(&LlamaConfig { fused, ..tiny("transponder") }, 5).unwrap();
        let ids = cpu(&tokens(BATCH * SEQ, 256, 4));
        let loss = model.loss(&ids, &cpu(&tokens(BATCH * SEQ, 256, 6)), BATCH, SEQ).unwrap();
        loss.backward().unwrap();
        let grads: Vec<Vec<f32>> = model.named_parameters().iter().map(|p| p.var.grad().unwrap().to_vec()).collect();
        (loss.value().item().unwrap(), grads)
    };
    let (fused, unfused) = (run(true), run(false));
    assert!((fused.0 - unfused.0).abs() < 1e-5, "{} vs {}", fused.0, unfused.0);
    for (a, b) in fused.1.iter().zip(&unfused.1) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-3 * scale + 1e-7));
    }
}

#[test]
fn same_seed_same_model() {
    let a = Llama::new(&tiny("transponder"), 9).unwrap().named_parameters();
    let b = Llama::new(&tiny("transponder"), 9).unwrap().named_parameters();
    assert!(a.iter().zip(&b).all(|(x, y)| x.var.value().to_vec() == y.var.value().to_vec()));
}
