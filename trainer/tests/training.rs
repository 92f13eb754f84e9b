//! End-to-end training checks on a tiny model: exact resume, NaN stop with the last good
//! checkpoint kept, and falling loss.

use std::path::{Path, PathBuf};

use trainer::checkpoint;
use trainer::config::{ScheduleKind, TrainConfig};
use trainer::data::token_file::write_llmc;
use trainer::train::{train, CHECKPOINT_FILE, METRICS_FILE};

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes byte-level train/val token files of a repetitive text.
fn token_files(dir: &Path) -> (PathBuf, PathBuf) {
    let text = "to be or not to be, that is the question. ".repeat(40);
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train, &tokens, 256).unwrap();
    write_llmc(&val, &tokens[..400], 256).unwrap();
    (train, val)
}

fn tiny_config(dir: &Path, steps: usize) -> TrainConfig {
    let (train_data, val_data) = token_files(dir);
    TrainConfig {
        model: "llama-tiny".into(),
        variant: "pre-ln".into(),
        train_data: Some(train_data),
        val_data: Some(val_data),
        batch_size: 2,
        seq_len: 16,
        steps,
        lr: 3e-3,
        warmup: 2,
        eval_every: 0,
        eval_batches: 2,
        save_every: 3,
        log_every: 1,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    }
}

/// `(step, loss bits)` of every row of a metrics file.
fn losses(run_dir: &Path) -> Vec<(u64, u32)> {
    std::fs::read_to_string(run_dir.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            (row["step"].as_u64().unwrap(), (row["loss"].as_f64().unwrap() as f32).to_bits())
        })
        .collect()
}

#[test]
fn resume_continues_bit_identically() {
    let straight_dir = scratch("straight");
    let straight = tiny_config(&straight_dir, 6);
    train(&straight, false).unwrap();
    let reference = losses(&straight.out_dir);
    assert_eq!(reference.len(), 6);

    let split_dir = scratch("split");
    let first_half = tiny_config(&split_dir, 3);
    train(&first_half, false).unwrap();
    let second_half = TrainConfig { steps: 6, ..first_half };
    train(&second_half, true).unwrap();
    assert_eq!(losses(&second_half.out_dir), reference, "a resumed run must repeat the same losses bit for bit");

    let saved = checkpoint::load(&second_half.out_dir.join(CHECKPOINT_FILE)).unwrap();
    assert_eq!(saved.step, 6);
}

#[test]
fn non_finite_loss_stops_and_keeps_the_last_good_checkpoint() {
    let dir = scratch("nan");
    // An absurd learning rate blows the weights up after the first update.
    let config = TrainConfig {
        lr: 1e30,
        grad_clip: 0.0,
        warmup: 0,
        schedule: ScheduleKind::Constant,
        save_every: 1,
        ..tiny_config(&dir, 20)
    };
    let err = format!("{:#}", train(&config, false).unwrap_err());
    assert!(err.contains("at step"), "{err}");
    let saved = checkpoint::load(&config.out_dir.join(CHECKPOINT_FILE)).unwrap();
    assert!(saved.step >= 1 && saved.step < 20, "checkpoint at step {}", saved.step);
}

#[test]
fn loss_falls_on_a_repetitive_text() {
    let dir = scratch("falls");
    let config = TrainConfig { eval_every: 40, save_every: 0, ..tiny_config(&dir, 40) };
    let report = train(&config, false).unwrap();
    assert!(report.final_loss < 0.6 * report.first_loss, "loss {} -> {}", report.first_loss, report.final_loss);
    assert!(report.final_val_loss.unwrap().is_finite());
}

#[test]
fn bad_config_is_rejected_before_training() {
    let dir = scratch("badvariant");
    let config = TrainConfig { variant: "transpondr".into(), ..tiny_config(&dir, 2) };
    let err = format!("{:#}", train(&config, false).unwrap_err());
    assert!(err.contains("transpondr"), "{err}");
}

#[test]
fn trained_checkpoint_samples_evaluates_and_exports() {
    use trainer::data::DataFormat;
    use trainer::export::export_hf;
    use trainer::generate::{generate, load_model, SamplingOptions};
    use trainer::train::{evaluate, open_eval_data};

    let dir = scratch("sample");
    let config = TrainConfig { save_every: 0, ..tiny_config(&dir, 3) };
    train(&config, false).unwrap();
    let (model, model_config) = load_model(&config.out_dir.join(CHECKPOINT_FILE)).unwrap();
    let options = SamplingOptions { max_new_tokens: 5, temperature: 0.8, top_k: 10, top_p: 1.0, seed: 0 };
    let tokens = generate(&model, &[vec![116, 111]], &options).unwrap().sequences.remove(0);
    assert_eq!(tokens.len(), 7);
    assert!(tokens.iter().all(|&t| t < 256));
    let mut val_data = open_eval_data(config.val_data.as_ref().unwrap(), DataFormat::Auto, 256, 2, 16).unwrap();
    let val = evaluate(&model, &mut val_data, 3).unwrap();
    assert!(val.is_finite());

    let export_dir = dir.join("hf");
    export_hf(&model, &model_config, &export_dir).unwrap();
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(hf["hidden_size"], 128);
    let (weights, _) = trainer::safetensors_io::load_tensors(&export_dir.join("model.safetensors")).unwrap();
    assert!(weights.iter().any(|t| t.name == "model.layers.0.self_attn.q_proj.weight"));
    assert!(weights.iter().any(|t| t.name == "lm_head.weight"));
}
