//! The image-classification training loop of the ResNet path (SPEC §6-7, CoMT `002` §4.1):
//! a ResNet with `none`, `pixel` or `sliding-window` modulators on the built-in UCI digits
//! (80/20 split), MNIST / Fashion-MNIST or CIFAR-10/100, SGD with momentum and weight decay, a linear or cosine
//! learning-rate schedule per step, top-1 accuracy on the evaluation split after every
//! epoch, checkpoints with exact resume, and a hard stop on a non-finite loss that keeps the
//! last good checkpoint — the conventions of the language-model loop in [`crate::train`].
//!
//! Files in the run directory:
//! - `checkpoint.safetensors`: parameters, BatchNorm running statistics (buffers, saved
//!   through [`StateDict`]), momentum buffers, the loader state and both configs; written
//!   at the end of every epoch, so a resume starts at an epoch boundary.
//! - `config.json`: this run's [`ImageTrainConfig`].
//! - `metrics.jsonl`: [`StepMetrics`] rows every `log_every` steps and at every epoch's end;
//!   the epoch-end row carries `val_loss` and `val_accuracy`. `tokens_per_second` holds
//!   images per second on this path.
//! - `grad_norms.jsonl`: the gradient-flow report (the paper's Figure 3), one row per epoch,
//!   `{"epoch", "step", "grad_norms": {parameter name: mean over the epoch's steps of that
//!   parameter's gradient L2 norm}}`.
//!
//! An epoch is `⌊N / B⌋` steps of `B` images from the shuffled loader, which continues into
//! the next pass mid-batch, so every image is seen once per `N` images drawn.
//!
//! On a GPU (`config.device`) the model is initialised on the host, then its parameters and
//! running statistics move to the device; each batch of images is uploaded (labels stay
//! host slices), and checkpoints download everything.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use autograd::{no_grad, Var};
use models::resnet::{ResNet, ResNetConfig};
use nn::optim::{Optimizer, Schedule, Sgd};
use nn::vision::StateDict;
use nn::Module;
use serde::{Deserialize, Serialize};
use tensor::{Device, Tensor};

use crate::checkpoint::{self, CheckpointMeta};
use crate::data::idx::load_idx_dir;
use crate::data::images::{
    load_cifar100_dir, load_cifar10_dir, load_digits_csv_gz, parse_digits_csv_gz, Augmentation, Cifar100Labels,
    ImageBatch, ImageDataset, ImageLoader, Normalization, Split, BUILTIN_DIGITS_CSV_GZ,
};
use crate::device::ensure_available;
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::run_dir::remove_if_present;
use crate::safetensors_io::atomic_write;
use crate::train::resume::{check_settings, OnChange};
use crate::train::step::finite_update;
use crate::train::{diverged_on_save, Diverged, CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE};

/// The gradient-flow report inside the run directory.
pub const GRAD_NORMS_FILE: &str = "grad_norms.jsonl";
/// The built-in digits file inside `data_dir`.
pub const DIGITS_FILE: &str = "digits.csv.gz";
/// Valid dataset names, listed in errors.
pub const DATASETS: &[&str] = &["digits", "mnist", "fashion-mnist", "cifar10", "cifar100"];
/// Valid schedule names, listed in errors.
pub const IMAGE_SCHEDULES: &[&str] = &["linear", "cosine", "constant"];
/// The schedules end at this fraction of the base rate (CoMT: 0.01 → 1e-4, 0.1 → 1e-3).
pub const END_LR_RATIO: f32 = 0.01;

/// Everything an image training run needs. Serialised into every checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ImageTrainConfig {
    /// ResNet preset: `resnet18`, `resnet34`, `resnet50`, `resnet101`, `resnet152`.
    pub model: String,
    /// `none`, `pixel` or `sliding-window`.
    pub modulator: String,
    /// Pixel modulator hidden width (2, 4 or 8 in the paper).
    pub pixel_hidden: usize,
    /// Sliding-window hidden width `max(1, C_in / sliding_hidden_divisor)` (16, 32, 64).
    pub sliding_hidden_divisor: usize,
    /// Modulator nonlinearity φ: `sigmoid`, `silu`, `relu`.
    pub phi: String,
    /// Modulator range: `double` (2σ) or `unit` (σ).
    pub gate_range: String,
    /// Width of the first stage: 64 in the papers, narrower for fast CPU runs.
    pub base_width: usize,
    /// `cifar` (3×3 stem, no max-pool) or `imagenet` (7×7/2 + max-pool).
    pub stem: String,
    /// `digits` (built in), `mnist`, `fashion-mnist` (IDX files), `cifar10` or `cifar100`
    /// (fine labels).
    pub dataset: String,
    /// Holds `digits.csv.gz`, the four IDX files of MNIST / Fashion-MNIST (plain or `.gz`),
    /// or the extracted `cifar-10-batches-bin` / `cifar-100-binary` files for CIFAR.
    pub data_dir: PathBuf,
    /// Share of the digits held out for evaluation (the last images of the file); the other
    /// datasets evaluate on their official test split.
    pub eval_fraction: f64,
    /// Train on only the first this many training images (0: all), for runs sized to a CPU;
    /// evaluation always uses the whole evaluation split.
    pub train_images: usize,
    /// Random crop (pad 4) and flip; unset means on for CIFAR and Fashion-MNIST, off for
    /// the digits and MNIST (a flipped digit is another glyph).
    pub augment: Option<bool>,
    /// Images per step.
    pub batch_size: usize,
    /// Passes over the training images of the whole run (a resumed run continues up to this count).
    pub epochs: usize,
    /// Base (peak) learning rate: 0.05 by default for the digits; the CoMT CIFAR recipe is 0.01
    /// (batch 64, 100 epochs, linear decay), ImageNet 0.1 (batch 512, cosine, 1 warmup epoch).
    pub lr: f32,
    /// SGD momentum μ (PyTorch's form: `buf ← μ·buf + (g + λ·θ)`, `θ ← θ − lr·buf`).
    pub momentum: f32,
    /// Coupled L2 weight decay (PyTorch SGD); the CoMT recipe uses 0.
    pub weight_decay: f32,
    /// `linear` (decay to 1% of `lr`, the CoMT CIFAR recipe), `cosine` (warmup, then cosine
    /// to 1%, the CoMT ImageNet recipe) or `constant`.
    pub schedule: String,
    /// Linear warmup epochs of the cosine schedule.
    pub warmup_epochs: usize,
    /// Steps between metrics rows (every epoch's last step is always logged).
    pub log_every: usize,
    /// Seeds the initialisation, the shuffling and the augmentation.
    pub seed: u64,
    /// Where the checkpoint, config and metrics are written.
    pub out_dir: PathBuf,
    /// Where the run computes (`--device`); not saved, like [`crate::config::TrainConfig::device`].
    #[serde(skip, default = "crate::device::cpu")]
    pub device: Device,
}

impl Default for ImageTrainConfig {
    /// The built-in default: a narrow ResNet-18 (width 16) on the digits, sized for a CPU.
    fn default() -> Self {
        ImageTrainConfig {
            model: "resnet18".into(),
            modulator: "none".into(),
            pixel_hidden: 2,
            sliding_hidden_divisor: 64,
            phi: "sigmoid".into(),
            gate_range: "double".into(),
            base_width: 16,
            stem: "cifar".into(),
            dataset: "digits".into(),
            data_dir: PathBuf::from("data"),
            eval_fraction: 0.2,
            train_images: 0,
            augment: None,
            batch_size: 64,
            epochs: 10,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            schedule: "linear".into(),
            warmup_epochs: 0,
            log_every: 10,
            seed: 1337,
            out_dir: PathBuf::from("runs/resnet-digits"),
            device: Device::Cpu,
        }
    }
}

impl ImageTrainConfig {
    /// Reads a JSON config file (unknown keys are errors, missing keys take defaults).
    pub fn from_file(path: &Path) -> Result<ImageTrainConfig> {
        crate::config::overlay_config_file(&ImageTrainConfig::default(), path)
    }

    /// The settings a run starts from before flags, as `train`'s
    /// ([`crate::train::resume::base_config`]): with `resume`, the ones saved in the checkpoint
    /// of the run directory (`out_dir`, else the `config_file`'s, else the default) with the
    /// `config_file`'s keys laid over them; without, the `config_file` over the defaults.
    pub fn base(config_file: Option<&Path>, out_dir: Option<&Path>, resume: bool) -> Result<ImageTrainConfig> {
        let defaults = ImageTrainConfig::default();
        let requested = match config_file {
            Some(path) => crate::config::overlay_config_file(&defaults, path)?,
            None => defaults,
        };
        if !resume {
            return Ok(requested);
        }
        let run_dir = out_dir.unwrap_or(&requested.out_dir).to_path_buf();
        let checkpoint_path = run_dir.join(CHECKPOINT_FILE);
        ensure!(
            checkpoint_path.exists(),
            "--resume: no checkpoint at {} (train without --resume to start this run)",
            checkpoint_path.display()
        );
        let json = checkpoint::load_config_json(&checkpoint_path, checkpoint::CheckpointKind::Image)?;
        let saved: ImageTrainConfig = serde_json::from_str(&json)
            .with_context(|| format!("checkpoint {}: its 'train_config' metadata", checkpoint_path.display()))?;
        let mut base = match config_file {
            Some(path) => crate::config::overlay_config_file(&saved, path)?,
            None => saved,
        };
        base.out_dir = run_dir;
        Ok(base)
    }

    /// Checks every field that could fail late, naming the field and the valid values.
    pub fn validate(&self) -> Result<()> {
        let one_of = |field: &str, value: &str, valid: &[&str]| -> Result<()> {
            ensure!(valid.contains(&value), "unknown {field} '{value}'; valid: {}", valid.join(", "));
            Ok(())
        };
        one_of("dataset", &self.dataset, DATASETS)?;
        one_of("schedule", &self.schedule, IMAGE_SCHEDULES)?;
        for (name, value) in [("batch_size", self.batch_size), ("epochs", self.epochs), ("log_every", self.log_every)] {
            ensure!(value > 0, "{name} must be at least 1");
        }
        ensure!(self.lr.is_finite() && self.lr > 0.0, "lr must be a positive number, got {}", self.lr);
        ensure!((0.0..1.0).contains(&self.momentum), "momentum must be in [0, 1), got {}", self.momentum);
        ensure!(
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "weight_decay must be ≥ 0, got {}",
            self.weight_decay
        );
        self.model_config(1, 1)?;
        Ok(())
    }

    /// The ResNet this config asks for, for images of `in_channels` and `num_classes`.
    pub fn model_config(&self, in_channels: usize, num_classes: usize) -> Result<ResNetConfig> {
        let model = ResNetConfig {
            base_width: self.base_width,
            in_channels,
            num_classes,
            stem: self.stem.clone(),
            modulator: self.modulator.clone(),
            pixel_hidden: self.pixel_hidden,
            sliding_hidden_divisor: self.sliding_hidden_divisor,
            phi: self.phi.clone(),
            gate_range: self.gate_range.clone(),
            ..ResNetConfig::preset(&self.model)?
        };
        model.validate()?;
        Ok(model)
    }

    /// The per-step schedule over `total` steps of `steps_per_epoch`.
    pub fn schedule(&self, steps_per_epoch: usize, total: usize) -> Schedule {
        match self.schedule.as_str() {
            "cosine" => {
                Schedule::WarmupCosine { warmup: self.warmup_epochs * steps_per_epoch, total, min_ratio: END_LR_RATIO }
            }
            "constant" => Schedule::Constant,
            _ => Schedule::LinearDecay { total, end_ratio: END_LR_RATIO },
        }
    }

    /// `(train, eval)` datasets as the config names them, the training set cut to
    /// `train_images` when that is set. The digits come from `data_dir` when it holds them,
    /// else, for the default `data_dir`, from the copy built into the binary.
    pub fn datasets(&self) -> Result<(ImageDataset, ImageDataset)> {
        self.load_datasets().with_context(|| {
            format!(
                "loading the {} images from {} (set the folder with --data-dir)",
                self.dataset,
                self.data_dir.display()
            )
        })
    }

    fn load_datasets(&self) -> Result<(ImageDataset, ImageDataset)> {
        let dir = &self.data_dir;
        let digits = dir.join(DIGITS_FILE);
        let builtin_digits = !digits.exists() && *dir == ImageTrainConfig::default().data_dir;
        let (train, eval) = match self.dataset.as_str() {
            "mnist" | "fashion-mnist" => (load_idx_dir(dir, Split::Train)?, load_idx_dir(dir, Split::Test)?),
            "cifar10" => (load_cifar10_dir(dir, Split::Train)?, load_cifar10_dir(dir, Split::Test)?),
            "cifar100" => {
                let load = |split| load_cifar100_dir(dir, split, Cifar100Labels::Fine);
                (load(Split::Train)?, load(Split::Test)?)
            }
            _ if builtin_digits => {
                parse_digits_csv_gz(BUILTIN_DIGITS_CSV_GZ, "the built-in digits")?.split_tail(self.eval_fraction)?
            }
            _ => load_digits_csv_gz(&digits)?.split_tail(self.eval_fraction)?,
        };
        Ok((train.first_images(self.train_images), eval))
    }

    /// The augmentation the run uses: `augment` when set, else on for CIFAR and
    /// Fashion-MNIST, off for the digits and MNIST.
    pub fn augmentation(&self) -> Option<Augmentation> {
        let default = !matches!(self.dataset.as_str(), "digits" | "mnist");
        self.augment.unwrap_or(default).then_some(Augmentation::CIFAR)
    }
}

/// How `train-image --resume` treats a changed setting, as `train`'s
/// [`crate::train::resume::on_change`]: the model, its modulators, the data and its order
/// are refused (the checkpoint's tensors and loader state belong to them); the optimisation
/// and `epochs` (which shapes the schedule) are warned about; bookkeeping is free.
pub fn on_image_change(field: &str) -> Option<OnChange> {
    Some(match field {
        "model"
        | "modulator"
        | "pixel_hidden"
        | "sliding_hidden_divisor"
        | "phi"
        | "gate_range"
        | "base_width"
        | "stem"
        | "dataset"
        | "eval_fraction"
        | "train_images"
        | "augment"
        | "batch_size"
        | "seed" => OnChange::Refuse,
        "data_dir" | "lr" | "momentum" | "weight_decay" | "schedule" | "warmup_epochs" | "epochs" => OnChange::Warn,
        "log_every" | "out_dir" => OnChange::Free,
        _ => return None,
    })
}

/// What a finished run reports.
#[derive(Debug)]
pub struct ImageTrainReport {
    /// Epochs completed in total (a resumed run counts the earlier ones).
    pub epochs: usize,
    /// Optimizer steps completed in total.
    pub steps: usize,
    /// Trainable parameters of the model.
    pub parameters: usize,
    /// Of which modulator parameters.
    pub modulator_parameters: usize,
    /// Training loss of the first step run by this call.
    pub first_loss: f32,
    /// Training loss of the last step run by this call.
    pub final_loss: f32,
    /// Top-1 accuracy on the evaluation split after each epoch run by this call.
    pub eval_accuracy: Vec<f32>,
    /// Mean evaluation loss after the last epoch.
    pub final_eval_loss: f32,
    /// Wall time of this call's training loop, evaluation included.
    pub seconds: f64,
    /// Wall time per epoch run by this call, evaluation included.
    pub seconds_per_epoch: f64,
    /// Training images of this call's epochs over `seconds` (evaluation time included).
    pub images_per_second: f64,
    /// The run's `checkpoint.safetensors`.
    pub checkpoint: PathBuf,
    /// The run's `metrics.jsonl`.
    pub metrics: PathBuf,
    /// The run's `grad_norms.jsonl` (per-parameter gradient norms per epoch).
    pub grad_norms: PathBuf,
}

impl ImageTrainReport {
    /// Accuracy after the last epoch (NaN when this call ran none).
    pub fn final_accuracy(&self) -> f32 {
        self.eval_accuracy.last().copied().unwrap_or(f32::NAN)
    }
}

/// One gradient-flow row of `grad_norms.jsonl`.
#[derive(Serialize)]
struct GradNormRow<'a> {
    epoch: usize,
    step: usize,
    grad_norms: &'a BTreeMap<String, f64>,
}

/// A batch as a constant `[B, C, H, W]` input on `device`.
fn images_of(batch: ImageBatch, device: Device) -> Result<(Var, Vec<u32>)> {
    let shape = [batch.batch_size, batch.channels, batch.height, batch.width];
    Ok((Var::constant(Tensor::from_vec(batch.images, &shape)?.to_device(device)?), batch.labels))
}

/// Correct top-1 predictions of `logits[B, classes]` against `labels`.
fn correct(logits: &Tensor, labels: &[u32]) -> Result<usize> {
    let classes = logits.shape()[1];
    let values = logits.to_host()?.to_vec();
    let argmax = |row: &[f32]| row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
    Ok(values.chunks_exact(classes).zip(labels).filter(|(row, &label)| argmax(row) == label as usize).count())
}

/// Mean loss and top-1 accuracy of `model` (evaluation mode: running statistics) on
/// `dataset`, on the model's device.
pub fn evaluate_images(
    model: &ResNet,
    dataset: &ImageDataset,
    norm: &Normalization,
    batch_size: usize,
) -> Result<(f32, f32)> {
    let (mut loss_sum, mut hits) = (0.0f64, 0usize);
    let device = model.device();
    let indices: Vec<usize> = (0..dataset.len()).collect();
    for chunk in indices.chunks(batch_size.max(1)) {
        let (images, labels) = images_of(dataset.batch(chunk, norm, None)?, device)?;
        let (loss, logits) = no_grad(|| model.loss(&images, &labels, false))?;
        loss_sum += f64::from(loss.value().to_host()?.item()?) * chunk.len() as f64;
        hits += correct(&logits.value(), &labels)?;
    }
    let n = dataset.len().max(1) as f64;
    Ok(((loss_sum / n) as f32, (hits as f64 / n) as f32))
}

/// Appends `row` as one JSON line to `path` and flushes it.
fn append_json_line(path: &Path, row: &impl Serialize) -> Result<()> {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(file, "{}", serde_json::to_string(row)?).with_context(|| format!("writing {}", path.display()))
}

/// Adds each parameter's gradient L2 norm to `sums` (in optimizer order; GPU gradients are
/// downloaded).
fn add_grad_norms(optimizer: &dyn Optimizer, sums: &mut [f64]) -> Result<()> {
    for (sum, p) in sums.iter_mut().zip(optimizer.parameters()) {
        if let Some(g) = p.var.grad() {
            *sum += g.to_host()?.to_vec().iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
        }
    }
    Ok(())
}

/// Trains as `config` says; with `resume`, continues from the run directory's checkpoint
/// (same weights, running statistics, momentum, data position and step: the losses
/// continue exactly).
pub fn train_image(config: &ImageTrainConfig, resume: bool) -> Result<ImageTrainReport> {
    // Declared first, so it runs last: the run's buffers are freed, not kept for shapes
    // that will not come again.
    let _release_pool = tensor::pool::ReleaseOnDrop;
    if let Some(world) = crate::dist::World::from_env()? {
        anyhow::bail!(
            "train-image does not train data parallel yet (launched as rank {} of {}): batch norm's running \
             statistics would drift apart across ranks; run it as one process",
            world.rank,
            world.world_size
        );
    }
    config.validate()?;
    let what = format!("{} of width {}", config.model, config.base_width);
    let parameters = crate::memory::resnet_parameters(config.base_width);
    crate::memory::check_fits(&what, parameters, crate::memory::SGD_BYTES_PER_PARAMETER, 0.0)?;
    ensure_available(config.device)?;
    std::fs::create_dir_all(&config.out_dir).with_context(|| format!("creating {}", config.out_dir.display()))?;
    let checkpoint_path = config.out_dir.join(CHECKPOINT_FILE);
    let grad_norms_path = config.out_dir.join(GRAD_NORMS_FILE);
    let (train_set, eval_set) = config.datasets()?;
    let norm = Normalization::from_dataset(&train_set);
    let model_config = config.model_config(train_set.channels(), train_set.num_classes())?;
    let model = ResNet::new(&model_config, config.seed)?;
    let mut optimizer = Sgd::new(model.named_parameters(), config.momentum, config.weight_decay, false);
    let augment = config.augmentation();
    let mut loader = ImageLoader::new(train_set.clone(), config.batch_size, norm.clone(), augment, config.seed)?;
    let steps_per_epoch = (train_set.len() / config.batch_size).max(1);
    let total_steps = config.epochs * steps_per_epoch;
    let mut start_step = 0;
    if resume {
        let saved = checkpoint::load(&checkpoint_path)?;
        checkpoint::ensure_kind(&checkpoint_path, &saved.train_config, checkpoint::CheckpointKind::Image)?;
        let saved_config: ImageTrainConfig = serde_json::from_str(&saved.train_config)
            .with_context(|| format!("checkpoint {}: its 'train_config' metadata", checkpoint_path.display()))?;
        for warning in check_settings(&saved_config, config, on_image_change)? {
            eprintln!("warning: {warning}");
        }
        checkpoint::load_weights(&StateDict(&model), &saved.weights)?;
        optimizer.load_state(&saved.optimizer_state)?;
        loader.import_state(&saved.sampler_state)?;
        start_step = saved.step;
        ensure!(
            start_step % steps_per_epoch == 0,
            "checkpoint step {start_step} is not an epoch boundary of {steps_per_epoch} steps: \
             the batch size or dataset changed since it was written"
        );
        crate::say!("resumed from {} at step {start_step}", checkpoint_path.display());
    }
    StateDict(&model).to_device(config.device)?;
    if !resume {
        // A new run replaces the directory's old one, as in `train`.
        remove_if_present(&checkpoint_path)?;
        remove_if_present(&grad_norms_path)?;
    }
    let train_json = serde_json::to_string_pretty(config)?;
    let model_json = serde_json::to_string_pretty(&model_config)?;
    atomic_write(&config.out_dir.join(CONFIG_FILE), train_json.as_bytes())?;
    let metrics_path = config.out_dir.join(METRICS_FILE);
    let mut metrics = if resume {
        MetricsWriter::resume_at(&metrics_path, start_step)?
    } else {
        MetricsWriter::create(&metrics_path)?
    };
    crate::say!(
        "training {} ({} modulator, width {}) with {} parameters ({} in modulators) on {}: {} train / {} eval \
         images, {} epochs of {} steps, batch {}, SGD lr {} ({}), momentum {}, weight decay {}",
        config.model,
        config.modulator,
        config.base_width,
        model.num_parameters(),
        model.modulator_parameters(),
        config.dataset,
        train_set.len(),
        eval_set.len(),
        config.epochs,
        steps_per_epoch,
        config.batch_size,
        config.lr,
        config.schedule,
        config.momentum,
        config.weight_decay
    );

    let schedule = config.schedule(steps_per_epoch, total_steps);
    let started = Instant::now();
    let (mut first_loss, mut last_loss, mut last_eval_loss) = (None, f32::NAN, f32::NAN);
    let mut eval_accuracy = Vec::new();
    let names: Vec<String> = optimizer.parameters().iter().map(|p| p.name.clone()).collect();
    for epoch in start_step / steps_per_epoch..config.epochs {
        let epoch_started = Instant::now();
        let mut window_start = (Instant::now(), epoch * steps_per_epoch);
        let mut norm_sums = vec![0.0f64; names.len()];
        let (mut train_hits, mut train_seen) = (0usize, 0usize);
        for step in epoch * steps_per_epoch..(epoch + 1) * steps_per_epoch {
            let lr = schedule.lr_at(step, config.lr);
            let (images, labels) = images_of(loader.next_batch()?, config.device)?;
            let (loss, logits) = model.loss(&images, &labels, true)?;
            let value = loss.value().to_host()?.item()?;
            let diverged = |quantity: &str, value| Diverged {
                quantity: quantity.into(),
                value,
                step: step + 1,
                checkpoint: checkpoint_path.clone(),
            };
            if !value.is_finite() {
                return Err(diverged("loss", value).into());
            }
            loss.backward()?;
            add_grad_norms(&optimizer, &mut norm_sums)?;
            // `train`'s rule: no update unless the loss and the gradient norm are finite.
            let grad_norm = match finite_update(&mut optimizer, value, 0.0, lr)? {
                Ok(outcome) => outcome.grad_norm,
                Err(bad) => return Err(diverged(bad.quantity, bad.value).into()),
            };
            first_loss.get_or_insert(value);
            last_loss = value;
            train_hits += correct(&logits.value(), &labels)?;
            train_seen += labels.len();

            let done = step + 1;
            let epoch_end = done % steps_per_epoch == 0;
            if done % config.log_every != 0 && !epoch_end {
                continue;
            }
            let elapsed = window_start.0.elapsed().as_secs_f64().max(1e-9);
            let images_per_second = ((done - window_start.1) * config.batch_size) as f64 / elapsed;
            window_start = (Instant::now(), done);
            let mut row = StepMetrics {
                step: done,
                loss: value,
                lr,
                grad_norm,
                tokens_per_second: images_per_second as f32,
                ..StepMetrics::default()
            };
            if epoch_end {
                let (eval_loss, accuracy) = evaluate_images(&model, &eval_set, &norm, config.batch_size)?;
                if !eval_loss.is_finite() {
                    return Err(diverged("validation loss", eval_loss).into());
                }
                (row.val_loss, row.val_accuracy) = (Some(eval_loss), Some(accuracy));
                last_eval_loss = eval_loss;
                eval_accuracy.push(accuracy);
            }
            metrics.write(&row)?;
        }

        let done = (epoch + 1) * steps_per_epoch;
        let means: BTreeMap<String, f64> =
            names.iter().cloned().zip(norm_sums.iter().map(|s| s / steps_per_epoch as f64)).collect();
        append_json_line(&grad_norms_path, &GradNormRow { epoch: epoch + 1, step: done, grad_norms: &means })?;
        let meta = CheckpointMeta {
            step: done,
            sampler_state: &loader.export_state(),
            train_config: &train_json,
            model_config: &model_json,
        };
        checkpoint::save(&checkpoint_path, &StateDict(&model), &optimizer, &meta)
            .map_err(|e| diverged_on_save(e, done, &checkpoint_path))?;
        crate::say!(
            "epoch {:>3}/{} | loss {last_loss:.4} | train acc {:.2}% | eval loss {last_eval_loss:.4} | eval acc {:.2}% | {:.1}s",
            epoch + 1,
            config.epochs,
            100.0 * train_hits as f64 / train_seen.max(1) as f64,
            100.0 * eval_accuracy.last().copied().unwrap_or(f32::NAN),
            epoch_started.elapsed().as_secs_f64()
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    let epochs_run = eval_accuracy.len();
    Ok(ImageTrainReport {
        epochs: config.epochs,
        steps: total_steps,
        parameters: model.num_parameters(),
        modulator_parameters: model.modulator_parameters(),
        first_loss: first_loss.unwrap_or(f32::NAN),
        final_loss: last_loss,
        eval_accuracy,
        final_eval_loss: last_eval_loss,
        seconds,
        seconds_per_epoch: seconds / epochs_run.max(1) as f64,
        images_per_second: (epochs_run * steps_per_epoch * config.batch_size) as f64 / seconds.max(1e-9),
        checkpoint: checkpoint_path,
        metrics: metrics.path().to_path_buf(),
        grad_norms: grad_norms_path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        assert!(ImageTrainConfig::default().validate().is_ok());
        let bad = ImageTrainConfig { dataset: "svhn".into(), ..ImageTrainConfig::default() };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("svhn") && msg.contains("fashion-mnist") && msg.contains("cifar100"), "{msg}");
        let bad = ImageTrainConfig { model: "resnet20".into(), ..ImageTrainConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("resnet152"));
        let bad = ImageTrainConfig { modulator: "channel".into(), ..ImageTrainConfig::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("sliding-window"));
        assert!(ImageTrainConfig { epochs: 0, ..ImageTrainConfig::default() }.validate().is_err());
    }

    #[test]
    fn every_setting_has_a_resume_rule() {
        let fields = serde_json::to_value(ImageTrainConfig::default()).unwrap();
        for field in fields.as_object().unwrap().keys() {
            assert!(on_image_change(field).is_some(), "`{field}` has no rule in on_image_change");
        }
    }

    #[test]
    fn schedules_end_at_one_percent() {
        let config = ImageTrainConfig { lr: 0.1, ..ImageTrainConfig::default() };
        let linear = config.schedule(10, 100);
        assert!((linear.lr_at(100, config.lr) - 0.001).abs() < 1e-7);
        let cosine =
            ImageTrainConfig { schedule: "cosine".into(), warmup_epochs: 1, ..config.clone() }.schedule(10, 100);
        assert!((cosine.lr_at(9, config.lr) - 0.1).abs() < 1e-6);
        assert!((cosine.lr_at(100, config.lr) - 0.001).abs() < 1e-6);
    }

    #[test]
    fn top1_counts_argmax_hits() {
        let logits = Tensor::from_vec(vec![0.1, 0.9, 0.0, 2.0, -1.0, 1.0], &[2, 3]).unwrap();
        assert_eq!(correct(&logits, &[1, 2]).unwrap(), 1);
    }
}
