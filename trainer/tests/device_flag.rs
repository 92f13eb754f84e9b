//! The `--device` and `--bf16` flags of every computing command, through the real binary:
//! a bad device name is refused with the valid spellings, `--bf16` needs a GPU, and on a
//! build without the `cuda` feature a GPU device says to rebuild with it. Runs in CI (no
//! GPU needed); nothing here trains.

use std::process::{Command, Output};

fn transponder(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_transponder")).args(args).output().unwrap()
}

fn train_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train-bench")).args(args).output().unwrap()
}

/// Fails the test unless the command failed with `needle` in its stderr.
fn assert_fails_with(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "expected a failure mentioning {needle:?}; stderr: {stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in stderr: {stderr}");
}

/// A scratch run directory that no command will get far enough to write.
fn out_dir(name: &str) -> String {
    std::env::temp_dir().join(format!("transponder-device-{name}-{}", std::process::id())).display().to_string()
}

#[test]
fn an_unknown_device_lists_the_valid_ones() {
    let out = out_dir("unknown");
    for args in [
        vec!["train", "--device", "tpu", "--out-dir", &out],
        vec!["train-image", "--device", "cuda:x", "--out-dir", &out],
        vec!["eval", "missing.safetensors", "missing.bin", "--device", "gpu0"],
        vec!["sample", "missing.safetensors", "--device", "metal"],
        vec!["analyze", "--throughput", "--device", "cuda:"],
        vec!["compare", "--device", "cuda0", "--out-dir", &out],
    ] {
        assert_fails_with(&transponder(&args), "cpu, cuda or cuda:N");
    }
    assert_fails_with(&train_bench(&["--device", "tpu"]), "cpu, cuda or cuda:N");
}

#[test]
fn bf16_needs_a_gpu() {
    let out = out_dir("bf16");
    assert_fails_with(
        &transponder(&["train", "--bf16", "--steps", "1", "--out-dir", &out]),
        "--bf16 needs --device cuda",
    );
    assert_fails_with(&train_bench(&["--bf16", "--steps", "1"]), "--bf16 needs --device cuda");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_device_without_the_cuda_feature_says_to_rebuild() {
    let out = out_dir("nocuda");
    let hint = "rebuild with --features cuda";
    for args in [
        vec!["train", "--device", "cuda", "--steps", "1", "--out-dir", &out],
        vec!["train", "--device", "cuda:1", "--bf16", "--steps", "1", "--out-dir", &out],
        vec!["train-image", "--device", "cuda", "--epochs", "1", "--out-dir", &out],
        vec!["eval", "missing.safetensors", "missing.bin", "--device", "cuda"],
        vec!["sample", "missing.safetensors", "--device", "cuda:0"],
        vec!["analyze", "--throughput", "--device", "cuda", "--out", &out],
        vec!["compare", "--variants", "pre-ln", "--device", "cuda", "--out-dir", &out],
    ] {
        assert_fails_with(&transponder(&args), hint);
    }
    assert_fails_with(&train_bench(&["--device", "cuda", "--steps", "1"]), hint);
    assert!(!std::path::Path::new(&out).exists(), "a refused run must not create its directory");
}
