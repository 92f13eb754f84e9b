//! SIGINT, SIGTERM and SIGKILL at random moments of `train --save-every 1` and of
//! `train-image` (which saves every epoch): what is on disk always loads, and `--resume`
//! continues the run, each step logged once.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use trainer::config::TrainConfig;

/// Waits until `path` exists, failing after a minute or if `child` ends first.
fn wait_for(path: &Path, child: &mut Child) {
    let started = Instant::now();
    while !path.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before writing {}", path.display());
        assert!(started.elapsed() < Duration::from_secs(60), "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `signal` (`INT`, `TERM` or `KILL`) to `child` and waits for it to end.
fn signal(child: &mut Child, signal: &str) {
    let sent = std::process::Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status();
    assert!(sent.unwrap().success(), "kill -{signal} failed");
    child.wait().unwrap();
}

/// A small deterministic generator of delays (its seed is printed, to replay a failure).
struct Delays(u64);

impl Delays {
    fn next_millis(&mut self, below: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

fn seed() -> u64 {
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    println!("delay seed {seed}");
    seed
}

/// Fails unless the run in `run_dir` loads: its checkpoint, its config.json, its metrics rows
/// (a last row torn by the signal aside).
fn assert_loads(run_dir: &Path) -> usize {
    let step = checkpoint_step(run_dir);
    let config = std::fs::read_to_string(run_dir.join("config.json")).unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(&config).is_ok(), "config.json does not parse: {config}");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let complete = metrics.lines().count() - usize::from(!metrics.ends_with('\n') && !metrics.is_empty());
    for line in metrics.lines().take(complete) {
        assert!(serde_json::from_str::<serde_json::Value>(line).is_ok(), "a metrics row does not parse: {line}");
    }
    step
}

/// Each step at most once, in order.
fn assert_each_step_once(steps: &[u64]) {
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "steps repeated or out of order: {steps:?}");
}

#[test]
fn a_signalled_train_leaves_a_run_that_loads_and_resumes() {
    let mut delays = Delays(seed());
    for (i, name) in ["INT", "TERM", "KILL", "INT", "TERM", "KILL"].iter().enumerate() {
        let dir = scratch("signals", &format!("train-{i}"));
        let out = dir.join("run");
        let args = set_flag(tiny_train(&dir, &out, 1_000_000), "--log-every", "1");
        let mut child = transponder(&dir, &[args, strings(&["--save-every", "1"])].concat())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for(&out.join("checkpoint.safetensors"), &mut child);
        std::thread::sleep(Duration::from_millis(delays.next_millis(300)));
        signal(&mut child, name);
        let step = assert_loads(&out);
        let saved: TrainConfig =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(saved.seq_len, 16);
        let target = (step + 2).to_string();
        assert_succeeds(&run(&dir, &strings(&["train", "--resume", "--out-dir", "run", "--steps", &target])));
        assert_eq!(checkpoint_step(&out), step + 2, "SIG{name}");
        let steps = metric_steps(&out);
        assert_each_step_once(&steps);
        assert_eq!(steps.last(), Some(&(step as u64 + 2)), "SIG{name}");
    }
}

#[test]
fn a_signalled_train_image_leaves_a_run_that_loads_and_resumes() {
    let mut delays = Delays(seed());
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../data");
    for (i, name) in ["INT", "TERM", "KILL"].iter().enumerate() {
        let dir = scratch("signals", &format!("image-{i}"));
        let out = dir.join("run");
        let args = strings(&[
            "train-image",
            "--epochs",
            "100000",
            "--train-images",
            "64",
            "--batch-size",
            "32",
            "--base-width",
            "4",
            "--data-dir",
            data,
            "--out-dir",
            "run",
        ]);
        let mut child = transponder(&dir, &args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        wait_for(&out.join("checkpoint.safetensors"), &mut child);
        std::thread::sleep(Duration::from_millis(delays.next_millis(300)));
        signal(&mut child, name);
        let step = assert_loads(&out);
        // Two steps an epoch: resume for one more epoch.
        let epochs = (step / 2 + 1).to_string();
        assert_succeeds(&run(&dir, &strings(&["train-image", "--resume", "--out-dir", "run", "--epochs", &epochs])));
        assert_eq!(checkpoint_step(&out), step + 2, "SIG{name}");
        let steps = metric_steps(&out);
        assert_each_step_once(&steps);
        assert_eq!(steps.last(), Some(&(step as u64 + 2)), "SIG{name}");
    }
}
