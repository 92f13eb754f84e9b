//! `prepare` and `export` replace their output files as a set: a writer killed part-way (here
//! by a file-size limit, as a full disk would stop it) leaves the previous set whole, never a
//! new file beside an old one; and `export` refuses a directory that is not a previous export
//! (a run directory's `config.json` is not overwritten).

mod common;

use std::path::Path;
use std::process::Output;

use common::*;

/// `transponder args` in `dir` with every file it writes limited to `kib` KiB (`ulimit -f`):
/// a write past the limit kills it, as a full disk stops a writer part-way.
fn run_with_file_limit(dir: &Path, kib: usize, args: &[String]) -> Output {
    std::process::Command::new("bash")
        .current_dir(dir)
        .arg("-c")
        .arg(format!("ulimit -f {kib}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_transponder"))
        .args(args)
        .output()
        .unwrap()
}

/// A fingerprint of each of the files `names` in `dir` (compared, not printed, on failure).
fn read_all(dir: &Path, names: &[&str]) -> Vec<u64> {
    names.iter().map(|n| trainer::fingerprint::fnv1a_64(&std::fs::read(dir.join(n)).unwrap())).collect()
}

#[test]
fn a_prepare_stopped_part_way_leaves_the_previous_pair() {
    let dir = scratch("output-sets", "prepare");
    std::fs::write(dir.join("old.txt"), "an old and short corpus. ".repeat(20)).unwrap();
    std::fs::write(dir.join("new.txt"), "a new and much longer corpus. ".repeat(700)).unwrap();
    // Most tokens to validation: val.bin (~38 KB) passes the limit, train.bin (~5 KB) does not.
    let prepare = |text: &str| strings(&["prepare", text, "--out", "prepared", "--val-fraction", "0.9"]);
    assert_succeeds(&run(&dir, &prepare("old.txt")));
    let old = read_all(&dir.join("prepared"), &["train.bin", "val.bin"]);
    let stopped = run_with_file_limit(&dir, 16, &prepare("new.txt"));
    assert!(!stopped.status.success(), "the limit did not stop prepare: {}", stderr(&stopped));
    assert_eq!(read_all(&dir.join("prepared"), &["train.bin", "val.bin"]), old, "a torn pair was left");
    assert_succeeds(&run(&dir, &prepare("new.txt")));
    assert_ne!(read_all(&dir.join("prepared"), &["train.bin", "val.bin"]), old);
}

#[test]
fn an_export_stopped_part_way_leaves_the_previous_export() {
    let dir = scratch("output-sets", "export");
    let (small, large) = (dir.join("small"), dir.join("large"));
    assert_succeeds(&run(&dir, &tiny_train(&dir, &small, 1)));
    assert_succeeds(&run(&dir, &set_flag(tiny_train(&dir, &large, 1), "--d-model", "64")));
    let export =
        |run_dir: &Path| strings(&["export", &run_dir.join("checkpoint.safetensors").display().to_string(), "hf"]);
    assert_succeeds(&run(&dir, &export(&small)));
    let old = read_all(&dir.join("hf"), &["config.json", "model.safetensors"]);
    // config.json fits the limit, the d_model 64 weights (~600 KB) do not.
    let stopped = run_with_file_limit(&dir, 400, &export(&large));
    assert!(!stopped.status.success(), "the limit did not stop export: {}", stderr(&stopped));
    assert_eq!(read_all(&dir.join("hf"), &["config.json", "model.safetensors"]), old, "a torn export was left");
    assert_succeeds(&run(&dir, &export(&large)));
}

#[test]
fn export_refuses_a_directory_that_is_not_a_previous_export() {
    let dir = scratch("output-sets", "target");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let checkpoint = out.join("checkpoint.safetensors").display().to_string();
    let config = std::fs::read(out.join("config.json")).unwrap();
    let into_run = run(&dir, &strings(&["export", &checkpoint, &out.display().to_string()]));
    assert_fails_with(&into_run, &["not a previous export", "checkpoint.safetensors"]);
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), config, "the run's config.json was overwritten");
    std::fs::create_dir_all(dir.join("notes")).unwrap();
    std::fs::write(dir.join("notes/todo.txt"), "mine").unwrap();
    assert_fails_with(&run(&dir, &strings(&["export", &checkpoint, "notes"])), &["not a previous export", "todo.txt"]);
    // A previous export is replaced.
    assert_succeeds(&run(&dir, &strings(&["export", &checkpoint, "hf"])));
    assert_succeeds(&run(&dir, &strings(&["export", &checkpoint, "hf"])));
}
