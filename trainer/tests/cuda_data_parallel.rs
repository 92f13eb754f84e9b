//! Data parallel on the emulated GPU: 2 ranks, each with its own emulated device, reduce
//! their gradients through the emulated NCCL and equal one process with `--grad-accum 2`, bit
//! for bit (losses, gradient norms, every checkpoint tensor). Skips without
//! `TRANSPONDER_CUDA=emulate` (CI sets it); on a GPU machine `bench/gpu/run.sh` runs real NCCL.
#![cfg(feature = "cuda-emu")]

mod common;

use common::data_parallel::{checkpoint_bits, launch, metric_rows, run_args, single};
use common::{assert_succeeds, scratch, set_flag};

#[test]
fn two_emulated_gpu_ranks_equal_grad_accum_two_bit_for_bit() {
    if std::env::var("TRANSPONDER_CUDA").as_deref() != Ok("emulate") {
        eprintln!("skipped: set TRANSPONDER_CUDA=emulate to run data parallel on the emulated GPU");
        return;
    }
    let dir = scratch("cuda-dp", "bitwise");
    let (ranks_args, ranks_out) = run_args(&dir, "ranks", 3, 3);
    let output = launch(&dir, 2, &set_flag(ranks_args, "--device", "cuda"), &[]);
    assert_succeeds(&output);
    assert!(common::stdout(&output).contains("emulated NCCL"), "{}", common::stdout(&output));
    let (single_args, single_out) = run_args(&dir, "single", 3, 3);
    let single_args = set_flag(set_flag(single_args, "--grad-accum", "2"), "--device", "cuda");
    assert_succeeds(&single(&dir, &single_args));
    assert_eq!(metric_rows(&ranks_out), metric_rows(&single_out));
    assert_eq!(checkpoint_bits(&ranks_out), checkpoint_bits(&single_out));
}
