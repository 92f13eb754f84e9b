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
