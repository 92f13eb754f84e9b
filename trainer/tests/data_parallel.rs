//! Data-parallel training end to end, ranks as processes over loopback (`transponder launch`):
//! 2 ranks equal one process with `--grad-accum 2` bit for bit, 4 ranks match `--grad-accum 4`
//! within the noise of summation order, the parameters stay identical across ranks (and a
//! perturbed rank is caught), a checkpoint resumes on another world size, a rank that dies or
//! hangs stops the others, and bad rendezvous inputs are clear errors before any step.
//! On the CPU (the host collective); `cuda_data_parallel.rs` repeats the bitwise test on the
//! emulated GPU (the emulated NCCL).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::data_parallel::{checkpoint_bits, free_port, launch, losses, metric_rows, run_args, single, transponder};
use common::{assert_fails_with, assert_succeeds, scratch, set_flag, stderr, stdout};

#[test]
fn two_ranks_equal_one_process_with_grad_accum_two_bit_for_bit() {
    let dir = scratch("dp", "bitwise");
    let (ranks_args, ranks_out) = run_args(&dir, "ranks", 4, 2);
    assert_succeeds(&launch(&dir, 2, &ranks_args, &[]));
    let (single_args, single_out) = run_args(&dir, "single", 4, 2);
    assert_succeeds(&single(&dir, &set_flag(single_args, "--grad-accum", "2")));

    let rows = metric_rows(&ranks_out);
    assert_eq!(rows.len(), 4, "rank 0 alone writes one row a step");
    assert_eq!(rows, metric_rows(&single_out), "losses and gradient norms, bit for bit");
    assert_eq!(checkpoint_bits(&ranks_out), checkpoint_bits(&single_out), "every checkpoint tensor, bit for bit");
}

#[test]
fn rank_zero_alone_prints_and_the_others_stay_quiet() {
    let dir = scratch("dp", "quiet");
    let (args, _) = run_args(&dir, "run", 2, 2);
    let output = launch(&dir, 2, &args, &[]);
    assert_succeeds(&output);
    let (out, err) = (stdout(&output), stderr(&output));
    assert!(out.contains("data parallel: 2 ranks × batch 2 × grad_accum 1 = 4 sequences per step"), "{out}");
    assert_eq!(out.matches("step     2/2").count(), 1, "one progress line a step: {out}");
    assert!(!out.contains("[rank 1]") && !err.contains("[rank 1]"), "rank 1 printed: {out}\n{err}");
}

#[test]
fn four_ranks_match_grad_accum_four_within_the_noise_of_summation_order() {
    let dir = scratch("dp", "four");
    let steps = 5;
    let (ranks_args, ranks_out) = run_args(&dir, "ranks", steps, steps);
    assert_succeeds(&launch(&dir, 4, &ranks_args, &[]));
    let (accum_args, accum_out) = run_args(&dir, "accum", steps, steps);
    assert_succeeds(&single(&dir, &set_flag(accum_args, "--grad-accum", "4")));
    // The noise floor: one process, the same 8 rows a step, as one batch of 8 instead of 2 × 4.
    let (wide_args, wide_out) = run_args(&dir, "wide", steps, steps);
    assert_succeeds(&single(&dir, &set_flag(wide_args, "--batch-size", "8")));

    let (ranks, accum, wide) = (losses(&ranks_out), losses(&accum_out), losses(&wide_out));
    let (noise, gap) = (max_difference(&accum, &wide), max_difference(&ranks, &accum));
    assert!(gap <= 4.0 * noise.max(1e-6), "4 ranks vs accum 4: {gap:e}, noise floor {noise:e}\n{ranks:?}\n{accum:?}");
}

#[test]
fn a_rank_whose_parameters_drift_stops_the_run_naming_it() {
    let dir = scratch("dp", "perturb");
    let (args, _) = run_args(&dir, "run", 4, 1);
    let output = launch(&dir, 2, &args, &[("TRANSPONDER_TEST_FAULT", "1:perturb@2")]);
    assert_fails_with(&output, &["parameters differ across ranks after step 2", "rank 1"]);
}

#[test]
fn a_checkpoint_resumes_on_another_world_size() {
    let dir = scratch("dp", "resume");
    let (whole_args, whole_out) = run_args(&dir, "whole", 6, 3);
    assert_succeeds(&launch(&dir, 2, &whole_args, &[]));

    // 2 ranks for 3 steps, then 1 process with the same global batch (grad_accum 2): exact.
    let (first_args, split_out) = run_args(&dir, "split", 3, 3);
    assert_succeeds(&launch(&dir, 2, &first_args, &[]));
    let mut resumed = set_flag(first_args, "--steps", "6");
    resumed.push("--resume".into());
    let output = single(&dir, &resumed);
    assert_succeeds(&output);
    assert!(stderr(&output).contains("resuming on 1 rank(s) × batch 2 × grad_accum 2 (saved: 2 × 2 × 1)"));
    assert_eq!(metric_rows(&split_out), metric_rows(&whole_out), "2 ranks → 1 process, bit for bit");
    assert_eq!(checkpoint_bits(&split_out), checkpoint_bits(&whole_out));

    // 2 ranks for 3 steps, then 4 ranks of batch 1 (the same global batch of 4): the same rows,
    // summed in another order, so within the noise of summation order (one process, batch 4
    // against batch 2 × 2, over the same 6 steps).
    let (first_args, wider_out) = run_args(&dir, "wider", 3, 3);
    assert_succeeds(&launch(&dir, 2, &first_args, &[]));
    let mut resumed = set_flag(set_flag(first_args, "--steps", "6"), "--batch-size", "1");
    resumed.push("--resume".into());
    assert_succeeds(&launch(&dir, 4, &resumed, &[]));
    let (accum_args, accum_out) = run_args(&dir, "accum", 6, 6);
    assert_succeeds(&single(&dir, &set_flag(accum_args, "--grad-accum", "2")));
    let (wide_args, wide_out) = run_args(&dir, "wide", 6, 6);
    assert_succeeds(&single(&dir, &set_flag(wide_args, "--batch-size", "4")));
    let noise = max_difference(&losses(&accum_out), &losses(&wide_out));
    let gap = max_difference(&losses(&wider_out), &losses(&whole_out));
    assert!(gap <= 4.0 * noise.max(1e-6), "2 → 4 ranks: {gap:e} against a noise floor of {noise:e}");
}

/// The largest difference between two runs' losses, step by step.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn a_rank_that_dies_stops_the_others_and_the_run_resumes() {
    let dir = scratch("dp", "dies");
    let (args, out) = run_args(&dir, "run", 5, 2);
    let started = Instant::now();
    let output = launch(&dir, 2, &args, &[("TRANSPONDER_TEST_FAULT", "1:exit@3")]);
    assert!(started.elapsed() < Duration::from_secs(60), "the survivors hung: {:?}", started.elapsed());
    assert_fails_with(&output, &["rank 1", "step 3", "--resume"]);
    assert_eq!(common::checkpoint_step(&out), 2, "the last good checkpoint is kept");

    let mut resumed = args.clone();
    resumed.push("--resume".into());
    assert_succeeds(&launch(&dir, 2, &resumed, &[]));
    assert_eq!(common::checkpoint_step(&out), 5);
    assert_eq!(common::metric_steps(&out), [1, 2, 3, 4, 5]);
}

#[test]
fn losing_rank_zero_stops_the_others_naming_it() {
    let dir = scratch("dp", "leader");
    let (args, _) = run_args(&dir, "run", 4, 4);
    let output = launch(&dir, 3, &args, &[("TRANSPONDER_TEST_FAULT", "0:exit@2")]);
    assert_fails_with(&output, &["lost rank 0 (the rendezvous host) at step 2"]);
}

#[test]
fn a_hung_rank_trips_the_collective_deadline() {
    let dir = scratch("dp", "hang");
    let (args, _) = run_args(&dir, "run", 4, 4);
    let args = set_flag(args, "--collective-timeout", "3");
    let started = Instant::now();
    let output = launch(&dir, 2, &args, &[("TRANSPONDER_TEST_FAULT", "1:hang@2")]);
    assert!(started.elapsed() < Duration::from_secs(60), "not stopped by the deadline: {:?}", started.elapsed());
    assert_fails_with(&output, &["timed out", "waiting for rank 1"]);
}

/// Rank `rank` of `world` started by hand (as torchrun or srun would), on `port`.
fn rank_process(dir: &Path, args: &[String], rank: usize, world: usize, port: u16) -> Command {
    let mut command = transponder(dir);
    command.args(args).envs([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]);
    command
}

#[test]
fn ranks_with_different_configs_are_refused_before_any_step() {
    let dir = scratch("dp", "fingerprint");
    let (args, out) = run_args(&dir, "run", 2, 2);
    let args = set_flag(args, "--rendezvous-timeout", "20");
    let port = free_port();
    let leader = rank_process(&dir, &args, 0, 2, port).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let other = rank_process(&dir, &set_flag(args.clone(), "--lr", "0.5"), 1, 2, port).output().unwrap();
    let leader = leader.wait_with_output().unwrap();
    assert!(!other.status.success() && !leader.status.success());
    let both = format!("{}\n{}", stderr(&leader), stderr(&other));
    assert!(both.contains("rank 1's training config differs from rank 0's"), "{both}");
    assert!(!out.join("metrics.jsonl").exists(), "no step ran");
}

#[test]
fn an_unreachable_master_is_a_clear_error() {
    let dir = scratch("dp", "unreachable");
    let (args, _) = run_args(&dir, "run", 2, 2);
    let args = set_flag(args, "--rendezvous-timeout", "2");
    let started = Instant::now();
    let output = rank_process(&dir, &args, 1, 2, free_port()).output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_fails_with(&output, &["could not reach rank 0"]);
}
