//! Datasets: token files and their batch samplers for language models, image datasets for
//! the ResNet path. See SPEC §8 for the formats.
//!
//! - [`token_file`]: nanoGPT raw and llm.c token files, memory-mapped; writers.
//! - [`sampler`]: `[B, T+1]` windows → inputs/targets, random (seeded) or sequential.
//! - [`images`]: UCI digits, CIFAR-10/100, normalisation, augmentation, shuffled loading.
//! - [`idx`]: MNIST and Fashion-MNIST IDX files (plain or gzipped).

pub mod idx;
pub mod images;
pub mod sampler;
pub mod token_file;
pub mod token_sink;

pub use idx::{load_idx, load_idx_dir};
pub use images::{
    load_cifar10, load_cifar100, load_cifar100_dir, load_cifar10_dir, load_digits_csv_gz, Augmentation, Cifar100Labels,
    ImageBatch, ImageDataset, ImageLoader, Normalization, Split,
};
pub use sampler::{BatchSampler, RandomSampler, SequentialSampler, Shard, SplitMix64, TokenBatch};
pub use token_file::{check_vocab, write_llmc, write_nanogpt_raw, DataFormat, TokenFile, TokenFormat};
