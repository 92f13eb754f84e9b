//! `train-image` under `train`'s rules: the built-in digits work from any directory, `--resume`
//! continues with the saved settings and logs each step once, and divergence (a non-finite
//! loss, gradient norm or evaluation loss) stops the run as the `Diverged` error `compare`
//! records, before anything non-finite is saved.

mod common;

use common::*;

/// A one-step-per-epoch narrow ResNet on the first 64 digits.
fn tiny_image(extra: &[&str]) -> Vec<String> {
    let base = strings(&["train-image", "--train-images", "64", "--base-width", "4", "--batch-size", "32"]);
    [base, strings(extra)].concat()
}

#[test]
fn the_built_in_digits_train_from_any_directory() {
    let dir = scratch("image-parity", "anywhere");
    assert_succeeds(&run(&dir, &tiny_image(&["--epochs", "1", "--out-dir", "run"])));
    let missing = run(&dir, &tiny_image(&["--epochs", "1", "--out-dir", "other", "--data-dir", "nowhere"]));
    assert_fails_with(&missing, &["nowhere", "--data-dir"]);
}

#[test]
fn resume_continues_with_the_saved_settings_and_logs_each_step_once() {
    let dir = scratch("image-parity", "resume");
    let first = tiny_image(&["--epochs", "1", "--lr", "0.01", "--out-dir", "run"]);
    assert_succeeds(&run(&dir, &first));
    let resumed = run(&dir, &strings(&["train-image", "--resume", "--out-dir", "run", "--epochs", "2"]));
    assert_succeeds(&resumed);
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/config.json")).unwrap()).unwrap();
    let lr = saved["lr"].as_f64().unwrap() as f32;
    let settings = (lr, &saved["train_images"], &saved["base_width"], &saved["epochs"]);
    assert_eq!(settings, (0.01, &64.into(), &4.into(), &2.into()), "{saved}");
    assert_eq!(metric_steps(&dir.join("run")), [2, 4], "each step's row once");
}

#[test]
fn a_diverging_run_stops_at_the_evaluation_before_saving() {
    let dir = scratch("image-parity", "diverge");
    // One step per epoch: the first update overflows, and the evaluation after it sees NaN.
    let args = set_flag(tiny_image(&["--epochs", "2", "--lr", "1e30", "--out-dir", "run"]), "--batch-size", "64");
    assert_fails_with(&run(&dir, &args), &["validation loss is NaN at step 1: stopping"]);
    assert!(!dir.join("run/checkpoint.safetensors").exists(), "a diverged model was saved");
}

#[test]
fn resume_refuses_changes_that_do_not_fit_and_warns_about_the_others() {
    let dir = scratch("image-parity", "changes");
    assert_succeeds(&run(&dir, &tiny_image(&["--epochs", "1", "--out-dir", "run"])));
    let resume = |extra: &[&str]| {
        run(&dir, &[strings(&["train-image", "--resume", "--out-dir", "run"]), strings(extra)].concat())
    };
    assert_fails_with(&resume(&["--base-width", "8", "--epochs", "2"]), &["cannot change base_width 4 → 8"]);
    let warned = resume(&["--lr", "0.1", "--epochs", "2"]);
    assert_succeeds(&warned);
    assert!(
        stderr(&warned).contains("lr 0.05 → 0.1") && stderr(&warned).contains("epochs 1 → 2"),
        "{}",
        stderr(&warned)
    );
}
