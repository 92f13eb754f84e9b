//! `transponder sample` and `transponder export` end to end: the tokenizer comes from the
//! checkpoint, a batch of prompts gives the same tokens with and without the KV cache,
//! generation stops at the context length saying so, and a non-baseline export carries its
//! PyTorch code.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use trainer::config::TrainConfig;
use trainer::data::token_file::write_llmc;
use trainer::generate::{generate, load_model_and_tokenizer, SamplingOptions};
use trainer::tokenizer::Tokenizer;
use trainer::train::{train, CHECKPOINT_FILE};

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-sample-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const TEXT: &str = "to be or not to be, that is the question. ";

/// A narrow llama-tiny of `variant`, trained for 3 steps on byte tokens of a repetitive text
/// with a 16-token context.
fn byte_checkpoint(dir: &Path, variant: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let tokens: Vec<u32> = TEXT.repeat(40).bytes().map(u32::from).collect();
    let (train_data, val_data) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train_data, &tokens, 256).unwrap();
    write_llmc(&val_data, &tokens[..400], 256).unwrap();
    let config = TrainConfig {
        variant: variant.into(),
        d_model: 32,
        train_data: Some(train_data),
        val_data: Some(val_data),
        batch_size: 2,
        seq_len: 16,
        steps: 3,
        warmup: 1,
        eval_every: 0,
        log_every: 1,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    };
    train(&config, false).unwrap();
    config.out_dir.join(CHECKPOINT_FILE)
}

fn transponder(args: &[&str]) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_transponder")).args(args).output().unwrap();
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    output
}

#[test]
fn sample_decodes_with_the_tokenizer_the_checkpoint_was_trained_with() {
    let dir = scratch("gpt2");
    let text = dir.join("corpus.txt");
    std::fs::write(&text, TEXT.repeat(60)).unwrap();
    let config = TrainConfig {
        tokenizer: "gpt2".into(),
        text: Some(text),
        d_model: 32,
        batch_size: 2,
        seq_len: 16,
        steps: 2,
        warmup: 1,
        eval_every: 0,
        log_every: 1,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    };
    train(&config, false).unwrap();
    let checkpoint = config.out_dir.join(CHECKPOINT_FILE);

    let (model, _, tokenizer) = load_model_and_tokenizer(&checkpoint).unwrap();
    assert_eq!(tokenizer.name(), "gpt2");
    let prompt = "to be or";
    let options = SamplingOptions { max_new_tokens: 6, temperature: 0.0, ..SamplingOptions::default() };
    let expected = generate(&model, &[tokenizer.encode(prompt)], &options).unwrap().sequences.remove(0);
    assert!(expected.iter().any(|&t| t >= 256), "the check needs GPT-2 ids past the byte range: {expected:?}");

    let path = checkpoint.to_str().unwrap();
    let output = transponder(&["sample", path, "--prompt", prompt, "--max-new-tokens", "6", "--temperature", "0"]);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(stdout.trim_end_matches('\n'), Tokenizer::from_name("gpt2").unwrap().decode(&expected));
    assert!(String::from_utf8_lossy(&output.stderr).contains("gpt2 tokenizer"));
}

#[test]
fn a_batch_samples_the_same_tokens_with_and_without_the_cache() {
    let dir = scratch("batch");
    let checkpoint = byte_checkpoint(&dir, "transponder");
    let path = checkpoint.to_str().unwrap();
    let args = ["sample", path, "--prompt", "to be", "--prompt", "or n", "--max-new-tokens", "8"];
    let sampled = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "7"];
    let cached = transponder(&[&args[..], &sampled].concat());
    let uncached = transponder(&[&args[..], &sampled, &["--no-cache"]].concat());
    let text = String::from_utf8(cached.stdout).unwrap();
    assert_eq!(text, String::from_utf8(uncached.stdout).unwrap());
    let (model, _, tokenizer) = load_model_and_tokenizer(&checkpoint).unwrap();
    let options = SamplingOptions { max_new_tokens: 8, temperature: 0.9, top_k: 20, top_p: 0.95, seed: 7 };
    let generation = generate(&model, &[tokenizer.encode("to be"), tokenizer.encode("or n")], &options).unwrap();
    assert_eq!(generation.sequences.iter().map(Vec::len).collect::<Vec<_>>(), [5 + 8, 4 + 8]);
    let expected: Vec<String> = generation.sequences.iter().map(|s| tokenizer.decode(s)).collect();
    assert_eq!(text, format!("{}\n", expected.join("\n---\n")));
    let report = String::from_utf8_lossy(&cached.stderr).to_string();
    assert!(report.contains("8 new tokens x 2 sequences") && report.contains("tokens/s (KV cache"), "{report}");
}

#[test]
fn sampling_stops_at_the_context_length_and_says_so() {
    let dir = scratch("context");
    let checkpoint = byte_checkpoint(&dir, "pre-ln");
    let path = checkpoint.to_str().unwrap();
    // A 12-token prompt leaves 4 of the 16 positions.
    let output = transponder(&["sample", path, "--prompt", "to be or not", "--max-new-tokens", "10"]);
    let (model, _, tokenizer) = load_model_and_tokenizer(&checkpoint).unwrap();
    let options = SamplingOptions { max_new_tokens: 10, ..SamplingOptions::default() };
    let generation = generate(&model, &[tokenizer.encode("to be or not")], &options).unwrap();
    assert_eq!((generation.new_tokens, generation.stopped_at_context), (4, Some(16)));
    assert_eq!(String::from_utf8(output.stdout).unwrap(), format!("{}\n", tokenizer.decode(&generation.sequences[0])));
    let report = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(report.contains("stopped after 4 new tokens") && report.contains("context length (16"), "{report}");

    let failed = Command::new(env!("CARGO_BIN_EXE_transponder"))
        .args(["sample", path, "--prompt", "to be or not to be"])
        .output()
        .unwrap();
    assert!(!failed.status.success());
    let err = String::from_utf8_lossy(&failed.stderr).to_string();
    assert!(err.contains("18 tokens") && err.contains("context is 16"), "{err}");
}

#[test]
fn a_transponder_export_writes_its_modeling_code_and_a_baseline_does_not() {
    let dir = scratch("export");
    for (variant, has_code) in [("comt", true), ("pre-ln", false)] {
        let checkpoint = byte_checkpoint(&dir.join(variant), variant);
        let out = dir.join(variant).join("hf");
        let output = transponder(&["export", checkpoint.to_str().unwrap(), out.to_str().unwrap()]);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(out.join("modeling_transponder.py").exists(), has_code, "{variant}");
        assert_eq!(config.get("auto_map").is_some(), has_code, "{variant}");
        let (weights, _) = trainer::safetensors_io::load_tensors(&out.join("model.safetensors")).unwrap();
        let gate = weights.iter().any(|t| t.name == "model.layers.0.self_attn.q_proj.modulator.w1");
        assert_eq!(gate, has_code, "{variant}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        let class = if has_code { "TransponderForCausalLM" } else { "LlamaForCausalLM" };
        assert!(stdout.contains(class), "{stdout}");
    }
}
