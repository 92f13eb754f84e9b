//! What a run trains on is what its flags say: the `--text` token cache is keyed by the
//! file's content, not its name, and conflicting data flags are errors.

mod common;

use std::path::Path;

use common::*;

/// The loss of every metrics row of `run_dir`.
fn losses(run_dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

/// `train --text <text> --out-dir run` in `dir` for 2 steps, with `extra` flags.
fn train_on_text(dir: &Path, text: &Path, extra: &[&str]) -> std::process::Output {
    let text = text.display().to_string();
    let args = [tiny_flags(2), strings(&["--text", &text, "--out-dir", "run"]), strings(extra)].concat();
    run(dir, &args)
}

#[test]
fn two_texts_of_the_same_name_are_two_corpora() {
    let dir = scratch("data-flags", "same-name");
    let (a, b) = (dir.join("a/corpus.txt"), dir.join("b/corpus.txt"));
    for (path, line) in [(&a, "to be or not to be, that is the question. "), (&b, "all the world's a stage, and all. ")]
    {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, line.repeat(40)).unwrap();
    }
    assert_succeeds(&train_on_text(&dir, &a, &[]));
    let on_a = losses(&dir.join("run"));
    assert_succeeds(&train_on_text(&dir, &b, &["--overwrite"]));
    let on_b = losses(&dir.join("run"));
    assert_ne!(on_a, on_b, "b/corpus.txt trained on a's cached tokens");
    // The same content again reuses its tokens: the losses repeat exactly.
    assert_succeeds(&train_on_text(&dir, &a, &["--overwrite"]));
    assert_eq!(losses(&dir.join("run")), on_a);
}

#[test]
fn conflicting_data_flags_are_errors() {
    let dir = scratch("data-flags", "conflicts");
    let (train, val) = token_files(&dir);
    let (train, val) = (train.display().to_string(), val.display().to_string());
    std::fs::write(dir.join("corpus.txt"), "to be or not to be, that is the question. ".repeat(40)).unwrap();
    std::fs::write(dir.join("val-only.json"), format!(r#"{{"val_data": "{val}"}}"#)).unwrap();
    let train_run =
        |extra: &[&str]| run(&dir, &[tiny_flags(1), strings(&["--out-dir", "run"]), strings(extra)].concat());

    assert_fails_with(&train_run(&["--val-data", &val]), &["--val-data", "--train-data"]);
    assert_fails_with(&train_run(&["--config", "val-only.json"]), &["--val-data", "--train-data"]);
    let both = train_run(&["--text", "corpus.txt", "--train-data", &train, "--val-data", &val]);
    assert_fails_with(&both, &["--text", "--train-data"]);
    assert!(!dir.join("run").exists(), "a refused run must not create its directory");

    let compare = |extra: &[&str]| {
        let base = strings(&["compare", "--variants", "pre-ln", "--steps", "1", "--seeds", "1", "--out-dir", "cmp"]);
        run(&dir, &[base, strings(extra)].concat())
    };
    assert_fails_with(&compare(&["--val-data", &val]), &["--val-data", "--train-data"]);
    assert_fails_with(&compare(&["--text", "corpus.txt", "--train-data", &train, "--val-data", &val]), &["--text"]);

    // A resumed run may switch from its text to token files: the flags replace the source.
    assert_succeeds(&train_run(&["--text", "corpus.txt"]));
    let switched =
        run(&dir, &strings(&["train", "--out-dir", "run", "--resume", "--steps", "2", "--train-data", &train]));
    assert_succeeds(&switched);
    assert!(stderr(&switched).contains("train_data"), "{}", stderr(&switched));
}
