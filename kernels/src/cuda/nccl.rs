//! NCCL collectives on device buffers (feature `nccl`): the gradient all-reduce of data
//! parallel training, plus broadcast, reduce-scatter and all-gather, in f32.
//!
//! Like the rest of [`CudaDevice`], a communicator has two backends:
//! - **a GPU**: libnccl, loaded at run time (see `nccl/library.rs` for where we look, and why
//!   not through cudarc's loader), called directly with the device's one stream; we do not
//!   use cudarc's safe `Comm`, which is `!Send`, hides the raw handle (so no
//!   `ncclCommGetAsyncError`) and panics in `Drop` (cudarc 0.19.10 `src/nccl/safe.rs`
//!   l.56-62). A collective is queued on the stream and returns; the next download waits.
//!   `ncclCommInitRank` is NCCL's blocking one: it waits for every rank, with NCCL's own
//!   bootstrap limits rather than `timeout` (a watchdog covers a rank that never comes).
//! - **the emulated device**: the same calls on the buffers' host pages through the host
//!   collective ([`crate::collective`], `emu/nccl.rs`), so CI runs several ranks as threads
//!   or processes without a GPU. Its [`unique_id`] is [`UniqueId::new`], so a rendezvous
//!   ships the same 128 bytes either way. It is stricter than NCCL: mismatched calls and a
//!   closed peer are errors naming the ranks, a silent peer a timeout, where NCCL hangs.
//!
//! Reductions are Sum, Max or Min (never `ncclAvg`, which pre-multiplies floats: scale
//! before summing instead). A collective of zero elements is skipped on a GPU, as NCCL
//! does; the emulator still exchanges its header. Drop destroys the communicator
//! (`ncclCommDestroy`), or aborts it (`ncclCommAbort`) after an error; it never panics.
//! Each call counts in the device's `collectives` and `collective_bytes`.

mod library;

use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclRedOp_t};

pub use crate::collective::{ReduceOp, UniqueId};

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, CudaError, Result};

/// The unique id of a new communicator, made by rank 0 and shipped to every rank: on a GPU
/// `ncclGetUniqueId` (NCCL's bootstrap picks its own interface, `NCCL_SOCKET_IFNAME`; `bind`
/// is not used); on the emulated device [`UniqueId::new`]`(bind)`.
pub fn unique_id(device: &CudaDevice, bind: IpAddr) -> Result<UniqueId> {
    match device.driver() {
        Some(_) => Ok(UniqueId::from_bytes(library::nccl()?.unique_id()?)),
        None => UniqueId::new(bind)
            .map_err(|e| CudaError::Nccl { call: "ncclGetUniqueId (emulated)".into(), message: e.to_string() }),
    }
}

/// One rank's NCCL communicator on one device. `Send`: a rank may hand it to another thread.
pub struct NcclComm {
    device: Arc<CudaDevice>,
    rank: usize,
    world_size: usize,
    backend: CommBackend,
}

enum CommBackend {
    Gpu(Arc<GpuComm>),
    #[cfg(feature = "cuda-emu")]
    Emulated(super::emu::nccl::EmulatedComm),
}

/// A raw communicator handle.
#[derive(Clone, Copy)]
struct RawComm(ncclComm_t);

// SAFETY: an NCCL communicator is not tied to a thread; `GpuComm` orders teardown (write
// lock) after every call that uses the handle (read lock).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// Whether a GPU communicator may still be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Live,
    /// A call failed: further calls are refused and teardown aborts.
    Failed,
    /// Aborted or destroyed.
    Closed,
}

/// A GPU communicator shared by its [`NcclComm`] and its watchdog handles.
struct GpuComm {
    nccl: &'static library::Nccl,
    comm: RawComm,
    state: RwLock<State>,
}

impl GpuComm {
    /// Runs `call` on the live handle (read lock: teardown waits for it); a failure marks
    /// the communicator failed.
    fn call(&self, what: impl Fn() -> String, call: impl FnOnce(ncclComm_t) -> i32) -> Result<()> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        if *state != State::Live {
            return Err(CudaError::Nccl { call: what(), message: format!("the communicator is {state:?}") });
        }
        let status = call(self.comm.0);
        let result = self.nccl.check(what(), status, Some(self.comm.0));
        drop(state);
        if result.is_err() {
            let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
            if *state == State::Live {
                *state = State::Failed;
            }
        }
        result
    }

    /// `ncclCommGetAsyncError`.
    fn async_error(&self) -> Result<()> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        if *state == State::Closed {
            return Err(CudaError::Nccl {
                call: "ncclCommGetAsyncError".into(),
                message: "the communicator was closed".into(),
            });
        }
        // SAFETY: the handle is live (not closed) while the read lock is held.
        let (status, error) = unsafe { self.nccl.async_error(self.comm.0) };
        self.nccl.check("ncclCommGetAsyncError", status, Some(self.comm.0))?;
        self.nccl.check("an asynchronous NCCL operation (ncclCommGetAsyncError)", error, Some(self.comm.0))
    }

    /// Ends the communicator: `ncclCommDestroy` when `destroy` and it is healthy, otherwise
    /// `ncclCommAbort` (a destroy that fails is followed by an abort). Idempotent.
    fn close(&self, destroy: bool) -> Result<()> {
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let previous = std::mem::replace(&mut *state, State::Closed);
        let comm = self.comm.0;
        match previous {
            State::Closed => Ok(()),
            State::Live if destroy => {
                // SAFETY: live, and never used again (the state is Closed).
                let status = unsafe { self.nccl.destroy(comm) };
                if status == 0 {
                    return Ok(());
                }
                // SAFETY: a failed destroy leaves the communicator to be aborted.
                let abort = unsafe { self.nccl.abort(comm) };
                self.nccl.check("ncclCommDestroy", status, None).and(self.nccl.check("ncclCommAbort", abort, None))
            }
            _ => {
                // SAFETY: live or failed, and never used again.
                let status = unsafe { self.nccl.abort(comm) };
                self.nccl.check("ncclCommAbort", status, None)
            }
        }
    }
}

/// A `Send + Sync` handle on a communicator for a watchdog thread: it polls
/// [`NcclWatchdogHandle::async_error`] and, when a collective is stuck or failed, calls
/// [`NcclWatchdogHandle::abort`] (then the process should exit, as PyTorch's watchdog does).
pub struct NcclWatchdogHandle(HandleBackend);

enum HandleBackend {
    Gpu(Arc<GpuComm>),
    #[cfg(feature = "cuda-emu")]
    Emulated(Arc<crate::collective::HostCommAbort>),
}

impl NcclWatchdogHandle {
    /// `ncclCommAbort`: ends the communicator; its later calls fail. On a GPU this waits
    /// for a call being queued on the host to return (a blocking NCCL communicator cannot be
    /// aborted mid-call), not for the device. On the emulated device it closes the sockets,
    /// which unblocks a collective waiting for a peer.
    pub fn abort(&self) -> Result<()> {
        match &self.0 {
            HandleBackend::Gpu(comm) => comm.close(false),
            #[cfg(feature = "cuda-emu")]
            HandleBackend::Emulated(abort) => {
                abort.abort();
                Ok(())
            }
        }
    }

    /// `ncclCommGetAsyncError`: an error once an asynchronous operation failed or the
    /// communicator was aborted (the emulator has no asynchronous errors).
    pub fn async_error(&self) -> Result<()> {
        match &self.0 {
            HandleBackend::Gpu(comm) => comm.async_error(),
            #[cfg(feature = "cuda-emu")]
            HandleBackend::Emulated(abort) => super::emu::nccl::async_error(abort),
        }
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

impl NcclComm {
    /// Joins the communicator of `id` as `rank` of `world_size` on `device` (every rank
    /// calls it; it returns once all have joined). `timeout` bounds every wait for a peer on
    /// the emulated device; on a GPU, NCCL's blocking init has its own limits.
    pub fn init(
        device: &Arc<CudaDevice>,
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        ensure(rank < world_size && world_size <= i32::MAX as usize, "NcclComm::init", || {
            format!("rank {rank} of world size {world_size}")
        })?;
        let backend = match device.driver() {
            Some(gpu) => {
                let nccl = library::nccl()?;
                gpu.bind()?;
                let comm = nccl.init_rank(id.to_bytes(), rank as i32, world_size as i32)?;
                CommBackend::Gpu(Arc::new(GpuComm { nccl, comm: RawComm(comm), state: RwLock::new(State::Live) }))
            }
            #[cfg(feature = "cuda-emu")]
            None => CommBackend::Emulated(super::emu::nccl::EmulatedComm::init(id, rank, world_size, timeout)?),
            #[cfg(not(feature = "cuda-emu"))]
            None => {
                return Err(CudaError::Unavailable(format!(
                    "{} has no driver and this build no emulated NCCL (feature cuda-emu; timeout {timeout:?})",
                    device.label()
                )))
            }
        };
        Ok(NcclComm { device: Arc::clone(device), rank, world_size, backend })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Which NCCL: `NCCL 2.29.7 (/path/libnccl.so.2)` or `emulated NCCL (host collective)`.
    pub fn describe(&self) -> String {
        match &self.backend {
            CommBackend::Gpu(comm) => comm.nccl.describe(),
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(_) => "emulated NCCL (host collective)".to_string(),
        }
    }

    /// Reduces `buffer` over all ranks with `op`, in place, queued on the device's stream.
    pub fn all_reduce(&mut self, buffer: &mut DeviceBuffer<f32>, op: ReduceOp) -> Result<()> {
        self.device.check_owner("NcclComm::all_reduce", buffer)?;
        let count = buffer.len();
        self.device.count_collective(buffer.num_bytes())?;
        let what = || format!("ncclAllReduce ({op:?}) of {count} f32 on rank {}", self.rank);
        match &mut self.backend {
            CommBackend::Gpu(comm) => {
                let args = (buffer.device_ptr(), buffer.device_ptr(), count);
                let stream = gpu_stream(&self.device, count)?;
                // SAFETY: the buffer is this device's, of `count` f32, exclusively borrowed,
                // and ordered by the device's one stream.
                stream.map_or(Ok(()), |s| comm.call(what, |c| unsafe { comm.nccl.all_reduce(args, nccl_op(op), c, s) }))
            }
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(comm) => comm.all_reduce(buffer, op).map_err(emulated(what())),
        }
    }

    /// Copies `root`'s `buffer` to every rank, in place.
    pub fn broadcast(&mut self, buffer: &mut DeviceBuffer<f32>, root: usize) -> Result<()> {
        self.device.check_owner("NcclComm::broadcast", buffer)?;
        ensure(root < self.world_size, "NcclComm::broadcast", || format!("root {root} of {} ranks", self.world_size))?;
        let count = buffer.len();
        self.device.count_collective(buffer.num_bytes())?;
        let what = || format!("ncclBroadcast (root {root}) of {count} f32 on rank {}", self.rank);
        match &mut self.backend {
            CommBackend::Gpu(comm) => {
                let args = (buffer.device_ptr(), buffer.device_ptr(), count);
                let stream = gpu_stream(&self.device, count)?;
                // SAFETY: as in all_reduce; `root` < world size ≤ i32::MAX.
                stream.map_or(Ok(()), |s| comm.call(what, |c| unsafe { comm.nccl.broadcast(args, root as i32, c, s) }))
            }
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(comm) => comm.broadcast(buffer, root).map_err(emulated(what())),
        }
    }

    /// Reduces `send` over all ranks with `op`; rank r receives chunk r in `recv`
    /// (`send.len() == recv.len() × world_size`).
    pub fn reduce_scatter(
        &mut self,
        send: &DeviceBuffer<f32>,
        recv: &mut DeviceBuffer<f32>,
        op: ReduceOp,
    ) -> Result<()> {
        self.device.check_owner("NcclComm::reduce_scatter", send)?;
        self.device.check_owner("NcclComm::reduce_scatter", recv)?;
        ensure_len("NcclComm::reduce_scatter", "send", send.len(), recv.len() * self.world_size)?;
        let count = recv.len();
        self.device.count_collective(send.num_bytes())?;
        let what = || format!("ncclReduceScatter ({op:?}) of {count} f32 per rank on rank {}", self.rank);
        match &mut self.backend {
            CommBackend::Gpu(comm) => {
                let args = (send.device_ptr(), recv.device_ptr(), count);
                let stream = gpu_stream(&self.device, count)?;
                // SAFETY: both buffers are this device's with the lengths checked above,
                // distinct (one is borrowed mutably), ordered by the device's stream.
                stream.map_or(Ok(()), |s| {
                    comm.call(what, |c| unsafe { comm.nccl.reduce_scatter(args, nccl_op(op), c, s) })
                })
            }
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(comm) => comm.reduce_scatter(send, recv, op).map_err(emulated(what())),
        }
    }

    /// Gathers every rank's `send` into `recv` in rank order
    /// (`recv.len() == send.len() × world_size`).
    pub fn all_gather(&mut self, send: &DeviceBuffer<f32>, recv: &mut DeviceBuffer<f32>) -> Result<()> {
        self.device.check_owner("NcclComm::all_gather", send)?;
        self.device.check_owner("NcclComm::all_gather", recv)?;
        ensure_len("NcclComm::all_gather", "recv", recv.len(), send.len() * self.world_size)?;
        let count = send.len();
        self.device.count_collective(recv.num_bytes())?;
        let what = || format!("ncclAllGather of {count} f32 per rank on rank {}", self.rank);
        match &mut self.backend {
            CommBackend::Gpu(comm) => {
                let args = (send.device_ptr(), recv.device_ptr(), count);
                let stream = gpu_stream(&self.device, count)?;
                // SAFETY: as in reduce_scatter.
                stream.map_or(Ok(()), |s| comm.call(what, |c| unsafe { comm.nccl.all_gather(args, c, s) }))
            }
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(comm) => comm.all_gather(send, recv).map_err(emulated(what())),
        }
    }

    /// `ncclCommGetAsyncError`: an error once an asynchronous NCCL operation failed (always
    /// `Ok` on the emulator, until it is aborted).
    pub fn async_error(&self) -> Result<()> {
        self.watchdog_handle().async_error()
    }

    /// A handle for a watchdog thread: `abort()` and `async_error()`.
    pub fn watchdog_handle(&self) -> NcclWatchdogHandle {
        match &self.backend {
            CommBackend::Gpu(comm) => NcclWatchdogHandle(HandleBackend::Gpu(Arc::clone(comm))),
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(comm) => NcclWatchdogHandle(HandleBackend::Emulated(comm.abort_handle())),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        match &self.backend {
            // A failed teardown has no one to report to; the process's exit reclaims it.
            CommBackend::Gpu(comm) => drop(comm.close(true)),
            #[cfg(feature = "cuda-emu")]
            CommBackend::Emulated(_) => {}
        }
    }
}

/// The device's stream, with its context bound to this thread, for a collective of
/// `count` elements; `None` when there is nothing to do (NCCL skips empty collectives).
fn gpu_stream(device: &CudaDevice, count: usize) -> Result<Option<cudaStream_t>> {
    let gpu = device.driver().ok_or_else(|| CudaError::Unavailable("a GPU communicator on a non-GPU device".into()))?;
    if count == 0 {
        return Ok(None);
    }
    gpu.bind()?;
    Ok(Some(gpu.stream() as cudaStream_t))
}

/// Wraps an emulated collective's error with the NCCL call it stands for.
#[cfg(feature = "cuda-emu")]
fn emulated(call: String) -> impl FnOnce(crate::collective::CollectiveError) -> CudaError {
    move |e| CudaError::Nccl { call: format!("{call} (emulated)"), message: e.to_string() }
}
