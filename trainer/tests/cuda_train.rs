//! Training on a GPU: llama-tiny for 20 steps on CUDA and on the CPU from the same seed and
//! data must log the same losses to 1e-2 relative (f32 on both, different summation orders)
//! and the loss must fall; a CUDA checkpoint (weights and AdamW state downloaded) resumes
//! on CUDA and on the CPU to the same losses; bf16 stays near the f32 CPU run; a ResNet-18
//! with CoMT modulators agrees with the CPU (its first steps free-running, every step of
//! 30 steps in lockstep) and repeats bit for bit. Skips without a GPU.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use autograd::Var;
use models::resnet::ResNet;
use nn::optim::{Optimizer, Sgd};
use nn::vision::StateDict;
use nn::Module;
use tensor::{Device, Tensor};
use trainer::config::{ScheduleKind, TrainConfig};
use trainer::data::images::{ImageLoader, Normalization};
use trainer::data::token_file::write_llmc;
use trainer::train::{train, Diverged, METRICS_FILE};
use trainer::train_image::{train_image, ImageTrainConfig};

const GPU: Device = Device::Cuda(0);
const STEPS: usize = 20;
const RTOL: f32 = 1e-2;

/// GPU 0 for one test at a time, or `None` (saying so) without a GPU. The tests take turns
/// because `--bf16` sets a process-wide GEMM precision for the length of its run: a bf16 run
/// beside an f32 one would change the f32 run's products.
fn gpu_to_myself() -> Option<MutexGuard<'static, ()>> {
    static TURN: Mutex<()> = Mutex::new(());
    if tensor::cuda::is_available() {
        return Some(TURN.lock().unwrap_or_else(PoisonError::into_inner));
    }
    assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no CUDA device");
    eprintln!("skipping: no CUDA device");
    None
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

/// Every logged number of a run's metrics (loss, validation loss, gradient norm), as bits.
fn logged_bits(run_dir: &Path) -> Vec<(String, u64)> {
    let text = std::fs::read_to_string(run_dir.join(METRICS_FILE)).unwrap();
    let mut numbers = Vec::new();
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in ["step", "loss", "val_loss", "grad_norm"] {
            if let Some(value) = row[key].as_f64() {
                numbers.push((key.to_string(), value.to_bits()));
            }
        }
    }
    numbers
}

/// `--cuda-graph` (the step run once in the graph's pool, captured, then replayed at every
/// later step) logs what the eager run logs, bit for bit: the same kernels on the same data
/// in the same order. bf16 Transponder (the fused gated groups) and f32 pre-ln, two
/// micro-batches per step, with a validation pass and a checkpoint between replays.
#[test]
fn a_run_replayed_as_a_cuda_graph_logs_the_eager_runs_numbers_bit_for_bit() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    for (variant, bf16) in [("transponder", true), ("pre-ln", false)] {
        let (eager_dir, graph_dir) = (scratch(&format!("eager-{variant}")), scratch(&format!("graph-{variant}")));
        let run = |dir: &Path, cuda_graph: bool| {
            let base = config(dir, GPU, 6);
            let config = TrainConfig {
                variant: variant.into(),
                bf16,
                cuda_graph,
                grad_accum: 2,
                eval_every: 3,
                save_every: 3,
                ..base
            };
            train(&config, false).unwrap();
            logged_bits(&config.out_dir)
        };
        let eager = run(&eager_dir, false);
        let dev = tensor::cuda::device(0).unwrap();
        let before = dev.counters();
        let graphed = run(&graph_dir, true);
        // Steps 1 and 2 run eagerly (the second in the graph's pool); 3 to 6 are replays.
        assert_eq!(dev.counters().since(&before).graph_launches, 4, "{variant}: replays");
        assert!(eager.iter().filter(|(key, _)| key == "val_loss").count() >= 2, "{variant}: {eager:?}");
        assert_eq!(eager, graphed, "{variant}: the graph run logged other numbers than the eager run");
        println!("{variant}: {} numbers logged alike", eager.len());
    }
}

/// bf16 products (f32 accumulation and master weights) against the f32 CPU run: each
/// product rounds its inputs to 8 significant bits, so the losses drift further apart.
const BF16_RTOL: f32 = 5e-2;

#[test]
fn bf16_cuda_training_stays_near_the_f32_cpu_run() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    let (cpu_dir, gpu_dir) = (scratch("bf16-cpu"), scratch("bf16-gpu"));
    let cpu = config(&cpu_dir, Device::Cpu, 8);
    let gpu = TrainConfig { bf16: true, ..config(&gpu_dir, GPU, 8) };
    train(&cpu, false).unwrap();
    train(&gpu, false).unwrap();
    let (cpu_losses, gpu_losses) = (losses(&cpu.out_dir), losses(&gpu.out_dir));
    println!("f32 cpu {cpu_losses:?}\nbf16 cuda {gpu_losses:?}");
    assert_within("bf16 cuda vs f32 cpu", &cpu_losses, &gpu_losses, BF16_RTOL);
}

/// Free-running ResNet steps whose losses must agree. SGD with momentum 0.9 on this tiny
/// batch-normalised ResNet amplifies summation-order differences: on an H100 the pixel run
/// stayed within 5e-7 of the CPU for 8 steps, then drifted by 4e-5, 1.6e-4 and 3e-3 at
/// steps 9-11, although each of those steps, started from the CPU's parameters, agrees to
/// 2e-7 ([`resnet_steps_agree_in_lockstep`], 30 steps of both modulators there) and two CUDA
/// runs repeat bit for bit. On the emulated device the sliding-window run stays within
/// 3e-6 up to step 18, then jumps to 4e-4 at step 19 and 3% by step 40, as a CPU run does
/// against itself with its learning rate changed by one part in a million. So only the
/// first steps are compared; the lockstep test covers the rest.
const RESNET_FREE_STEPS: usize = 8;
/// Relative loss tolerance of those steps (seen: ≤ 5e-7).
const RESNET_FREE_RTOL: f32 = 1e-3;

/// A ResNet-18 configuration with `modulator` on the built-in digits, one epoch of 44 steps
/// of 32 images, a loss logged at every step.
fn resnet_config(modulator: &str, device: Device) -> ImageTrainConfig {
    ImageTrainConfig {
        modulator: modulator.into(),
        base_width: 4,
        data_dir: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data")),
        batch_size: 32,
        epochs: 1,
        lr: 0.05,
        log_every: 1,
        out_dir: scratch(&format!("resnet-{modulator}-{}", device_name(device))),
        device,
        ..ImageTrainConfig::default()
    }
}

#[test]
fn resnet_with_modulators_trains_on_cuda_as_on_the_cpu() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    for modulator in ["pixel", "sliding-window"] {
        let run = |device: Device| {
            let config = resnet_config(modulator, device);
            train_image(&config, false).unwrap();
            losses(&config.out_dir)
        };
        let (cpu_losses, gpu_losses) = (run(Device::Cpu), run(GPU));
        println!("{modulator}: cpu {cpu_losses:?}\ncuda {gpu_losses:?}");
        assert_eq!(cpu_losses.len(), gpu_losses.len());
        let what = format!("resnet-18 {modulator}, cuda vs cpu");
        let first = RESNET_FREE_STEPS.min(cpu_losses.len());
        assert_within(&what, &cpu_losses[..first], &gpu_losses[..first], RESNET_FREE_RTOL);
        let (start, end) = (gpu_losses[0], gpu_losses[gpu_losses.len() - 1]);
        assert!(end < 0.5 * start, "{what}: the CUDA run did not learn ({start} -> {end})");
    }
}

/// Every step of a training run, the CUDA model given the CPU model's current parameters:
/// the same batch must give the same loss and the same gradients, so a kernel that is wrong
/// only for the states a trained model reaches cannot hide behind the free-running drift.
/// Each step's worst gradient difference (relative to its parameter's largest gradient) is
/// printed, to show how close the two devices are, not only that they pass.
#[test]
fn resnet_steps_agree_in_lockstep() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    for modulator in ["pixel", "sliding-window"] {
        resnet_lockstep(modulator, 30);
    }
}

fn resnet_lockstep(modulator: &str, steps: usize) {
    let config = resnet_config(modulator, Device::Cpu);
    let (train_set, _) = config.datasets().unwrap();
    let norm = Normalization::from_dataset(&train_set);
    let model_config = config.model_config(train_set.channels(), train_set.num_classes()).unwrap();
    let cpu = ResNet::new(&model_config, config.seed).unwrap();
    let gpu = ResNet::new(&model_config, config.seed).unwrap();
    StateDict(&gpu).to_device(GPU).unwrap();
    let mut optimizer = Sgd::new(cpu.named_parameters(), config.momentum, config.weight_decay, false);
    let mut loader = ImageLoader::new(train_set, config.batch_size, norm, config.augmentation(), config.seed).unwrap();
    for step in 1..=steps {
        let batch = loader.next_batch().unwrap();
        let images =
            Tensor::from_vec(batch.images, &[batch.batch_size, batch.channels, batch.height, batch.width]).unwrap();
        for (c, g) in cpu.named_parameters().iter().zip(gpu.named_parameters()) {
            g.var.set_value(c.var.value().to_device(GPU).unwrap()).unwrap();
            g.var.set_grad(None);
        }
        let (cpu_loss, _) = cpu.loss(&Var::constant(images.clone()), &batch.labels, true).unwrap();
        let (gpu_loss, _) = gpu.loss(&Var::constant(images.to_device(GPU).unwrap()), &batch.labels, true).unwrap();
        let (want, got) = (cpu_loss.value().item().unwrap(), gpu_loss.value().to_host().unwrap().item().unwrap());
        assert!((want - got).abs() <= 1e-5 * want, "{modulator} step {step}: loss cpu {want} vs cuda {got}");
        cpu_loss.backward().unwrap();
        gpu_loss.backward().unwrap();
        let mut worst = (0.0f32, String::new());
        for (c, g) in cpu.named_parameters().iter().zip(gpu.named_parameters()) {
            let want = c.var.grad().unwrap().to_vec();
            let got = g.var.grad().unwrap().to_host().unwrap().to_vec();
            // Relative to the parameter's largest gradient, with a floor for the
            // modulators' one-element biases, whose gradients are sums that nearly cancel.
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    (w - g).abs() <= 1e-3 * scale + 1e-6,
                    "{modulator} step {step}: {}[{i}] cpu {w} vs cuda {g}",
                    c.name
                );
                let relative = (w - g).abs() / scale.max(1e-12);
                if relative > worst.0 {
                    worst = (relative, format!("{}[{i}]", c.name));
                }
            }
        }
        println!(
            "{modulator} lockstep step {step}: loss {want} vs {got}, worst gradient {:.1e} at {}",
            worst.0, worst.1
        );
        optimizer.step(config.lr).unwrap();
        optimizer.zero_grad();
    }
}

/// Two CUDA runs from the same seed log the same losses, bit for bit: no kernel on the
/// ResNet path sums in an order that varies from launch to launch.
#[test]
fn a_cuda_resnet_run_repeats_bit_for_bit() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    let run = || {
        let config = resnet_config("pixel", GPU);
        train_image(&config, false).unwrap();
        losses(&config.out_dir)
    };
    assert_eq!(run(), run(), "two CUDA runs of the same seed");
}

fn device_name(device: Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
    }
}

#[test]
fn cuda_training_matches_the_cpu_and_learns() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
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

/// A frozen α (`fixed-alpha`: the constant 1, not a parameter, so `Module::to_device` does
/// not move it) follows its gate onto the GPU: the run trains there as on the CPU (it was an
/// error, "operands on different devices").
#[test]
fn a_frozen_alpha_follows_its_gate_onto_the_gpu() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
    let (cpu_dir, gpu_dir) = (scratch("fixed-alpha-cpu"), scratch("fixed-alpha-gpu"));
    let frozen = |dir: &Path, device| TrainConfig { variant: "fixed-alpha".into(), ..config(dir, device, 5) };
    let (cpu, gpu) = (frozen(&cpu_dir, Device::Cpu), frozen(&gpu_dir, GPU));
    train(&cpu, false).unwrap();
    train(&gpu, false).unwrap();
    assert_agree("fixed-alpha cuda vs cpu", &losses(&cpu.out_dir), &losses(&gpu.out_dir));
}

#[test]
fn a_cuda_checkpoint_resumes_on_cuda_and_on_the_cpu() {
    let Some(_turn) = gpu_to_myself() else {
        return;
    };
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
    // Same device, same seed: the same losses, bit for bit (no kernel sums in a varying order).
    assert_eq!(losses(&half.out_dir), reference, "resumed on cuda");
    train(&TrainConfig { steps: STEPS, device: Device::Cpu, out_dir: cpu_copy.clone(), ..half }, true).unwrap();
    assert_agree("resumed on the cpu", &reference, &losses(&cpu_copy));
}

/// The host reads each step's loss after queueing the next step: a divergence still stops at
/// its own step (the step after it, already queued, is skipped on the device), with the log
/// of a run that reads every step at once (it saves every step), also when the steps are
/// replays of a CUDA graph (whose step guard, rewritten in place, chains the same way).
#[test]
fn a_divergence_read_one_step_late_stops_at_its_own_step() {
    let Some(_gpu) = gpu_to_myself() else { return };
    let run = |name: &str, save_every: usize, cuda_graph: bool| {
        let config = TrainConfig {
            lr: 1e30,
            grad_clip: 0.0,
            warmup: 0,
            schedule: ScheduleKind::Constant,
            save_every,
            cuda_graph,
            ..config(&scratch(name), GPU, 12)
        };
        let error = train(&config, false).unwrap_err();
        let step = error.downcast_ref::<Diverged>().unwrap_or_else(|| panic!("not a divergence: {error:#}")).step;
        (step, losses(&config.out_dir))
    };
    let (step_at_once, losses_at_once) = run("diverge-at-once", 1, false);
    let (step_late, losses_late) = run("diverge-late", 0, false);
    assert!(step_at_once < 12, "the run did not diverge before its last step");
    assert_eq!(step_late, step_at_once, "the step named");
    assert_eq!(losses_late, losses_at_once, "the steps logged before it");
    assert_eq!(losses_late.len() + 1, step_late, "one row per good step");
    println!("diverged at step {step_late}");
    let (step_graph, losses_graph) = run("diverge-graph", 0, true);
    assert_eq!((step_graph, losses_graph), (step_late, losses_late), "replayed as a CUDA graph");
}

#[test]
fn an_unopenable_gpu_is_a_clear_error() {
    let dir = scratch("ordinal");
    let far = config(&dir, Device::Cuda(4096), 1);
    let message = format!("{:#}", train(&far, false).unwrap_err());
    assert!(message.contains("no usable CUDA GPU"), "{message}");
}
