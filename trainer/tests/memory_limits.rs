//! Sizes that cannot fit are errors before anything is allocated: a model larger than the
//! machine's memory (`--d-model`, `--rank`, `train-image --base-width`) and an `eval` batch
//! larger than its file, where the process used to abort on a failed allocation.

mod common;

use common::*;

#[test]
fn sizes_that_cannot_fit_are_errors_not_aborts() {
    let dir = scratch("memory", "sizes");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let checkpoint = out.join("checkpoint.safetensors").display().to_string();
    let cases = [
        (set_flag(tiny_train(&dir, &dir.join("wide"), 1), "--d-model", "1000000"), "memory"),
        (
            set_flag(
                set_flag(tiny_train(&dir, &dir.join("rank"), 1), "--variant", "transponder"),
                "--rank",
                "1000000000",
            ),
            "memory",
        ),
        (strings(&["train-image", "--epochs", "1", "--base-width", "1000000", "--out-dir", "image"]), "memory"),
        (strings(&["eval", &checkpoint, "val.bin", "--batch-size", "100000000"]), "--batch-size"),
    ];
    for (args, needle) in cases {
        let output = run(&dir, &args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}", stderr(&output));
        assert_fails_with(&output, &[needle]);
    }
}
