//! Helpers shared by the command-line tests: a scratch directory, byte-level token files and
//! the `transponder` binary with the flags of a seconds-long llama-tiny run.
// Each test binary includes this module and uses only some of its helpers.
#![allow(dead_code)]

pub mod data_parallel;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh directory under the system temp dir for one test of `suite`.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Byte-level token files of a repetitive text in `dir`: `(train, val)`.
pub fn token_files(dir: &Path) -> (PathBuf, PathBuf) {
    let tokens: Vec<u32> = "to be or not to be, that is the question. ".repeat(40).bytes().map(u32::from).collect();
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    trainer::data::token_file::write_llmc(&train, &tokens, 256).unwrap();
    trainer::data::token_file::write_llmc(&val, &tokens[..400], 256).unwrap();
    (train, val)
}

/// `train` flags of a narrow llama-tiny pre-ln run of `steps` steps with 16-token windows,
/// logging every step, without the data and `--out-dir` flags.
pub fn tiny_flags(steps: usize) -> Vec<String> {
    let flags = format!(
        "train --variant pre-ln --d-model 32 --batch-size 2 --seq-len 16 --steps {steps} --warmup 1 \
         --eval-every 0 --eval-batches 1 --log-every 1"
    );
    flags.split_whitespace().map(String::from).collect()
}

/// [`tiny_flags`] on the token files of `dir` ([`token_files`]) into `out`.
pub fn tiny_train(dir: &Path, out: &Path, steps: usize) -> Vec<String> {
    let (train, val) = token_files(dir);
    let mut args = tiny_flags(steps);
    for (flag, path) in [("--train-data", &train), ("--val-data", &val), ("--out-dir", &out.to_path_buf())] {
        args.push(flag.into());
        args.push(path.display().to_string());
    }
    args
}

/// The `transponder` binary with `args`, run in `dir`.
pub fn transponder(dir: &Path, args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_transponder"));
    command.current_dir(dir).args(args);
    command
}

/// Runs `transponder args` in `dir` and waits for it.
pub fn run(dir: &Path, args: &[String]) -> Output {
    transponder(dir, args).output().unwrap()
}

/// `args` as owned strings.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Fails, showing both streams, unless the command succeeded.
pub fn assert_succeeds(output: &Output) {
    assert!(output.status.success(), "{:?}\nstdout: {}\nstderr: {}", output.status, stdout(output), stderr(output));
}

/// Fails unless the command failed with a message containing every one of `needles`.
pub fn assert_fails_with(output: &Output, needles: &[&str]) {
    let text = stderr(output);
    assert!(!output.status.success(), "succeeded; stdout: {}\nstderr: {text}", stdout(output));
    for needle in needles {
        assert!(text.contains(needle), "`{needle}` missing from: {text}");
    }
    assert!(!text.contains("panicked"), "{text}");
}

/// The `step` of every row of `run_dir/metrics.jsonl`.
pub fn metric_steps(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["step"].as_u64().unwrap())
        .collect()
}

/// The step of the checkpoint in `run_dir`.
pub fn checkpoint_step(run_dir: &Path) -> usize {
    trainer::checkpoint::load(&run_dir.join("checkpoint.safetensors")).unwrap().step
}

/// `args` with `flag` set to `value`: its value replaced where it is given, else appended.
pub fn set_flag(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_string(),
        None => args.extend([flag.to_string(), value.to_string()]),
    }
    args
}
