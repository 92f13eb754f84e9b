//! The CUDA backend (feature `cuda`): the CPU kernels' operations on device buffers.
//!
//! ```text
//! device.rs      CudaDevice: context, one stream, cuBLAS, copies; errors, not panics, without a GPU
//! allocator.rs   DeviceBuffer<T> and the caching allocator (free lists per size class)
//! counters.rs    per-device counts of launches, products by precision, syncs, copies, bytes
//! staging.rs     the pinned (page-locked) staging ring every host → device copy goes through
//! timer.rs       the per-kernel timer (a CUDA event pair around each launch)
//! graph.rs       CUDA graphs: a step captured once (its own memory pool), replayed per step
//! module.rs      kernel families and launch arguments; NVRTC compilation of kernels/*.cu, cached
//! nvrtc.rs       one NVRTC compile to CUBIN (or PTX), with the log on failure
//! blas.rs        row-major cuBLAS products (f32 and bf16 → f32)
//! <family>.rs    launchers mirroring cpu/<family>.rs, shapes checked before launch
//! kernels/*.cu   the CUDA C sources, one file per family, forward and backward adjacent
//! nccl.rs        NCCL collectives on device buffers (feature `nccl`; libnccl found at run time)
//! emu/           the emulated device (feature `cuda-emu`): the same kernels on the CPU
//! ```
//!
//! Launchers take the device first and device buffers where the CPU kernels take slices;
//! backward launchers write their gradient buffers (`dx = ...`, never read; the crate's
//! gradient contract in `lib.rs`) exactly like the CPU ones. Everything is queued on the
//! device's single stream: a launcher returns once its work is queued, and a download waits
//! for it. Argument errors are returned as [`CudaError::Shape`] before anything is launched.
//!
//! The fused gated projection (Transponder eq. 8-10) lives in [`fused_gate`]: a bf16
//! tensor-core GEMM over `[W | A_cᵀ | A_sᵀ]` whose epilogue computes the gate.
//!
//! Checks: `cargo test -p kernels --features cuda --release --test cuda_agreement` compares
//! every kernel with its CPU counterpart on a GPU machine (and skips without one);
//! `--test cuda_nvrtc` only compiles every family, which needs `libnvrtc` but no GPU (for
//! instance PyPI's `nvidia-cuda-nvrtc-cu12` with its `lib/` on `LD_LIBRARY_PATH`);
//! `cargo run --release -p kernels --features cuda --bin cuda-bench` times the fused
//! projection and flash attention against their unfused baselines.

pub mod allocator;
pub mod attention;
pub mod batch_norm;
pub mod blas;
pub mod conv;
pub mod counters;
pub mod device;
pub mod elementwise;
pub mod embedding;
#[cfg(feature = "cuda-emu")]
pub mod emu;
pub mod error;
pub mod fused_gate;
pub mod graph;
mod launch;
pub mod module;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod norm;
pub mod nvrtc;
pub mod optim;
pub mod pool;
pub mod readback;
pub mod reduce;
pub mod rope;
mod segments;
pub mod softmax;
mod staging;
pub mod swiglu;
pub mod timer;
pub mod values;

pub use allocator::{AllocatorStats, DeviceBuffer, DeviceRun, DeviceScalar};
pub use counters::DeviceCounters;
pub use device::CudaDevice;
pub use error::{CudaError, Result};
pub use graph::{CapturedGraph, GraphPool};
pub use timer::KernelTime;
pub use values::{DeviceValues, Values, ValuesMut};
