//! The NCCL calls of `cuda/nccl.rs` on the emulated device: the buffers are host pages (their
//! device address is a host address, `memory.rs`), and the emulator runs every launch to
//! completion before returning, so there is no queued work to wait for: each collective runs
//! the host collective ([`crate::collective::HostComm`]) on the buffers' elements directly,
//! with NCCL's contract (identical bits on every rank, ring order) and the host collective's
//! stricter failures (mismatched calls and closed peers are errors, silence a timeout).

use std::sync::Arc;
use std::time::Duration;

use crate::collective::{CollectiveError, HostComm, HostCommAbort, ReduceOp, UniqueId};
use crate::cuda::allocator::DeviceBuffer;
use crate::cuda::error::{CudaError, Result};

/// One rank's emulated communicator.
pub(crate) struct EmulatedComm {
    host: HostComm,
    abort: Arc<HostCommAbort>,
}

/// The elements of an emulated buffer.
fn host_slice(buffer: &DeviceBuffer<f32>) -> &[f32] {
    if buffer.is_empty() {
        return &[];
    }
    // SAFETY: an emulated buffer's device address is its host mapping of `len` f32, alive
    // and not written while `buffer` is borrowed (emulated launches finish before returning).
    unsafe { std::slice::from_raw_parts(buffer.device_ptr() as *const f32, buffer.len()) }
}

/// The elements of an emulated buffer, writable.
fn host_slice_mut(buffer: &mut DeviceBuffer<f32>) -> &mut [f32] {
    if buffer.is_empty() {
        return &mut [];
    }
    // SAFETY: as in `host_slice`, and `buffer` is borrowed exclusively.
    unsafe { std::slice::from_raw_parts_mut(buffer.device_ptr() as *mut f32, buffer.len()) }
}

impl EmulatedComm {
    /// Joins the host collective of `id` (made by `UniqueId::new` on rank 0).
    pub(crate) fn init(id: &UniqueId, rank: usize, world_size: usize, timeout: Duration) -> Result<EmulatedComm> {
        let failed = |e: CollectiveError| CudaError::Nccl {
            call: format!("ncclCommInitRank (emulated, rank {rank} of {world_size})"),
            message: e.to_string(),
        };
        let host = HostComm::init(id, rank, world_size, timeout).map_err(failed)?;
        let abort = Arc::new(host.abort_handle().map_err(failed)?);
        Ok(EmulatedComm { host, abort })
    }

    /// The handle a watchdog aborts the communicator with.
    pub(crate) fn abort_handle(&self) -> Arc<HostCommAbort> {
        Arc::clone(&self.abort)
    }

    pub(crate) fn all_reduce(
        &mut self,
        buffer: &mut DeviceBuffer<f32>,
        op: ReduceOp,
    ) -> std::result::Result<(), CollectiveError> {
        self.host.all_reduce(host_slice_mut(buffer), op)
    }

    pub(crate) fn broadcast(
        &mut self,
        buffer: &mut DeviceBuffer<f32>,
        root: usize,
    ) -> std::result::Result<(), CollectiveError> {
        self.host.broadcast(host_slice_mut(buffer), root)
    }

    pub(crate) fn reduce_scatter(
        &mut self,
        send: &DeviceBuffer<f32>,
        recv: &mut DeviceBuffer<f32>,
        op: ReduceOp,
    ) -> std::result::Result<(), CollectiveError> {
        self.host.reduce_scatter(host_slice(send), host_slice_mut(recv), op)
    }

    pub(crate) fn all_gather(
        &mut self,
        send: &DeviceBuffer<f32>,
        recv: &mut DeviceBuffer<f32>,
    ) -> std::result::Result<(), CollectiveError> {
        self.host.all_gather(host_slice(send), host_slice_mut(recv))
    }
}

/// The emulator's `ncclCommGetAsyncError`: nothing runs asynchronously, so only an abort.
pub(crate) fn async_error(abort: &HostCommAbort) -> Result<()> {
    if abort.is_aborted() {
        return Err(CudaError::Nccl {
            call: "ncclCommGetAsyncError (emulated)".into(),
            message: "the communicator was aborted".into(),
        });
    }
    Ok(())
}
