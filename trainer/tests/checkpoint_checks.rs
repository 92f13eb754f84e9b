//! What a checkpoint claims is checked before it is used: every command that reads a model
//! refuses non-finite weights, and a `--tokenizer` whose vocabulary is not the model's.

mod common;

use std::path::Path;

use common::*;
use trainer::safetensors_io::{load_tensors, save_tensors};

/// A copy of the checkpoint `from` at `to` with one weight set to NaN.
fn poisoned_copy(from: &Path, to: &Path) {
    let (mut tensors, metadata) = load_tensors(from).unwrap();
    let weight = tensors.iter_mut().find(|t| !t.name.starts_with("optimizer.")).unwrap();
    weight.data[0] = f32::NAN;
    let slices: Vec<_> = tensors.iter().map(|t| t.as_slice()).collect();
    save_tensors(to, &slices, &metadata).unwrap();
}

/// A one-step byte-level run in `dir/run`; returns its checkpoint's path as a string.
fn trained(dir: &Path) -> String {
    let out = dir.join("run");
    assert_succeeds(&run(dir, &tiny_train(dir, &out, 1)));
    std::fs::write(dir.join("text.txt"), "to be or not to be, that is the question. ".repeat(4)).unwrap();
    out.join("checkpoint.safetensors").display().to_string()
}

#[test]
fn every_command_refuses_non_finite_weights() {
    let dir = scratch("checkpoint-checks", "nan");
    let good = trained(&dir);
    let bad = dir.join("bad.safetensors");
    poisoned_copy(Path::new(&good), &bad);
    let bad = bad.display().to_string();
    for args in [
        strings(&["sample", &bad, "--max-new-tokens", "4"]),
        strings(&["export", &bad, "hf"]),
        strings(&["analyze", "--checkpoint", &bad, "--text", "text.txt", "--out", "analysis"]),
        strings(&["eval", &bad, "val.bin"]),
    ] {
        assert_fails_with(&run(&dir, &args), &["bad.safetensors", "holds NaN", "not finite"]);
    }
    assert!(!dir.join("hf").exists(), "a refused export wrote files");
}

#[test]
fn a_tokenizer_of_another_vocabulary_is_refused() {
    let dir = scratch("checkpoint-checks", "tokenizer");
    let checkpoint = trained(&dir);
    for args in [
        strings(&["sample", &checkpoint, "--tokenizer", "gpt2", "--max-new-tokens", "4"]),
        strings(&["analyze", "--checkpoint", &checkpoint, "--text", "text.txt", "--tokenizer", "gpt2", "--out", "a"]),
    ] {
        assert_fails_with(&run(&dir, &args), &["gpt2", "50257", "256"]);
    }
    assert_succeeds(&run(&dir, &strings(&["sample", &checkpoint, "--tokenizer", "byte", "--max-new-tokens", "4"])));
}

/// A copy of the checkpoint `from` at `to` whose model config has `key` set to `value`.
fn with_model_config(from: &Path, to: &Path, key: &str, value: serde_json::Value) {
    let (tensors, mut metadata) = load_tensors(from).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&metadata["model_config"]).unwrap();
    config[key] = value;
    metadata.insert("model_config".into(), config.to_string());
    let slices: Vec<_> = tensors.iter().map(|t| t.as_slice()).collect();
    save_tensors(to, &slices, &metadata).unwrap();
}

#[test]
fn model_metadata_that_does_not_fit_the_tensors_is_refused_before_allocating() {
    let dir = scratch("checkpoint-checks", "metadata");
    let good = trained(&dir);
    let crafted = dir.join("crafted.safetensors");
    let name = crafted.display().to_string();
    for (key, value, needle) in [
        ("d_model", 1_000_000_000u64, "d_model"),
        ("vocab_size", 1 << 40, "vocab_size"),
        ("n_layers", 1_000_000_000, "n_layers"),
        ("ffn_hidden", 1 << 40, "ffn_hidden"),
        ("rank", 1 << 40, "rank"),
    ] {
        with_model_config(Path::new(&good), &crafted, key, value.into());
        for args in [strings(&["sample", &name, "--max-new-tokens", "2"]), strings(&["export", &name, "hf"])] {
            let output = run(&dir, &args);
            assert_eq!(output.status.code(), Some(1), "{key} = {value}: {}", stderr(&output));
            assert_fails_with(&output, &["crafted.safetensors", needle]);
        }
    }
}

#[test]
fn metadata_naming_another_variant_is_refused() {
    let dir = scratch("checkpoint-checks", "variant");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &set_flag(tiny_train(&dir, &out, 1), "--variant", "transponder")));
    let crafted = dir.join("crafted.safetensors");
    with_model_config(&out.join("checkpoint.safetensors"), &crafted, "variant", "pre-ln".into());
    let name = crafted.display().to_string();
    for args in [strings(&["eval", &name, "val.bin"]), strings(&["sample", &name]), strings(&["export", &name, "hf"])] {
        assert_fails_with(&run(&dir, &args), &["crafted.safetensors", "not part of"]);
    }
}
