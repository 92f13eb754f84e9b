//! Training on a GPU: llama-tiny for 20 steps on CUDA and on the CPU from the same seed and
//! data must log the same losses to 1e-2 relative (f32 on both, different summation orders)
//! and the loss must fall; a CUDA checkpoint (weights and AdamW state downloaded) resumes
//! on CUDA and on the CPU to the same losses. Skips without a GPU.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use tensor::Device;
use trainer::config::{ScheduleKind, TrainConfig};
use trainer::data::token_file::write_llmc;
use trainer::train::{train, METRICS_FILE};
use trainer::train_image::{train_image, ImageTrainConfig};

const GPU: Device = Device::Cuda(0);
const STEPS: usize = 20;
const RTOL: f32 = 1e-2;

fn no_gpu() -> bool {
    if tensor::cuda::is_available() {
        return false;
    }
    assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no CUDA device");
    eprintln!("skipping: no CUDA device");
    true
}

/// A fresh directory under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-cuda-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Byte-level train/val token files of a repetitive text, and a config training on them.
fn config(dir: &Path, device: Device, steps: usize) -> TrainConfig {
    let text = "to be or not to be, that is the question. ".repeat(40);
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let (train_data, val_data) = (dir.join("train.bin"), dir.join("val.bin"));
    write_llmc(&train_data, &tokens, 256).unwrap();
    write_llmc(&val_data, &tokens[..400], 256).unwrap();
    TrainConfig {
        model: "llama-tiny".into(),
        variant: "transponder".into(),
        train_data: Some(train_data),
        val_data: Some(val_data),
        batch_size: 4,
        seq_len: 32,
        steps,
        lr: 3e-3,
        warmup: 2,
        eval_every: 0,
        eval_batches: 2,
        save_every: 10,
        log_every: 1,
        out_dir: dir.join("run"),
        device,
        ..TrainConfig::default()
    }
}

/// The loss of every logged step.
fn losses(run_dir: &Path) -> Vec<f32> {
    std::fs::read_to_string(run_dir.join(METRICS_FILE))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["loss"].as_f64().unwrap() as f32)
        .collect()
}

fn assert_agree(what: &str, reference: &[f32], other: &[f32]) {
    assert_within(what, reference, other, RTOL);
}

fn assert_within(what: &str, reference: &[f32], other: &[f32], rtol: f32) {
    assert_eq!(reference.len(), other.len(), "{what}: logged steps");
    for (step, (a, b)) in reference.iter().zip(other).enumerate() {
        assert!((a - b).abs() <= rtol * a.abs(), "{what}, step {}: {a} vs {b}", step + 1);
    }
}

/// bf16 products (f32 accumulation and master weights) against the f32 CPU run: each
/// product rounds its inputs to 8 significant bits, so the losses drift further apart.
const BF16_RTOL: f32 = 5e-2;

#[test]
fn bf16_cuda_training_stays_near_the_f32_cpu_run() {
    if no_gpu() {
        return;
    }
    let (cpu_dir, gpu_dir) = (scratch("bf16-cpu"), scratch("bf16-gpu"));
    let cpu = config(&cpu_dir, Device::Cpu, 8);
    let gpu = TrainConfig { bf16: true, ..config(&gpu_dir, GPU, 8) };
    train(&cpu, false).unwrap();
    train(&gpu, false).unwrap();
    let (cpu_losses, gpu_losses) = (losses(&cpu.out_dir), losses(&gpu.out_dir));
    println!("f32 cpu {cpu_losses:?}\nbf16 cuda {gpu_losses:?}");
    assert_within("bf16 cuda vs f32 cpu", &cpu_losses, &gpu_losses, BF16_RTOL);
}

#[test]
fn resnet_with_modulators_trains_on_cuda_as_on_the_cpu() {
    if no_gpu() {
        return;
    }
    for modulator in ["pixel", "sliding-window"] {
        let run = |device: Device| {
            let dir = scratch(&format!("resnet-{modulator}-{}", device_name(device)));
            let config = ImageTrainConfig {
                modulator: modulator.into(),
                base_width: 4,
                data_dir: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data")),
                batch_size: 32,
                epochs: 1,
                lr: 0.05,
                out_dir: dir.clone(),
                device,
                ..ImageTrainConfig::default()
            };
            train_image(&config, false).unwrap();
            losses(&dir)
        };
        let (cpu_losses, gpu_losses) = (run(Device::Cpu), run(GPU));
        println!("{modulator}: cpu {cpu_losses:?}\ncuda {gpu_losses:?}");
        assert!(!cpu_losses.is_empty());
        assert_agree(&format!("resnet-18 {modulator}, cuda vs cpu"), &cpu_losses, &gpu_losses);
    }
}

fn device_name(device: Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
    }
}

#[test]
fn cuda_training_matches_the_cpu_and_learns() {
    if no_gpu() {
        return;
    }
    let (cpu_dir, gpu_dir) = (scratch("cpu"), scratch("gpu"));
    let cpu = config(&cpu_dir, Device::Cpu, STEPS);
    let gpu = config(&gpu_dir, GPU, STEPS);
    train(&cpu, false).unwrap();
    let report = train(&gpu, false).unwrap();
    let (cpu_losses, gpu_losses) = (losses(&cpu.out_dir), losses(&gpu.out_dir));
    assert_eq!(gpu_losses.len(), STEPS);
    assert_agree("cuda vs cpu", &cpu_losses, &gpu_losses);
    assert!(
        report.final_loss < 0.8 * report.first_loss,
        "loss must fall: {} -> {}",
        report.first_loss,
        report.final_loss
    );
    assert!(report.final_val_loss.is_some_and(f32::is_finite));
}

#[test]
fn a_cuda_checkpoint_resumes_on_cuda_and_on_the_cpu() {
    if no_gpu() {
        return;
    }
    // A constant rate, so a run of STEPS / 2 steps is the first half of one of STEPS.
    let constant = |dir: &Path, steps| TrainConfig { schedule: ScheduleKind::Constant, ..config(dir, GPU, steps) };
    let straight_dir = scratch("straight");
    let straight = constant(&straight_dir, STEPS);
    train(&straight, false).unwrap();
    let reference = losses(&straight.out_dir);

    let split_dir = scratch("split");
    let half = constant(&split_dir, STEPS / 2);
    train(&half, false).unwrap();
    let cpu_copy = split_dir.join("run-cpu");
    std::fs::create_dir_all(&cpu_copy).unwrap();
    for entry in std::fs::read_dir(&half.out_dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, cpu_copy.join(path.file_name().unwrap())).unwrap();
    }
    train(&TrainConfig { steps: STEPS, ..half.clone() }, true).unwrap();
    assert_agree("resumed on cuda", &reference, &losses(&half.out_dir));
    train(&TrainConfig { steps: STEPS, device: Device::Cpu, out_dir: cpu_copy.clone(), ..half }, true).unwrap();
    assert_agree("resumed on the cpu", &reference, &losses(&cpu_copy));
}

#[test]
fn an_unopenable_gpu_is_a_clear_error() {
    let dir = scratch("ordinal");
    let far = config(&dir, Device::Cuda(4096), 1);
    let message = format!("{:#}", train(&far, false).unwrap_err());
    assert!(message.contains("no usable CUDA GPU"), "{message}");
}
