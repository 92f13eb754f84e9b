//! The smaller rough edges of issue 30 (item 13): each mistake gets a message naming it, and
//! none leaves a file behind or a number that means nothing.

mod common;

use std::path::Path;

use common::*;
use trainer::config::TrainConfig;
use trainer::safetensors_io::{atomic_write, temp_path_for};
use trainer::train_image::ImageTrainConfig;

#[test]
fn config_file_type_errors_name_the_key() {
    let dir = scratch("messages", "config");
    let path = dir.join("c.json");
    std::fs::write(&path, r#"{"lr": 0.01, "steps": "five"}"#).unwrap();
    let msg = format!("{:#}", TrainConfig::from_file(&path).unwrap_err());
    assert!(msg.contains("`steps`") && msg.contains("c.json"), "{msg}");
    std::fs::write(&path, r#"{"epochs": "ten"}"#).unwrap();
    let msg = format!("{:#}", ImageTrainConfig::from_file(&path).unwrap_err());
    assert!(msg.contains("`epochs`"), "{msg}");
}

#[test]
fn a_directory_given_as_a_file_says_so() {
    let dir = scratch("messages", "directory");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let (checkpoint, val) = (out.join("checkpoint.safetensors"), dir.join("val.bin"));
    let folder = dir.join("folder");
    std::fs::create_dir_all(&folder).unwrap();
    let (folder, checkpoint, val) =
        (folder.display().to_string(), checkpoint.display().to_string(), val.display().to_string());
    for args in [
        [tiny_flags(1), strings(&["--train-data", &folder, "--out-dir", "other"])].concat(),
        strings(&["eval", &checkpoint, &folder]),
        strings(&["eval", &folder, &val]),
        strings(&["sample", &folder]),
    ] {
        assert_fails_with(&run(&dir, &args), &[&format!("{folder} is a directory")]);
    }
}

#[test]
fn a_torn_last_metrics_row_is_dropped_and_a_finished_resume_says_so() {
    let dir = scratch("messages", "torn");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &[tiny_train(&dir, &out, 3), strings(&["--save-every", "3"])].concat()));
    // Killed while writing the row of step 4.
    let metrics = out.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str(r#"{"step":4,"lo"#);
    std::fs::write(&metrics, text).unwrap();
    assert_succeeds(&run(&dir, &strings(&["train", "--resume", "--out-dir", "run", "--steps", "5"])));
    assert_eq!(metric_steps(&out), [1, 2, 3, 4, 5]);

    let done = run(&dir, &strings(&["train", "--resume", "--out-dir", "run"]));
    assert_succeeds(&done);
    assert!(!stdout(&done).contains("NaN") && stdout(&done).contains("nothing left"), "{}", stdout(&done));
}

#[test]
fn zero_batches_or_repeats_are_errors() {
    let dir = scratch("messages", "zero");
    let out = dir.join("run");
    let refused = run(&dir, &set_flag(tiny_train(&dir, &out, 1), "--eval-batches", "0"));
    assert_fails_with(&refused, &["eval_batches must be at least 1"]);
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let checkpoint = out.join("checkpoint.safetensors").display().to_string();
    let eval = run(&dir, &strings(&["eval", &checkpoint, "val.bin", "--batches", "0"]));
    assert_fails_with(&eval, &["--batches must be at least 1"]);
    let analyze = run(&dir, &strings(&["analyze", "--throughput", "--repeats", "0", "--out", "a"]));
    assert_fails_with(&analyze, &["--repeats must be at least 1"]);
}

#[test]
fn a_warmup_longer_than_the_run_is_a_warning() {
    let dir = scratch("messages", "warmup");
    let out = dir.join("run");
    let output = run(&dir, &set_flag(tiny_train(&dir, &out, 2), "--warmup", "5"));
    assert_succeeds(&output);
    assert!(stderr(&output).contains("warning: warmup 5 is longer than the run's 2 steps"), "{}", stderr(&output));
    let fits = run(&dir, &[set_flag(tiny_train(&dir, &out, 2), "--warmup", "2"), strings(&["--overwrite"])].concat());
    assert!(!stderr(&fits).contains("warmup"), "{}", stderr(&fits));
}

#[test]
fn a_checkpoint_of_the_other_kind_is_named_as_such() {
    let dir = scratch("messages", "kind");
    let language = dir.join("language");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &language, 1)));
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../data");
    let image_args =
        strings(&["train-image", "--epochs", "1", "--train-images", "64", "--base-width", "4", "--data-dir", data]);
    assert_succeeds(&run(&dir, &[image_args.clone(), strings(&["--out-dir", "image"])].concat()));
    let image = dir.join("image/checkpoint.safetensors").display().to_string();
    for args in
        [strings(&["eval", &image, "val.bin"]), strings(&["sample", &image]), strings(&["export", &image, "hf"])]
    {
        assert_fails_with(&run(&dir, &args), &["is an image-classification checkpoint (train-image)"]);
    }
    let resume = run(&dir, &[image_args, strings(&["--resume", "--out-dir", "language"])].concat());
    assert_fails_with(&resume, &["is a language-model checkpoint (train)"]);
    let resume = run(&dir, &strings(&["train", "--resume", "--out-dir", "image"]));
    assert_fails_with(&resume, &["is an image-classification checkpoint (train-image)"]);
}

#[test]
fn a_failed_rename_leaves_no_temporary_file() {
    let dir = scratch("messages", "rename");
    // A non-empty directory where the file should go: the rename over it fails.
    let path = dir.join("config.json");
    std::fs::create_dir_all(path.join("inside")).unwrap();
    let msg = format!("{:#}", atomic_write(&path, b"{}").unwrap_err());
    assert!(msg.contains("config.json"), "{msg}");
    assert!(!temp_path_for(&path).unwrap().exists(), "the temporary file stayed behind");
    assert!(Path::new(&path).is_dir());
}

#[test]
fn a_fifo_given_as_a_token_file_or_checkpoint_is_refused_without_blocking() {
    let dir = scratch("messages", "fifo");
    let fifo = dir.join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.display().to_string();
    for args in [
        [tiny_flags(1), strings(&["--train-data", &fifo, "--out-dir", "run"])].concat(),
        strings(&["eval", &fifo, "val.bin"]),
    ] {
        let mut child = transponder(&dir, &args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() && started.elapsed() < std::time::Duration::from_secs(20) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?} blocked on the FIFO");
        }
        assert_fails_with(&child.wait_with_output().unwrap(), &[&format!("{fifo} is not a regular file")]);
    }
}
