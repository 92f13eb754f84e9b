//! Image classification datasets for the ResNet path: UCI digits, CIFAR-10 and CIFAR-100.
//!
//! Legend: `N` images, `B` batch, `C` channels, `H` height, `W` width. Pixels are kept as the
//! files store them (`u8`, 0..=`pixel_max`) — CIFAR by memory map, digits in memory — and
//! become `f32` only when a batch `[B, C, H, W]` is written: scaled to `[0, 1]`, optionally
//! augmented, then normalised per channel, `(x - mean[c]) / std[c]` (torchvision's
//! `ToTensor` → `RandomCrop(padding)` → `RandomHorizontalFlip` → `Normalize`; padding is black
//! before normalisation, as there).
//!
//! Formats:
//! - digits (`digits.csv.gz`, UCI Optical Recognition of Handwritten Digits): gzip CSV, one
//!   image per line, 64 pixel values 0..=16 (8×8, row-major) then the label 0..=9.
//! - CIFAR-10 (`data_batch_{1..5}.bin`, `test_batch.bin`): rows of 1 label byte + 3072 pixel
//!   bytes (1024 R, 1024 G, 1024 B, each 32×32 row-major).
//! - CIFAR-100 (`train.bin`, `test.bin`): rows of coarse label, fine label, 3072 pixel bytes.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use flate2::read::GzDecoder;
use memmap2::Mmap;

use super::sampler::SplitMix64;

/// Side of a digits image.
pub const DIGITS_SIDE: usize = 8;
/// Largest digits pixel value (4×4 blocks of 32×32 bitmaps: counts 0..=16).
pub const DIGITS_PIXEL_MAX: u8 = 16;
/// Digits classes 0..=9.
pub const DIGITS_CLASSES: usize = 10;
/// Largest digits label.
const DIGITS_MAX_LABEL: u8 = DIGITS_CLASSES as u8 - 1;
/// Side of a CIFAR image.
pub const CIFAR_SIDE: usize = 32;
/// CIFAR channels (RGB planes).
pub const CIFAR_CHANNELS: usize = 3;
/// Pixel bytes of one CIFAR image.
pub const CIFAR_IMAGE_BYTES: usize = CIFAR_CHANNELS * CIFAR_SIDE * CIFAR_SIDE;
/// Largest CIFAR pixel value.
pub const CIFAR_PIXEL_MAX: u8 = u8::MAX;
/// Smallest standard deviation used for normalisation: constant channels are only centred.
const MIN_STD: f32 = 1e-6;

/// Which dataset split a directory loader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training files.
    Train,
    /// The test files.
    Test,
}

/// Which CIFAR-100 label a dataset uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cifar100Labels {
    /// The 20 superclasses (first label byte).
    Coarse,
    /// The 100 classes (second label byte).
    Fine,
}

/// One memory-mapped file: `header_bytes`, then rows of `label_bytes` + one image (CIFAR:
/// no header, 1 or 2 label bytes; an IDX image file: its header, no label bytes).
#[derive(Debug)]
struct MappedRows {
    map: Mmap,
    header_bytes: usize,
    label_bytes: usize,
}

/// Where the pixel bytes live.
#[derive(Debug)]
enum PixelSource {
    /// `N × image_len` bytes in memory.
    Owned(Vec<u8>),
    /// Rows spread over files; `starts[k]` is the index of file `k`'s first image.
    Mapped { files: Vec<MappedRows>, starts: Vec<usize> },
}

/// The pixel bytes of a greyscale file, for [`ImageDataset::greyscale`].
#[derive(Debug)]
pub(super) enum GreyPixels {
    /// `N × H × W` bytes in memory (a decompressed file).
    Owned(Vec<u8>),
    /// A mapped plain file whose images follow `header_bytes` of header.
    Mapped { map: Mmap, header_bytes: usize },
}

/// A labelled image dataset; cheap to clone (pixels are shared).
#[derive(Debug, Clone)]
pub struct ImageDataset {
    source: Arc<PixelSource>,
    /// Index in `source` of this dataset's image 0 (non-zero for a split's tail).
    first: usize,
    labels: Vec<u32>,
    channels: usize,
    height: usize,
    width: usize,
    num_classes: usize,
    pixel_max: u8,
}

impl ImageDataset {
    /// Number of images `N`.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no images (never for a loaded file; possible only for a split).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Channels `C`.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Height `H`.
    pub fn height(&self) -> usize {
        self.height
    }

    /// Width `W`.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Values per image, `C * H * W`.
    pub fn image_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// Number of classes: every label is below it.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// All labels, in image order.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// The raw pixel bytes of image `i` (`[C, H, W]`, 0..=pixel_max), or `None` past the end.
    pub fn pixels(&self, i: usize) -> Option<&[u8]> {
        if i >= self.len() {
            return None;
        }
        let n = self.image_len();
        let global = self.first + i;
        match &*self.source {
            PixelSource::Owned(bytes) => bytes.get(global * n..(global + 1) * n),
            PixelSource::Mapped { files, starts } => {
                let k = starts.partition_point(|&s| s <= global).checked_sub(1)?;
                let rows = files.get(k)?;
                let row_bytes = rows.label_bytes + n;
                let at = rows.header_bytes + (global - starts[k]) * row_bytes + rows.label_bytes;
                rows.map.get(at..at + n)
            }
        }
    }

    /// The first `n` images (all of them when `n` is 0 or at least [`ImageDataset::len`]):
    /// a training subset that keeps file order.
    pub fn first_images(&self, n: usize) -> ImageDataset {
        let mut head = self.clone();
        if n > 0 {
            head.labels.truncate(n);
        }
        head
    }

    /// A one-channel dataset of `height × width` images with pixels 0..=255 (the IDX files
    /// of MNIST and Fashion-MNIST), its pixels in memory or mapped behind a file header.
    pub(super) fn greyscale(
        pixels: GreyPixels,
        labels: Vec<u32>,
        height: usize,
        width: usize,
        num_classes: usize,
    ) -> ImageDataset {
        let source = match pixels {
            GreyPixels::Owned(bytes) => PixelSource::Owned(bytes),
            GreyPixels::Mapped { map, header_bytes } => {
                PixelSource::Mapped { files: vec![MappedRows { map, header_bytes, label_bytes: 0 }], starts: vec![0] }
            }
        };
        ImageDataset {
            source: Arc::new(source),
            first: 0,
            labels,
            channels: 1,
            height,
            width,
            num_classes,
            pixel_max: u8::MAX,
        }
    }

    /// Splits off the last `eval_fraction` of the images (rounded) as an evaluation set,
    /// keeping file order: deterministic, no shuffling. Errors when either part is empty.
    pub fn split_tail(&self, eval_fraction: f64) -> Result<(ImageDataset, ImageDataset)> {
        ensure!(
            eval_fraction.is_finite() && eval_fraction > 0.0 && eval_fraction < 1.0,
            "evaluation fraction must be strictly between 0 and 1, got {eval_fraction}"
        );
        let n_eval = (self.len() as f64 * eval_fraction).round() as usize;
        let n_train = self.len() - n_eval;
        ensure!(
            n_eval > 0 && n_train > 0,
            "splitting {} images with evaluation fraction {eval_fraction} leaves an empty part",
            self.len()
        );
        let mut train = self.clone();
        train.labels.truncate(n_train);
        let mut eval = self.clone();
        eval.labels = self.labels[n_train..].to_vec();
        eval.first = self.first + n_train;
        Ok((train, eval))
    }

    /// Writes images `indices` as a batch, see [`ImageBatch`]; `augment` applies random crop
    /// and flip drawn from the given generator. Errors on an index past the end.
    pub fn batch(
        &self,
        indices: &[usize],
        norm: &Normalization,
        mut augment: Option<(&Augmentation, &mut SplitMix64)>,
    ) -> Result<ImageBatch> {
        ensure!(
            norm.mean.len() == self.channels && norm.std.len() == self.channels,
            "normalisation has {} means and {} standard deviations, images have {} channels",
            norm.mean.len(),
            norm.std.len(),
            self.channels
        );
        ensure!(
            norm.std.iter().all(|s| s.is_finite() && *s > 0.0),
            "normalisation standard deviations must be positive and finite, got {:?}",
            norm.std
        );
        let n = self.image_len();
        let mut images = vec![0f32; indices.len() * n];
        let mut labels = Vec::with_capacity(indices.len());
        for (&i, out) in indices.iter().zip(images.chunks_exact_mut(n)) {
            let Some(pixels) = self.pixels(i) else {
                bail!("image index {i} is past the end of the dataset ({} images)", self.len());
            };
            let crop = match augment.as_mut() {
                Some((aug, rng)) => aug.draw(rng),
                None => Crop::IDENTITY,
            };
            self.write_image(pixels, crop, norm, out);
            labels.push(self.labels[i]);
        }
        Ok(ImageBatch {
            images,
            labels,
            batch_size: indices.len(),
            channels: self.channels,
            height: self.height,
            width: self.width,
        })
    }

    /// `out[c][y][x] = (src[c](y + dy, xs + dx) / pixel_max - mean[c]) / std[c]`, with
    /// `dy, dx ∈ -pad..=pad`, `xs = W-1-x` when flipped, `x` otherwise, and `src` 0 outside
    /// the image (the zero padding).
    fn write_image(&self, pixels: &[u8], crop: Crop, norm: &Normalization, out: &mut [f32]) {
        let (h, w) = (self.height as isize, self.width as isize);
        let scale = 1.0 / f32::from(self.pixel_max);
        for c in 0..self.channels {
            let plane = &pixels[c * self.height * self.width..(c + 1) * self.height * self.width];
            let (mean, inv_std) = (norm.mean[c], 1.0 / norm.std[c]);
            for y in 0..h {
                let sy = y + crop.dy;
                for x in 0..w {
                    let xs = if crop.flip { w - 1 - x } else { x };
                    let sx = xs + crop.dx;
                    let raw = if (0..h).contains(&sy) && (0..w).contains(&sx) {
                        f32::from(plane[(sy * w + sx) as usize]) * scale
                    } else {
                        0.0
                    };
                    out[(c * self.height + y as usize) * self.width + x as usize] = (raw - mean) * inv_std;
                }
            }
        }
    }
}

/// A batch of images `[B, C, H, W]` (row-major `f32`, normalised) and their labels `[B]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageBatch {
    /// `B * C * H * W` values.
    pub images: Vec<f32>,
    /// `B` labels.
    pub labels: Vec<u32>,
    /// `B`.
    pub batch_size: usize,
    /// `C`.
    pub channels: usize,
    /// `H`.
    pub height: usize,
    /// `W`.
    pub width: usize,
}

/// Per-channel normalisation `(x - mean[c]) / std[c]` of `[0, 1]`-scaled pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalization {
    /// Mean per channel.
    pub mean: Vec<f32>,
    /// Standard deviation per channel (floored at 1e-6).
    pub std: Vec<f32>,
}

impl Normalization {
    /// No change: mean 0, std 1 for each of `channels`.
    pub fn identity(channels: usize) -> Normalization {
        Normalization { mean: vec![0.0; channels], std: vec![1.0; channels] }
    }

    /// The per-channel mean and (population) standard deviation of `dataset`, in `[0, 1]`
    /// pixel units; compute it on the training split and reuse it for evaluation.
    pub fn from_dataset(dataset: &ImageDataset) -> Normalization {
        let (c, plane) = (dataset.channels, dataset.height * dataset.width);
        let mut sum = vec![0f64; c];
        let mut sum_sq = vec![0f64; c];
        for i in 0..dataset.len() {
            let Some(pixels) = dataset.pixels(i) else { break };
            for (ch, values) in pixels.chunks_exact(plane).enumerate() {
                for &p in values {
                    let v = f64::from(p);
                    sum[ch] += v;
                    sum_sq[ch] += v * v;
                }
            }
        }
        let count = (dataset.len() * plane).max(1) as f64;
        let max = f64::from(dataset.pixel_max);
        let mean: Vec<f64> = sum.iter().map(|s| s / count).collect();
        let std = sum_sq
            .iter()
            .zip(&mean)
            .map(|(sq, m)| (((sq / count) - m * m).max(0.0).sqrt() / max) as f32)
            .map(|s| s.max(MIN_STD))
            .collect();
        Normalization { mean: mean.iter().map(|m| (m / max) as f32).collect(), std }
    }
}

/// Random-crop-with-padding and horizontal-flip augmentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Augmentation {
    /// Zero padding on each side before a crop back to `H × W` (0 disables cropping).
    pub pad: usize,
    /// Flip horizontally with probability 1/2.
    pub flip: bool,
}

impl Augmentation {
    /// The standard CIFAR recipe: pad 4, random 32×32 crop, random flip.
    pub const CIFAR: Augmentation = Augmentation { pad: 4, flip: true };

    /// Draws one image's crop offset (`dy`, `dx` uniform in `0..=2*pad`) then its flip.
    fn draw(&self, rng: &mut SplitMix64) -> Crop {
        let span = 2 * self.pad as u64 + 1;
        let pad = self.pad as isize;
        let dy = rng.below(span) as isize - pad;
        let dx = rng.below(span) as isize - pad;
        let flip = self.flip && rng.next_u64() & 1 == 1;
        Crop { dy, dx, flip }
    }
}

/// One image's augmentation: source offsets in `-pad..=pad` (crop offset minus padding) and flip.
#[derive(Debug, Clone, Copy)]
struct Crop {
    dy: isize,
    dx: isize,
    flip: bool,
}

impl Crop {
    const IDENTITY: Crop = Crop { dy: 0, dx: 0, flip: false };
}

/// The built-in digits, `data/digits.csv.gz` compiled into the binary, so that
/// `train-image` works from any directory and after `cargo install`.
pub const BUILTIN_DIGITS_CSV_GZ: &[u8] = include_bytes!("../../../data/digits.csv.gz");

/// Loads the UCI digits (gzip CSV) as 1×8×8 images scaled from 0..=16, 10 classes.
/// Errors name the file and line of any malformed row.
pub fn load_digits_csv_gz(path: &Path) -> Result<ImageDataset> {
    let file = File::open(path).with_context(|| format!("opening digits file {}", path.display()))?;
    parse_digits_csv_gz(file, &path.display().to_string())
}

/// [`load_digits_csv_gz`] of gzip bytes from `gz`; `source` names them in errors.
pub fn parse_digits_csv_gz(gz: impl Read, source: &str) -> Result<ImageDataset> {
    let reader = BufReader::new(GzDecoder::new(gz));
    let pixels_per_image = DIGITS_SIDE * DIGITS_SIDE;
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line_no = n + 1;
        let line = line.with_context(|| format!("reading {} line {line_no} (not gzip, or truncated?)", source))?;
        if line.trim().is_empty() {
            continue;
        }
        let values: Vec<&str> = line.trim().split(',').collect();
        ensure!(
            values.len() == pixels_per_image + 1,
            "{} line {line_no}: {} values, expected {} pixels and a label",
            source,
            values.len(),
            pixels_per_image
        );
        for (k, v) in values.iter().enumerate() {
            let parsed = v.trim().parse::<u8>().ok();
            let limit = if k < pixels_per_image { DIGITS_PIXEL_MAX } else { DIGITS_MAX_LABEL };
            let Some(value) = parsed.filter(|&p| p <= limit) else {
                bail!("{} line {line_no}, field {}: `{v}` is not an integer in 0..={limit}", source, k + 1);
            };
            if k < pixels_per_image {
                pixels.push(value);
            } else {
                labels.push(u32::from(value));
            }
        }
    }
    ensure!(!labels.is_empty(), "digits file {source} holds no images");
    Ok(ImageDataset {
        source: Arc::new(PixelSource::Owned(pixels)),
        first: 0,
        labels,
        channels: 1,
        height: DIGITS_SIDE,
        width: DIGITS_SIDE,
        num_classes: DIGITS_CLASSES,
        pixel_max: DIGITS_PIXEL_MAX,
    })
}

/// Loads CIFAR-10 binary files (rows of label + 3072 bytes) as one dataset, in the order
/// given. Errors on a missing or empty file, a length not a multiple of 3073, or a label ≥ 10.
pub fn load_cifar10(files: &[PathBuf]) -> Result<ImageDataset> {
    load_cifar(files, 1, 0, 10)
}

/// Loads a CIFAR-100 binary file (rows of coarse label, fine label, 3072 bytes) with the
/// chosen labels: 20 coarse classes or 100 fine ones.
pub fn load_cifar100(file: &Path, labels: Cifar100Labels) -> Result<ImageDataset> {
    let (slot, classes) = match labels {
        Cifar100Labels::Coarse => (0, 20),
        Cifar100Labels::Fine => (1, 100),
    };
    load_cifar(&[file.to_path_buf()], 2, slot, classes)
}

/// Loads CIFAR-10 from the official `cifar-10-batches-bin` directory: `data_batch_*.bin`
/// (in numeric order) for [`Split::Train`], `test_batch.bin` for [`Split::Test`].
pub fn load_cifar10_dir(dir: &Path, split: Split) -> Result<ImageDataset> {
    let files = match split {
        Split::Test => vec![dir.join("test_batch.bin")],
        Split::Train => {
            let entries =
                std::fs::read_dir(dir).with_context(|| format!("listing CIFAR-10 directory {}", dir.display()))?;
            let mut numbered = Vec::new();
            for entry in entries {
                let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let number = name
                    .strip_prefix("data_batch_")
                    .and_then(|rest| rest.strip_suffix(".bin"))
                    .and_then(|n| n.parse::<u32>().ok());
                if let Some(number) = number {
                    numbered.push((number, entry.path()));
                }
            }
            ensure!(!numbered.is_empty(), "no CIFAR-10 training files (data_batch_*.bin) in {}", dir.display());
            numbered.sort();
            numbered.into_iter().map(|(_, p)| p).collect()
        }
    };
    load_cifar10(&files)
}

/// Loads CIFAR-100 from the official `cifar-100-binary` directory: `train.bin` or `test.bin`.
pub fn load_cifar100_dir(dir: &Path, split: Split, labels: Cifar100Labels) -> Result<ImageDataset> {
    let name = match split {
        Split::Train => "train.bin",
        Split::Test => "test.bin",
    };
    load_cifar100(&dir.join(name), labels)
}

/// Maps `files` whose rows are `label_bytes` label bytes + one image, taking the label from
/// byte `label_slot` and checking it against `num_classes`.
fn load_cifar(files: &[PathBuf], label_bytes: usize, label_slot: usize, num_classes: usize) -> Result<ImageDataset> {
    ensure!(!files.is_empty(), "no CIFAR files given");
    let row_bytes = label_bytes + CIFAR_IMAGE_BYTES;
    let mut mapped = Vec::with_capacity(files.len());
    let mut starts = Vec::with_capacity(files.len());
    let mut labels = Vec::new();
    for path in files {
        let file = File::open(path).with_context(|| format!("opening CIFAR file {}", path.display()))?;
        let size = file.metadata().with_context(|| format!("reading the size of {}", path.display()))?.len() as usize;
        ensure!(size > 0, "CIFAR file {} is empty", path.display());
        ensure!(
            size.is_multiple_of(row_bytes),
            "CIFAR file {} has {size} bytes, not a whole number of {row_bytes}-byte rows \
             ({label_bytes} label byte(s) + {CIFAR_IMAGE_BYTES} pixels): truncated, or the \
             wrong CIFAR version?",
            path.display()
        );
        // SAFETY: read-only map of a dataset file that nothing writes while we train.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
        let rows = size / row_bytes;
        for (r, row) in map.chunks_exact(row_bytes).enumerate() {
            let label = row[label_slot];
            ensure!(
                usize::from(label) < num_classes,
                "CIFAR file {} row {r}: label {label} is not below {num_classes} classes",
                path.display()
            );
            labels.push(u32::from(label));
        }
        starts.push(labels.len() - rows);
        mapped.push(MappedRows { map, header_bytes: 0, label_bytes });
    }
    Ok(ImageDataset {
        source: Arc::new(PixelSource::Mapped { files: mapped, starts }),
        first: 0,
        labels,
        channels: CIFAR_CHANNELS,
        height: CIFAR_SIDE,
        width: CIFAR_SIDE,
        num_classes,
        pixel_max: CIFAR_PIXEL_MAX,
    })
}

/// Endless shuffled batches over a dataset for training: a fresh permutation per epoch
/// (derived from the seed and the epoch number), batches that run across epoch boundaries,
/// and augmentation from its own generator. The state is three `u64`s for exact resume.
#[derive(Debug)]
pub struct ImageLoader {
    dataset: ImageDataset,
    batch_size: usize,
    norm: Normalization,
    augmentation: Option<Augmentation>,
    seed: u64,
    epoch: u64,
    position: usize,
    order: Vec<usize>,
    augment_rng: SplitMix64,
}

impl ImageLoader {
    /// A loader of `batch_size` images from `dataset`, normalised by `norm`, augmented when
    /// `augmentation` is set, shuffled and augmented from `seed`.
    pub fn new(
        dataset: ImageDataset,
        batch_size: usize,
        norm: Normalization,
        augmentation: Option<Augmentation>,
        seed: u64,
    ) -> Result<ImageLoader> {
        ensure!(batch_size >= 1, "batch size must be at least 1");
        ensure!(!dataset.is_empty(), "cannot load batches from an empty dataset");
        let order = epoch_order(dataset.len(), seed, 0);
        Ok(ImageLoader {
            dataset,
            batch_size,
            norm,
            augmentation,
            seed,
            epoch: 0,
            position: 0,
            order,
            augment_rng: SplitMix64::new(!seed),
        })
    }

    /// Completed passes over the dataset.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The next `[B, C, H, W]` batch.
    pub fn next_batch(&mut self) -> Result<ImageBatch> {
        let mut indices = Vec::with_capacity(self.batch_size);
        while indices.len() < self.batch_size {
            if self.position == self.order.len() {
                self.epoch += 1;
                self.position = 0;
                self.order = epoch_order(self.dataset.len(), self.seed, self.epoch);
            }
            indices.push(self.order[self.position]);
            self.position += 1;
        }
        let augment = self.augmentation.as_ref().map(|a| (a, &mut self.augment_rng));
        self.dataset.batch(&indices, &self.norm, augment)
    }

    /// `[epoch, position in the epoch, augmentation generator state]`.
    pub fn export_state(&self) -> Vec<u64> {
        vec![self.epoch, self.position as u64, self.augment_rng.state()]
    }

    /// Resumes from [`ImageLoader::export_state`]'s output (same dataset and seed).
    pub fn import_state(&mut self, state: &[u64]) -> Result<()> {
        let &[epoch, position, rng] = state else {
            bail!("image loader state must be 3 values, got {}", state.len());
        };
        let position = usize::try_from(position).ok().filter(|&p| p <= self.dataset.len());
        let Some(position) = position else {
            bail!("image loader position {} is past the dataset's {} images", state[1], self.dataset.len());
        };
        self.epoch = epoch;
        self.position = position;
        self.order = epoch_order(self.dataset.len(), self.seed, epoch);
        self.augment_rng = SplitMix64::from_state(rng);
        Ok(())
    }
}

/// The permutation of `0..n` for `epoch`: Fisher-Yates driven by a generator whose seed mixes
/// `seed` and `epoch` through SplitMix64 (so epochs are decorrelated, not shifted streams).
fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mixed = SplitMix64::new(SplitMix64::new(seed).next_u64() ^ epoch).next_u64();
    let mut rng = SplitMix64::new(mixed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}
