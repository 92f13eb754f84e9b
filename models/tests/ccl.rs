//! The `ccl` LLaMA variant (SPEC §3) and the gate trace: parameter names and counts, config
//! options and their errors, the width override, causality of the whole model in both
//! context modes, overfitting a fixed batch, and `forward_with_trace` (same logits as
//! `forward`, every gate named and shaped).

use autograd::{no_grad, Var};
use models::llama::{Llama, LlamaConfig};
use nn::optim::{Adam, AdamConfig, Optimizer};
use nn::Module;
use tensor::{Device, Rng, Tokens};

const SEQ: usize = 12;

fn tiny(variant: &str) -> LlamaConfig {
    LlamaConfig { vocab_size: 64, seq_len: SEQ, variant: variant.into(), ..LlamaConfig::preset("llama-tiny").unwrap() }
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(64) as u32).collect()
}

/// `ids` on the CPU, as the model reads them.
fn cpu(ids: &[u32]) -> Tokens {
    Tokens::new(ids, Device::Cpu).unwrap()
}

#[test]
fn ccl_names_options_and_errors() {
    let model = Llama::new(&tiny("ccl"), 0).unwrap();
    let names: Vec<String> = model.named_parameters().into_iter().map(|p| p.name).collect();
    for expected in [
        "model.layers.0.mlp.context.weight",
        "model.layers.0.mlp.gate_proj.basis.weight",
        "model.layers.0.mlp.gate_proj.norm.weight",
        "model.layers.0.mlp.gate_proj.mix.weight",
        "model.layers.0.mlp.gate_proj.bias",
        "model.layers.3.mlp.down_proj.gate_basis.weight",
        "model.layers.3.mlp.down_proj.gate_out.bias",
        "model.layers.0.self_attn.q_proj.weight",
    ] {
        assert!(names.iter().any(|n| n == expected), "missing {expected}");
    }
    assert!(!names.iter().any(|n| n.ends_with("mlp.gate_proj.weight")), "the dense FFN must be gone");
    let shape = |name: &str| model.named_parameters().into_iter().find(|p| p.name == name).unwrap().var.shape();
    assert_eq!(shape("model.layers.0.mlp.up_proj.basis.weight"), [64, 128]);
    assert_eq!(shape("model.layers.0.mlp.up_proj.mix.weight"), [344, 64]);
    assert_eq!(shape("model.layers.0.mlp.down_proj.gate_out.weight"), [128, 64]);

    let with = |change: fn(&mut LlamaConfig)| {
        let mut c = tiny("ccl");
        change(&mut c);
        Llama::new(&c, 0).map(|m| m.named_parameters().len()).map_err(|e| e.to_string())
    };
    assert!(with(|c| c.ccl_mode = "mean".into()).unwrap_err().contains("causal-mean"));
    assert!(with(|c| c.ccl_ablation = "none-at-all".into()).unwrap_err().contains("no-basis-gate"));
    assert!(with(|c| c.d_basis = 0).unwrap_err().contains("d_basis"));
    let pre_ln_with_basis = |c: &mut LlamaConfig| {
        c.variant = "pre-ln".into();
        c.d_basis = 32;
    };
    assert!(with(pre_ln_with_basis).unwrap_err().contains("ccl"));
    let full = with(|_| {}).unwrap();
    assert_eq!(with(|c| c.ccl_mode = "causal-mean".into()).unwrap(), full + 4, "one W_mean per block");
    assert_eq!(with(|c| c.ccl_ablation = "no-out-gate".into()).unwrap(), full - 4 * 3 * 2);
    assert_eq!(with(|c| c.ccl_ablation = "static".into()).unwrap(), full - 4 * (3 * 4 + 1));
}

#[test]
fn width_override_scales_the_ffn() {
    let base = LlamaConfig::preset("llama-tiny").unwrap();
    let narrow = base.with_d_model(64);
    assert_eq!((narrow.d_model, narrow.ffn_hidden, narrow.n_heads), (64, 172, 4));
    assert_eq!(base.with_d_model(512).ffn_hidden, 1376);
    narrow.validate().unwrap();
    assert!(base.with_d_model(36).validate().is_err(), "4 heads of width 9 are odd");
}

/// Changing token t0 changes no logit before t0, in both context modes.
#[test]
fn ccl_model_is_causal() {
    for mode in ["token", "causal-mean"] {
        let model = Llama::new(&LlamaConfig { ccl_mode: mode.into(), ..tiny("ccl") }, 1).unwrap();
        let ids = tokens(SEQ, 3);
        let logits = |ids: &[u32]| no_grad(|| model.forward(&cpu(ids), 1, SEQ)).unwrap().value().to_vec();
        let before = logits(&ids);
        let t0 = 7;
        let mut changed = ids.clone();
        changed[t0] = (changed[t0] + 1) % 64;
        let after = logits(&changed);
        let v = 64;
        assert_eq!(before[..t0 * v], after[..t0 * v], "{mode}: an earlier logit changed");
        assert_ne!(before[t0 * v..(t0 + 1) * v], after[t0 * v..(t0 + 1) * v]);
    }
}

#[test]
fn ccl_overfits_a_fixed_batch() {
    let model = Llama::new(&LlamaConfig { vocab_size: 32, ..tiny("ccl") }, 3).unwrap();
    let ids: Vec<u32> = tokens(2 * SEQ + 1, 11).into_iter().map(|t| t % 32).collect();
    let (inputs, targets) = (cpu(&ids[..2 * SEQ]), cpu(&ids[1..]));
    let mut optimizer = Adam::new(model.named_parameters(), AdamConfig { weight_decay: 0.0, ..AdamConfig::default() });
    let mut loss = f32::INFINITY;
    for _ in 0..100 {
        optimizer.zero_grad();
        let l: Var = model.loss(&inputs, &targets, 2, SEQ).unwrap();
        l.backward().unwrap();
        optimizer.step(3e-3).unwrap();
        loss = l.value().item().unwrap();
    }
    assert!(loss < 0.5, "{loss}");
}

#[test]
fn trace_names_every_gate_and_keeps_the_logits() {
    let ids = cpu(&tokens(2 * SEQ, 5));
    for (variant, expected) in [("transponder", 4 * 7 * 2), ("comt", 4 * 7), ("path-scalar", 4 * 2), ("ccl", 4 * 3 * 2)]
    {
        let model = Llama::new(&tiny(variant), 2).unwrap();
        let plain = no_grad(|| model.forward(&ids, 2, SEQ)).unwrap().value().to_vec();
        let (logits, traces) = no_grad(|| model.forward_with_trace(&ids, 2, SEQ)).unwrap();
        assert_eq!(logits.value().to_vec(), plain, "{variant}: tracing changed the logits");
        assert_eq!(traces.len(), expected, "{variant}");
        assert!(traces.iter().all(|t| t.value.shape()[0] == 2 * SEQ), "{variant}: one row per token");
        let names: Vec<String> = traces.iter().map(|t| format!("{} {}", t.name, t.kind)).collect();
        let want = match variant {
            "transponder" => "model.layers.2.mlp.down_proj.modulator_scalar gate",
            "comt" => "model.layers.0.self_attn.q_proj.modulator gate",
            "path-scalar" => "model.layers.1.mlp.modulator_scalar gate",
            _ => "model.layers.3.mlp.up_proj gate_out",
        };
        assert!(names.iter().any(|n| n == want), "{variant}: no `{want}` in {names:?}");
        let scalar = traces.iter().find(|t| t.name.ends_with("q_proj.modulator_scalar"));
        if let Some(s) = scalar {
            assert_eq!(s.value.shape(), [2 * SEQ, 1]);
            assert_eq!(s.local_name(), "self_attn.q_proj.modulator_scalar");
        }
    }
    // Nothing is recorded by the plain forward.
    let (_, none) = nn::trace::capture(|| ());
    assert!(none.is_empty());
}
