//! Data-parallel runs for the tests: `transponder launch` over loopback, one process with the
//! same flags, and the bits of what they wrote.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{set_flag, tiny_train};

/// A port nothing listens on now (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `transponder` with one worker thread per process (ranks share the machine's cores).
pub fn transponder(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_transponder"));
    command.current_dir(dir).env("RAYON_NUM_THREADS", "1").env_remove("TRANSPONDER_TEST_FAULT");
    command
}

/// `transponder launch --nproc-per-node ranks -- train_args`, with `env` set for every rank.
pub fn launch(dir: &Path, ranks: usize, train_args: &[String], env: &[(&str, &str)]) -> Output {
    let mut command = transponder(dir);
    let (ranks, port) = (ranks.to_string(), free_port().to_string());
    command.args(["launch", "--nproc-per-node", &ranks, "--master-port", &port, "--grace-period", "5", "--"]);
    command.args(train_args).envs(env.iter().copied());
    command.output().unwrap()
}

/// One process, no launcher.
pub fn single(dir: &Path, train_args: &[String]) -> Output {
    transponder(dir).args(train_args).output().unwrap()
}

/// `(step, loss bits, grad norm bits)` of every row of a run's metrics file.
pub fn metric_rows(run_dir: &Path) -> Vec<(u64, u32, u32)> {
    let bits = |v: &serde_json::Value| (v.as_f64().unwrap() as f32).to_bits();
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            (row["step"].as_u64().unwrap(), bits(&row["loss"]), bits(&row["grad_norm"]))
        })
        .collect()
}

/// The loss of every row of a run's metrics file.
pub fn losses(run_dir: &Path) -> Vec<f32> {
    metric_rows(run_dir).iter().map(|&(_, loss, _)| f32::from_bits(loss)).collect()
}

/// Every tensor of a run's checkpoint (weights, then optimizer state) as raw bits, and its
/// sampler state.
pub fn checkpoint_bits(run_dir: &Path) -> (Vec<(String, Vec<u32>)>, Vec<u64>) {
    let saved = trainer::checkpoint::load(&run_dir.join("checkpoint.safetensors")).unwrap();
    let mut tensors: Vec<(String, Vec<u32>)> =
        saved.weights.iter().map(|w| (w.name.clone(), w.data.iter().map(|v| v.to_bits()).collect())).collect();
    for (name, tensor) in &saved.optimizer_state {
        tensors.push((name.clone(), tensor.to_vec().iter().map(|v| v.to_bits()).collect()));
    }
    (tensors, saved.sampler_state)
}

/// `tiny_train` flags into `dir/name`, `steps` steps, saving every `save_every`.
pub fn run_args(dir: &Path, name: &str, steps: usize, save_every: usize) -> (Vec<String>, PathBuf) {
    let out = dir.join(name);
    let args = set_flag(tiny_train(dir, &out, steps), "--save-every", &save_every.to_string());
    (set_flag(args, "--schedule", "constant"), out)
}
