//! A fresh `train` never discards the run in its directory: into a named `--out-dir` holding a
//! run it is refused unless `--overwrite` (or `--resume`) says what to do; the bare command
//! (default directory) goes into the next free `runs/default-N`, so running it twice works.

mod common;

use std::path::Path;

use common::*;

/// The bytes of a run's checkpoint, config and metrics.
fn run_files(run_dir: &Path) -> Vec<Vec<u8>> {
    ["checkpoint.safetensors", "config.json", "metrics.jsonl"]
        .iter()
        .map(|f| std::fs::read(run_dir.join(f)).unwrap())
        .collect()
}

#[test]
fn a_fresh_train_into_a_directory_holding_a_run_is_refused_unless_overwrite() {
    let dir = scratch("existing", "named");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 3)));
    let before = run_files(&out);

    let again = run(&dir, &tiny_train(&dir, &out, 2));
    assert_fails_with(&again, &["holds a run", "--resume", "--overwrite"]);
    assert_eq!(run_files(&out), before, "the refused run touched the old one");

    // Replacing it: the old checkpoint goes before anything of the new run is written, so a
    // new run that stops before its first save (here: it diverges) leaves no old model to resume.
    let exploding = strings(&["--overwrite", "--lr", "1e30", "--grad-clip", "0", "--schedule", "constant"]);
    let stopped = run(&dir, &[tiny_train(&dir, &out, 50), exploding, strings(&["--save-every", "100"])].concat());
    assert_fails_with(&stopped, &["step"]);
    assert!(!out.join("checkpoint.safetensors").exists(), "the replaced run's checkpoint was left behind");
    assert_succeeds(&run(&dir, &[tiny_train(&dir, &out, 2), strings(&["--overwrite"])].concat()));
    assert_eq!((checkpoint_step(&out), metric_steps(&out)), (2, vec![1, 2]));
    let both = run(&dir, &[tiny_train(&dir, &out, 2), strings(&["--overwrite", "--resume"])].concat());
    assert_fails_with(&both, &["--overwrite", "--resume"]);
}

#[test]
fn the_bare_command_run_twice_goes_into_a_new_directory() {
    let dir = scratch("existing", "default");
    let (train, val) = token_files(&dir);
    let data = strings(&["--train-data", train.to_str().unwrap(), "--val-data", val.to_str().unwrap()]);
    let bare = [tiny_flags(2), data].concat();
    assert_succeeds(&run(&dir, &bare));
    let first = run_files(&dir.join("runs/default"));
    for n in [2, 3] {
        let output = run(&dir, &bare);
        assert_succeeds(&output);
        let chosen = format!("runs/default-{n}");
        assert!(stdout(&output).contains(&chosen), "the new directory must be named: {}", stdout(&output));
        assert_eq!(checkpoint_step(&dir.join(&chosen)), 2);
    }
    assert_eq!(run_files(&dir.join("runs/default")), first, "the first run was touched");
    // --resume still means the default directory itself.
    let resumed = run(&dir, &strings(&["train", "--resume", "--steps", "3"]));
    assert_succeeds(&resumed);
    assert_eq!(checkpoint_step(&dir.join("runs/default")), 3);
}

#[test]
fn train_image_follows_the_same_rules() {
    let dir = scratch("existing", "image");
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../data");
    let args =
        strings(&["train-image", "--epochs", "1", "--train-images", "64", "--base-width", "4", "--data-dir", data]);
    assert_succeeds(&run(&dir, &args));
    let second = run(&dir, &args);
    assert_succeeds(&second);
    assert!(stdout(&second).contains("runs/resnet-digits-2"), "{}", stdout(&second));
    let named = [args.clone(), strings(&["--out-dir", "runs/resnet-digits"])].concat();
    assert_fails_with(&run(&dir, &named), &["holds a run", "--overwrite"]);
    assert_succeeds(&run(&dir, &[named, strings(&["--overwrite"])].concat()));
    assert_eq!(metric_steps(&dir.join("runs/resnet-digits")).len(), 1, "an overwritten run starts its own metrics");
}
