//! The emulated CUDA device (feature `cuda-emu`): the CUDA backend with no GPU.
//!
//! ```text
//! cuda_emu.h    the CUDA dialect for the host C++ compiler (threadIdx, __shared__, shuffles, ...)
//! runtime.cpp   one block's threads as fibers: barriers, warp collectives, mma, faults
//! ffi.rs        the C ABI of runtime.cpp and of the kernel tables build.rs generates
//! launch.rs     a launch: limits, argument kinds, blocks over rayon, errors naming the kernel
//! memory.rs     device memory as guarded host pages; live buffers for error reports
//! blas.rs       the cuBLAS calls the backend makes, with cuBLAS's semantics, on the CPU
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

pub use launch::Schedule;

use super::error::Result;
use super::module::KernelFamily;

/// A deliberately wrong variant of one kernel family, for the emulator's own tests: each
/// must make an agreement or bounds test fail (kernels/tests/cuda_emulator.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// `attention_forward` without the barrier between staging a K/V tile and reading it.
    AttentionMissingSync,
    /// `fused_gate_mma_r*` storing accumulator elements d1 of the summary columns' mma
    /// fragment in row g + 8 instead of g (a fragment index off by one).
    FusedGateFragmentRow,
    /// `fill_bias` writing one element past the end of `y`.
    FillBiasPastEnd,
}

impl Mutant {
    fn family(self) -> KernelFamily {
        match self {
            Mutant::AttentionMissingSync => KernelFamily::Attention,
            Mutant::FusedGateFragmentRow => KernelFamily::FusedGate,
            Mutant::FillBiasPastEnd => KernelFamily::Conv,
        }
    }

    fn table(self) -> &'static str {
        match self {
            Mutant::AttentionMissingSync => "mutants/attention_missing_sync",
            Mutant::FusedGateFragmentRow => "mutants/fused_gate_fragment_row",
            Mutant::FillBiasPastEnd => "mutants/fill_bias_past_end",
        }
    }
}

/// The state of one emulated device: its schedule, launch counter and mutants.
pub(crate) struct Emulator {
    schedule: Mutex<Schedule>,
    launches: AtomicU64,
    mutants: Mutex<HashMap<KernelFamily, Mutant>>,
}

impl Emulator {
    /// An emulator with the schedule of `TRANSPONDER_EMU_SCHEDULE` (rotating by default).
    pub(crate) fn new() -> Result<Emulator> {
        Ok(Emulator {
            schedule: Mutex::new(Schedule::from_env()?),
            launches: AtomicU64::new(0),
            mutants: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn schedule(&self) -> Schedule {
        *self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_schedule(&self, schedule: Schedule) {
        *self.schedule.lock().unwrap_or_else(|p| p.into_inner()) = schedule;
    }

    /// Replaces `mutant`'s family by the mutant for this device's later launches.
    pub(crate) fn use_mutant(&self, mutant: Mutant) {
        self.mutants.lock().unwrap_or_else(|p| p.into_inner()).insert(mutant.family(), mutant);
    }

    /// The number of this launch (0, 1, ...), which picks the rotating order and seed.
    fn next_launch(&self) -> u64 {
        self.launches.fetch_add(1, Ordering::Relaxed)
    }

    /// The kernel table `family` launches from: its own, or its mutant's.
    fn table_for(&self, family: KernelFamily) -> String {
        match self.mutants.lock().unwrap_or_else(|p| p.into_inner()).get(&family) {
            Some(mutant) => mutant.table().to_string(),
            None => family.file().to_string(),
        }
    }
}
