//! Every numeric flag of `train`, `eval` and `sample` at odd values (0, negative, huge,
//! overflowing, NaN, not a number): each run ends — with a result or an error message —
//! and none panics or aborts (exit status 0, 1 or clap's 2).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

const ODD_VALUES: [&str; 8] = ["0", "1", "-1", "x", "nan", "1e40", "4294967297", "18446744073709551616"];

/// Runs `args` in `dir`, failing on a panic, an abort, or a run longer than a minute.
fn assert_ends_cleanly(dir: &std::path::Path, args: &[String]) {
    let mut child = transponder(dir, args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("{args:?} ran for over a minute");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let output = child.wait_with_output().unwrap();
    let text = stderr(&output);
    assert!(matches!(output.status.code(), Some(0..=2)), "{args:?}: {:?}\n{text}", output.status);
    assert!(!text.contains("panicked"), "{args:?}: {text}");
}

#[test]
fn odd_values_of_every_numeric_flag_end_cleanly() {
    let dir = scratch("flags", "sweep");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let checkpoint = out.join("checkpoint.safetensors").display().to_string();
    let train_flags = [
        "--batch-size",
        "--seq-len",
        "--grad-accum",
        "--lr",
        "--weight-decay",
        "--warmup",
        "--grad-clip",
        "--eval-every",
        "--eval-batches",
        "--save-every",
        "--log-every",
        "--d-model",
        "--rank",
        "--momentum",
        "--seed",
    ];
    for flag in train_flags {
        for value in ODD_VALUES {
            let args =
                [set_flag(tiny_train(&dir, &dir.join("sweep"), 1), flag, value), strings(&["--overwrite"])].concat();
            assert_ends_cleanly(&dir, &args);
        }
    }
    // Not a huge --steps: that is a long run, not an error.
    for value in ["0", "-1", "x", "nan"] {
        assert_ends_cleanly(&dir, &set_flag(tiny_train(&dir, &dir.join("steps"), 1), "--steps", value));
    }
    for flag in ["--batch-size", "--batches"] {
        for value in ODD_VALUES {
            assert_ends_cleanly(&dir, &strings(&["eval", &checkpoint, "val.bin", flag, value]));
        }
    }
    for flag in ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"] {
        for value in ODD_VALUES {
            let sample = strings(&["sample", &checkpoint, "--max-new-tokens", "4"]);
            assert_ends_cleanly(&dir, &set_flag(sample, flag, value));
        }
    }
}
