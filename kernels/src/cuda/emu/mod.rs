//! The emulated CUDA device (feature `cuda-emu`): the CUDA backend with no GPU.
//!
//! ```text
//! cuda_emu.h    the CUDA dialect for the host C++ compiler (threadIdx, __shared__, shuffles, ...)
//! runtime.cpp   one block's threads as fibers: barriers, warp collectives, mma, faults
//! ffi.rs        the C ABI of runtime.cpp and of the kernel tables build.rs generates
//! launch.rs     a launch: limits, argument kinds, blocks over rayon, errors naming the kernel
//! memory.rs     device memory as guarded host pages; live buffers for error reports
//! blas.rs       the cuBLAS calls the backend makes, with cuBLAS's semantics, on the CPU
//! nccl.rs       the NCCL calls, with NCCL's contract, through the host collective (TCP)
//! recording.rs  a CUDA graph's capture: the work recorded instead of run, replayed in order
//! ```
//!
//! [`crate::cuda::CudaDevice`] runs on the emulator when no driver loads (or when
//! `TRANSPONDER_CUDA=emulate`): the same `.cu` sources and launchers as on a GPU, so a bug in
//! a kernel shows up in CPU CI. What emulation checks: out-of-bounds accesses of device
//! buffers and of dynamic shared memory, reads of memory never written (poisoned with NaN
//! bits), barriers and warp collectives reached by part of a block or warp (deadlock),
//! shuffles from exited lanes, the launch limits, and races that change the result with the
//! order threads run in ([`Schedule`]). What it cannot: timing, true concurrency within a
//! block, the GPU's exact rounding of math functions and tensor-core sums, driver behaviour.

pub(crate) mod blas;
mod ffi;
pub(crate) mod launch;
pub(crate) mod memory;
mod mutants;
pub(crate) mod nccl;
pub(crate) mod recording;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

pub use launch::Schedule;
pub use mutants::Mutant;

use super::error::{CudaError, Result};
use super::module::KernelFamily;

impl Mutant {
    /// The family this mutant replaces (build.rs checked that it has a `.cu` file).
    fn family(self) -> Option<KernelFamily> {
        let stem = self.edit().family;
        KernelFamily::ALL.into_iter().find(|family| family.name() == stem)
    }

    /// The kernel table build.rs made for this mutant.
    fn table(self) -> String {
        format!("mutants/{}", self.edit().name)
    }
}

/// The state of one emulated device: its schedule, launch counter and mutants, and the lock
/// that runs its launches one at a time.
pub(crate) struct Emulator {
    schedule: Mutex<Schedule>,
    launches: AtomicU64,
    mutants: Mutex<HashMap<KernelFamily, Mutant>>,
    stream: Mutex<()>,
}

impl Emulator {
    /// An emulator with the schedule of `TRANSPONDER_EMU_SCHEDULE` (rotating by default).
    pub(crate) fn new() -> Result<Emulator> {
        Ok(Emulator {
            schedule: Mutex::new(Schedule::from_env()?),
            launches: AtomicU64::new(0),
            mutants: Mutex::new(HashMap::new()),
            stream: Mutex::new(()),
        })
    }

    /// Held while a launch runs: a GPU runs the launches of the device's one stream one after
    /// another, even when several host threads queue them (tests sharing a device), and the
    /// kernels count on it (the per-family arrival counters, `CudaDevice::arrival_counter`).
    fn stream(&self) -> MutexGuard<'_, ()> {
        self.stream.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn schedule(&self) -> Schedule {
        *self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_schedule(&self, schedule: Schedule) {
        *self.schedule.lock().unwrap_or_else(|p| p.into_inner()) = schedule;
    }

    /// Replaces `mutant`'s family by the mutant for this device's later launches.
    pub(crate) fn use_mutant(&self, mutant: Mutant) -> Result<()> {
        let family = mutant.family().ok_or_else(|| {
            CudaError::Unavailable(format!(
                "mutant {mutant:?} edits `{}`, which is no kernel family",
                mutant.edit().family
            ))
        })?;
        self.mutants.lock().unwrap_or_else(|p| p.into_inner()).insert(family, mutant);
        Ok(())
    }

    /// The number of this launch (0, 1, ...), which picks the rotating order and seed.
    fn next_launch(&self) -> u64 {
        self.launches.fetch_add(1, Ordering::Relaxed)
    }

    /// The kernel table `family` launches from: its own, or its mutant's.
    fn table_for(&self, family: KernelFamily) -> String {
        match self.mutants.lock().unwrap_or_else(|p| p.into_inner()).get(&family) {
            Some(mutant) => mutant.table(),
            None => family.file().to_string(),
        }
    }
}
