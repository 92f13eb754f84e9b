//! trainer: the `transponder` command's library — datasets, tokenizers, checkpoints, the
//! training loop, metrics, sampling and export.

pub mod analyze;
pub mod atomic;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod console;
pub mod data;
pub mod device;
pub mod dir_lock;
pub mod dist;
pub mod export;
pub mod fingerprint;
pub mod generate;
pub mod gpu_counters;
pub mod memory;
pub mod metrics;
pub mod model_fit;
pub mod prepare;
pub mod regular_file;
pub mod run_dir;
pub mod safetensors_io;
pub mod threads;
pub mod tokenizer;
pub mod train;
pub mod train_image;
