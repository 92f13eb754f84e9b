//! A run never trains on silently wrong data, never saves a diverged model, and resumes with
//! its own settings: corrupt headers and bad validation files are refused at start-up,
//! divergence stops before the update and keeps the last good checkpoint, `--resume` takes
//! every setting from the run directory, and `metrics.jsonl` holds each step once.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use models::llama::Llama;
use nn::Module;
use tensor::Tensor;
use trainer::checkpoint::{self, NonFiniteValue};
use trainer::config::{ScheduleKind, TrainConfig};
use trainer::data::token_file::{write_llmc, LLMC_GPT2_MAGIC};
use trainer::data::DataFormat;
use trainer::train::{
    evaluate, model_config, open_eval_data, train, Diverged, CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE,
};

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-integrity-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Byte-level token files of a repetitive text: `(train, val)`.
fn token_files(dir: &Path) -> (PathBuf, PathBuf) {
    let tokens: Vec<u32> = "to be or not to be, that is the question. ".repeat(40).bytes().map(u32::from).collect();
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train, &tokens, 256).unwrap();
    write_llmc(&val, &tokens[..400], 256).unwrap();
    (train, val)
}

/// A few-second llama-tiny pre-ln run; settings differ from the defaults on purpose, so a
/// resume that forgot them would show.
fn tiny_config(dir: &Path, steps: usize) -> TrainConfig {
    let (train_data, val_data) = token_files(dir);
    TrainConfig {
        variant: "pre-ln".into(),
        train_data: Some(train_data),
        val_data: Some(val_data),
        batch_size: 2,
        seq_len: 16,
        steps,
        lr: 2e-3,
        warmup: 2,
        eval_every: 0,
        eval_batches: 2,
        save_every: 3,
        log_every: 1,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    }
}

/// A run whose absurd learning rate makes it diverge within a few steps.
fn exploding_config(dir: &Path, steps: usize) -> TrainConfig {
    TrainConfig {
        lr: 1e30,
        grad_clip: 0.0,
        warmup: 0,
        schedule: ScheduleKind::Constant,
        save_every: 1,
        ..tiny_config(dir, steps)
    }
}

/// `(step, loss bits)` of every row of a run's metrics file.
fn metric_rows(run_dir: &Path) -> Vec<(u64, u32)> {
    std::fs::read_to_string(run_dir.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            (row["step"].as_u64().unwrap(), (row["loss"].as_f64().unwrap() as f32).to_bits())
        })
        .collect()
}

fn transponder(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_transponder")).current_dir(dir).args(args).output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_succeeds(output: &Output) {
    assert!(output.status.success(), "stdout: {}\nstderr: {}", String::from_utf8_lossy(&output.stdout), stderr(output));
}

fn err_text<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

/// Every value of every tensor in the checkpoint at `path` is finite.
fn all_finite(path: &Path) -> bool {
    let saved = checkpoint::load(path).unwrap();
    saved.weights.iter().all(|t| t.data.iter().all(|v| v.is_finite()))
        && saved.optimizer_state.iter().all(|(_, t)| t.to_vec().iter().all(|v| v.is_finite()))
}

// ---------------------------------------------------------------- item 1: corrupt headers

#[test]
fn a_corrupted_llmc_header_stops_training_with_the_magic_named() {
    let dir = scratch("magic");
    let config = tiny_config(&dir, 2);
    let train_path = config.train_data.clone().unwrap();
    let mut bytes = std::fs::read(&train_path).unwrap();
    // One flipped bit: magic 20240520 (0x0134_D748) -> 20207752 (0x0134_5748), whose two u16
    // halves, like every other header slot, are valid GPT-2 ids.
    bytes[1] ^= 0x80;
    std::fs::write(&train_path, &bytes).unwrap();
    // GPT-2's vocabulary admits the header's 512 "tokens": only the format rule can catch it.
    let gpt2 = TrainConfig { tokenizer: "gpt2".into(), ..config.clone() };
    let msg = err_text(train(&gpt2, false));
    assert!(msg.contains(&format!("magic {}", LLMC_GPT2_MAGIC ^ 0x8000)) && msg.contains("train.bin"), "{msg}");
    assert!(!config.out_dir.exists(), "a refused run must not create its directory");
    // Forcing the raw reading is the user's call: the header is then 512 tokens.
    let forced = TrainConfig { data_format: DataFormat::NanoGpt, steps: 1, ..gpt2 };
    let report = train(&TrainConfig { val_data: None, ..forced }, false).unwrap();
    assert_eq!(report.steps, 1);
}

// ---------------------------------------------------------------- items 2 and 3: divergence

#[test]
fn a_diverging_run_never_writes_a_non_finite_checkpoint_and_counts_steps_from_one() {
    let dir = scratch("diverge");
    let config = exploding_config(&dir, 20);
    let error = train(&config, false).unwrap_err();
    let diverged = error.downcast_ref::<Diverged>().unwrap_or_else(|| panic!("not a divergence: {error:#}"));
    let checkpoint = config.out_dir.join(CHECKPOINT_FILE);
    let saved = checkpoint::load(&checkpoint).unwrap();
    assert!(all_finite(&checkpoint), "the kept checkpoint holds a non-finite value");
    // The message's step is the log's: the last logged row is the step before it.
    let rows = metric_rows(&config.out_dir);
    assert_eq!(rows.last().unwrap().0 as usize + 1, diverged.step, "{diverged}");
    assert!(saved.step < diverged.step, "checkpoint at {} for a divergence at {}", saved.step, diverged.step);
    // The kept checkpoint resumes (and diverges again, from the same place).
    let again = train(&TrainConfig { ..config.clone() }, true).unwrap_err();
    assert_eq!(again.downcast_ref::<Diverged>().unwrap().step, diverged.step);
}

/// A run that saves rarely reads each step's loss after queueing the next: it stops at the
/// same step, with the same log, as one that saves (and so reads) every step.
#[test]
fn a_divergence_read_one_step_late_names_the_same_step() {
    let dir = scratch("late");
    let at_once = exploding_config(&dir, 20);
    let step = train(&at_once, false).unwrap_err().downcast::<Diverged>().unwrap().step;
    let late = TrainConfig { save_every: 0, out_dir: dir.join("late"), ..at_once.clone() };
    let late_step = train(&late, false).unwrap_err().downcast::<Diverged>().unwrap().step;
    assert_eq!(late_step, step);
    assert_eq!(metric_rows(&late.out_dir), metric_rows(&at_once.out_dir));
}

#[test]
fn divergence_on_the_last_step_fails_and_keeps_the_previous_checkpoint() {
    let dir = scratch("last");
    let first = exploding_config(&dir, 20);
    let step = train(&first, false).unwrap_err().downcast::<Diverged>().unwrap().step;
    // Rerun from scratch so that the diverging step is the last one.
    let _ = std::fs::remove_dir_all(&first.out_dir);
    let config = TrainConfig { steps: step, ..first };
    let checkpoint = config.out_dir.join(CHECKPOINT_FILE);
    assert!(train(&config, false).is_err(), "a run that diverges on its last step must fail");
    assert!(all_finite(&checkpoint));
    assert_eq!(checkpoint::load(&checkpoint).unwrap().step, step - 1);
}

/// A llama-tiny model with a vocabulary of 256 and its parameter list.
fn tiny_model() -> Llama {
    let config = TrainConfig { variant: "pre-ln".into(), ..TrainConfig::default() };
    Llama::new(&model_config(&config, 256).unwrap(), 0).unwrap()
}

/// Sets element 0 of the model's first parameter to `value`, or all of it with `everywhere`.
fn poison(model: &Llama, value: f32, everywhere: bool) {
    let first = &model.named_parameters()[0];
    let mut data = first.var.value().to_vec();
    let end = if everywhere { data.len() } else { 1 };
    data[..end].fill(value);
    first.var.set_value(Tensor::from_vec(data, &first.var.shape()).unwrap()).unwrap();
}

#[test]
fn a_checkpoint_with_a_non_finite_value_is_refused_and_the_old_file_stays() {
    let dir = scratch("refuse");
    let model = tiny_model();
    let optimizer = nn::optim::Sgd::new(model.named_parameters(), 0.0, 0.0, false);
    let path = dir.join(CHECKPOINT_FILE);
    let meta = checkpoint::CheckpointMeta { step: 1, sampler_state: &[7], train_config: "{}", model_config: "{}" };
    checkpoint::save(&path, &model, &optimizer, &meta).unwrap();
    let good = std::fs::read(&path).unwrap();
    poison(&model, f32::NAN, false);
    let error = checkpoint::save(&path, &model, &optimizer, &meta).unwrap_err();
    let refused = error.downcast_ref::<NonFiniteValue>().unwrap();
    assert_eq!(refused.tensor, model.named_parameters()[0].name);
    assert_eq!(std::fs::read(&path).unwrap(), good, "the previous checkpoint must stay as it was");
}

#[test]
fn evaluating_a_model_with_non_finite_outputs_is_an_error() {
    let dir = scratch("evalnan");
    let (_, val) = token_files(&dir);
    let model = tiny_model();
    let mut data = open_eval_data(&val, DataFormat::Auto, 256, 2, 16).unwrap();
    assert!(evaluate(&model, &mut data, 2).unwrap().is_finite());
    poison(&model, f32::INFINITY, true);
    let msg = err_text(evaluate(&model, &mut data, 2));
    assert!(msg.contains("not finite") && msg.contains("val.bin"), "{msg}");
}

// ---------------------------------------------------------------- items 4 and 5: inputs

#[test]
fn every_input_file_is_checked_before_the_first_step() {
    let dir = scratch("inputs");
    let config = tiny_config(&dir, 300);
    let short = dir.join("short.bin");
    write_llmc(&short, &[1, 2, 3], 256).unwrap();
    let out_of_vocab = dir.join("oov.bin");
    write_llmc(&out_of_vocab, &[1, 300, 2, 3], 1000).unwrap();
    let odd = dir.join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    // Evaluation at step 100 would have been the first to open these, after saves at 3, 6, ...
    for (val, expected) in [(&short, "fewer than the 17"), (&out_of_vocab, "token id 300"), (&odd, "odd length")] {
        let bad = TrainConfig { val_data: Some(val.clone()), eval_every: 100, ..config.clone() };
        let msg = err_text(train(&bad, false));
        assert!(msg.contains(expected) && msg.contains(val.file_name().unwrap().to_str().unwrap()), "{msg}");
        assert!(!config.out_dir.exists(), "{msg}: the run started anyway");
    }
    let long_window = TrainConfig { seq_len: 2000, ..config.clone() };
    assert!(err_text(train(&long_window, false)).contains("fewer than the 2001"));
}

#[test]
fn out_of_vocabulary_ids_in_an_eval_file_get_the_training_data_message() {
    let dir = scratch("oov");
    let path = dir.join("eval.bin");
    write_llmc(&path, &[1, 25_547, 2, 3, 4], 50_257).unwrap();
    let msg = err_text(open_eval_data(&path, DataFormat::Auto, 256, 1, 2));
    for needle in ["eval.bin", "token id 25547", "only 256 entries", "--tokenizer", "--data-format"] {
        assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
    }
}

// ---------------------------------------------------------------- items 6 and 7: resume

#[test]
fn resume_takes_every_setting_from_the_run_directory() {
    let dir = scratch("resume");
    let config = tiny_config(&dir, 6);
    train(&config, false).unwrap();
    let reference = metric_rows(&config.out_dir);
    std::fs::remove_dir_all(&config.out_dir).unwrap();

    let run = config.out_dir.display().to_string();
    let (train_data, val_data) = (config.train_data.clone().unwrap(), config.val_data.clone().unwrap());
    let settings = "train --variant pre-ln --batch-size 2 --seq-len 16 --lr 2e-3 --warmup 2 --eval-every 0 \
                    --eval-batches 2 --save-every 3 --log-every 1 --steps 3";
    let mut first: Vec<&str> = settings.split_whitespace().collect();
    first.extend(["--out-dir", &run, "--train-data", train_data.to_str().unwrap()]);
    first.extend(["--val-data", val_data.to_str().unwrap()]);
    assert_succeeds(&transponder(&dir, &first));
    // Only the run directory and the new total: batch, sequence, lr, data come from the checkpoint.
    assert_succeeds(&transponder(&dir, &["train", "--out-dir", &run, "--resume", "--steps", "6"]));
    assert_eq!(metric_rows(&config.out_dir), reference, "the resumed run must repeat the losses bit for bit");
    let saved: TrainConfig =
        serde_json::from_str(&std::fs::read_to_string(config.out_dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((saved.batch_size, saved.seq_len, saved.lr, saved.steps), (2, 16, 2e-3, 6));
}

#[test]
fn resume_refuses_changes_that_do_not_fit_and_warns_about_the_others() {
    let dir = scratch("changes");
    let config = tiny_config(&dir, 3);
    train(&config, false).unwrap();
    let run = config.out_dir.display().to_string();

    let refused =
        transponder(&dir, &["train", "--out-dir", &run, "--resume", "--steps", "5", "--variant", "transponder"]);
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("cannot change variant \"pre-ln\" → \"transponder\""), "{}", stderr(&refused));
    let done = transponder(&dir, &["train", "--out-dir", &run, "--resume"]);
    assert!(String::from_utf8_lossy(&done.stdout).contains("nothing left to run"), "{}", stderr(&done));
    let past = transponder(&dir, &["train", "--out-dir", &run, "--resume", "--steps", "2"]);
    assert!(!past.status.success() && stderr(&past).contains("past the run's 2 steps"), "{}", stderr(&past));

    let warned = transponder(&dir, &["train", "--out-dir", &run, "--resume", "--steps", "5", "--batch-size", "4"]);
    assert_succeeds(&warned);
    let text = stderr(&warned);
    assert!(text.contains("batch_size 2 → 4") && text.contains("steps 3 → 5"), "{text}");
    assert!(!text.contains("save_every"), "{text}");
}

#[test]
fn metrics_hold_each_step_once_after_a_resume() {
    let dir = scratch("metrics");
    let straight = tiny_config(&dir, 6);
    train(&straight, false).unwrap();
    let reference = metric_rows(&straight.out_dir);
    std::fs::remove_dir_all(&straight.out_dir).unwrap();

    // Interrupted after step 5, whose rows were logged but whose last save was at step 3.
    train(&tiny_config(&dir, 3), false).unwrap();
    let checkpoint = straight.out_dir.join(CHECKPOINT_FILE);
    let at_three = std::fs::read(&checkpoint).unwrap();
    train(&TrainConfig { steps: 5, ..tiny_config(&dir, 5) }, true).unwrap();
    std::fs::write(&checkpoint, at_three).unwrap();

    train(&straight, true).unwrap();
    assert_eq!(metric_rows(&straight.out_dir), reference);
    // A fresh run in a used directory starts its own metrics.
    train(&TrainConfig { steps: 2, ..straight.clone() }, false).unwrap();
    assert_eq!(metric_rows(&straight.out_dir), reference[..2]);
}

// ---------------------------------------------------------------- items 9 and 10: defaults, messages

#[test]
fn the_built_in_corpus_trains_from_any_directory() {
    let dir = scratch("anywhere");
    let args: Vec<&str> = "train --variant pre-ln --steps 1 --batch-size 1 --seq-len 8 --eval-batches 1 --out-dir run"
        .split(' ')
        .collect();
    assert_succeeds(&transponder(&dir, &args));
    let config: TrainConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run").join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(config.text, None, "the built-in corpus is saved as no path");
    let prepared = dir.join("run/data/tinyshakespeare-byte/train.bin");
    assert_eq!(std::fs::metadata(prepared).unwrap().len(), 1024 + 2 * 1_003_855);
}

#[test]
fn an_unreadable_text_leaves_no_run_directory() {
    let dir = scratch("text");
    let out = dir.join("run");
    let output = transponder(&dir, &["train", "--text", "missing.txt", "--out-dir", out.to_str().unwrap()]);
    assert!(!output.status.success());
    assert!(stderr(&output).contains("missing.txt"), "{}", stderr(&output));
    assert!(!out.exists(), "a run that could not read its text must not leave a directory");
}
