//! A closed or full stdout (`train ... | head -2`, `sample ... | true`, `eval ... > /dev/full`)
//! never panics: `train` keeps training, its progress going only to `metrics.jsonl`; a short
//! command ends quietly on a closed pipe and with an error naming stdout on a full disk.

mod common;

use std::fs::OpenOptions;
use std::path::Path;
use std::process::{Output, Stdio};

use common::*;

/// A pipe whose reading end is already closed: every write to it fails with `EPIPE`.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer.into()
}

/// `/dev/full`: every write to it fails with `ENOSPC`.
fn full_disk() -> Stdio {
    OpenOptions::new().write(true).open("/dev/full").unwrap().into()
}

/// Runs `transponder args` in `dir` with `stdout` as its standard output.
fn run_into(dir: &Path, args: &[String], stdout: Stdio) -> Output {
    transponder(dir, args).stdout(stdout).stderr(Stdio::piped()).output().unwrap()
}

/// Fails unless `transponder` ended without a panic or an error message.
fn assert_quiet_success(output: &Output) {
    let text = stderr(output);
    assert!(output.status.success(), "{:?}: {text}", output.status);
    assert!(!text.contains("panicked") && !text.contains("Error"), "{text}");
}

#[test]
fn train_keeps_training_when_stdout_is_closed_or_full() {
    for (name, stdout) in [("closed", closed_pipe()), ("full", full_disk())] {
        let dir = scratch("stdout", &format!("train-{name}"));
        let out = dir.join("run");
        let output = run_into(&dir, &tiny_train(&dir, &out, 4), stdout);
        assert_quiet_success(&output);
        assert!(stderr(&output).contains("metrics.jsonl"), "the note must say where the log goes: {}", stderr(&output));
        assert_eq!(checkpoint_step(&out), 4, "{name}: the run must finish and save");
        assert_eq!(metric_steps(&out), [1, 2, 3, 4], "{name}: every row must be logged");
    }
}

/// A trained checkpoint and the validation file in `dir`.
fn checkpoint_and_data(dir: &Path) -> (String, String) {
    let out = dir.join("run");
    assert_succeeds(&run(dir, &tiny_train(dir, &out, 1)));
    (out.join("checkpoint.safetensors").display().to_string(), dir.join("val.bin").display().to_string())
}

#[test]
fn short_commands_end_quietly_on_a_closed_pipe() {
    let dir = scratch("stdout", "short-closed");
    let (checkpoint, val) = checkpoint_and_data(&dir);
    for args in [
        strings(&["sample", &checkpoint, "--max-new-tokens", "4"]),
        strings(&["eval", &checkpoint, &val, "--batches", "1"]),
        strings(&["export", &checkpoint, "hf-out"]),
        strings(&["prepare", &dir.join("text.txt").display().to_string(), "--out", "prepared"]),
    ] {
        std::fs::write(dir.join("text.txt"), "to be or not to be, that is the question. ".repeat(10)).unwrap();
        let output = run_into(&dir, &args, closed_pipe());
        assert_quiet_success(&output);
        assert!(stderr(&output).is_empty(), "{args:?}: {}", stderr(&output));
    }
}

#[test]
fn short_commands_name_a_full_stdout() {
    let dir = scratch("stdout", "short-full");
    let (checkpoint, val) = checkpoint_and_data(&dir);
    for args in [
        strings(&["sample", &checkpoint, "--max-new-tokens", "4"]),
        strings(&["eval", &checkpoint, &val, "--batches", "1"]),
    ] {
        let output = run_into(&dir, &args, full_disk());
        assert_fails_with(&output, &["stdout", "No space left on device"]);
    }
}
