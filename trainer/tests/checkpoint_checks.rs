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
