//! CUDA graphs: a step's device work captured once and replayed, so that the host queues one
//! graph launch per step instead of every kernel, cuBLAS call, memset and copy in it.
//!
//! [`CudaDevice::capture`] runs a closure while the device's stream captures: the work the
//! closure queues is recorded, not run, into a [`CapturedGraph`] that
//! [`CudaDevice::replay`] then runs as often as wanted. A replay runs the captured work with
//! the capture's arguments and addresses; what the buffers hold is the replay's. So:
//!
//! - **Inputs live in device buffers at fixed addresses** that the host refills (with
//!   ordinary copies, queued before the replay) from one step to the next: token ids, the
//!   optimizer's per-step constants. A copy from the host *inside* a capture is refused,
//!   since every replay would copy the capture's bytes again.
//! - **Nothing in a capture waits for the device** (`synchronize`, downloads, readbacks):
//!   refused. Outputs are read after a replay, from buffers the graph writes.
//! - **Memory comes from the graph's own pool** ([`GraphPool`], `allocator.rs`): the
//!   addresses a replay writes are never handed to other work while the graph lives. A
//!   capture may not allocate from the driver (a request its pool cannot place is refused),
//!   so the step runs once in the pool first ([`CudaDevice::with_graph_pool`]): an eager
//!   step whose placements the capture repeats, request for request (a pool places each
//!   run's requests where its last run placed them).
//! - **One thread**: while a thread captures, work queued on the device by any other thread
//!   is refused (on a GPU it would land in the graph); NCCL collectives and the kernel timer
//!   are refused too.
//!
//! The device counters count a capture's work at each replay, not at the capture (which runs
//! nothing), so a replayed step counts what an eager step of the same work counts, plus one
//! `graph_launches`.
//!
//! On the emulated device a capture records each piece of work (a launch with its
//! arguments, a cuBLAS product, a memset, a device copy) and the poisoning of every block
//! its step is handed, and a replay runs that record in order: the GPU's semantics, checked in
//! CPU CI, including reads of memory the replayed step never wrote (NaN). Before running, a
//! replay checks that every address the record touches is a live buffer or a block of the
//! graph's pool, which catches a graph that reads a buffer dropped since the capture.

use std::sync::{Arc, MutexGuard};
use std::thread;

use cudarc::driver::sys;

use super::allocator::Allocator;
use super::counters::DeviceCounters;
use super::device::{CaptureState, CudaDevice};
#[cfg(feature = "cuda-emu")]
use super::emu::recording::{Node, Recording};
use super::error::{CudaError, Result};

/// The private memory pool of one CUDA graph: what a step run in it allocates stays there
/// (`allocator.rs`), for the graph's replays alone.
pub struct GraphPool {
    id: u64,
    allocator: Arc<Allocator>,
}

impl Drop for GraphPool {
    fn drop(&mut self) {
        self.allocator.drop_pool(self.id);
    }
}

impl std::fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphPool({})", self.id)
    }
}

/// A captured step: replay it with [`CudaDevice::replay`] on the device that captured it.
pub struct CapturedGraph {
    body: Body,
    /// What the capture queued, counted again at every replay.
    work: DeviceCounters,
    /// Dropped after the body: the graph's memory outlives its last replay's queueing.
    pool: GraphPool,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CapturedGraph({} launches, {:?})", self.work.launches, self.pool)
    }
}

impl CapturedGraph {
    /// What one replay queues (launches by kernel, cuBLAS calls, bytes, ...).
    pub fn work(&self) -> &DeviceCounters {
        &self.work
    }
}

enum Body {
    /// The driver's instantiated graph.
    Driver(cudarc::driver::CudaGraph),
    /// The emulator's record of the capture.
    #[cfg(feature = "cuda-emu")]
    Emulated(Vec<Node>),
}

/// What this thread's device work does now.
pub(crate) enum Role {
    /// Runs (emulated) or is queued (GPU) as usual.
    Eager,
    /// Is captured: on a GPU by the stream, on the emulator into this record.
    Capturing(#[cfg(feature = "cuda-emu")] Option<Arc<Recording>>),
}

/// Ends a capture or a step in a pool however the closure returns (a panic included).
struct Leave<'a> {
    dev: &'a CudaDevice,
    capture: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.dev.allocator().leave_pool();
        if self.capture {
            *self.dev.capture_state() = None;
        }
    }
}

impl CudaDevice {
    /// A new, empty memory pool for one graph.
    pub fn graph_pool(&self) -> GraphPool {
        let allocator = Arc::clone(self.allocator());
        GraphPool { id: allocator.new_pool(), allocator }
    }

    fn check_pool(&self, op: &'static str, pool: &GraphPool) -> Result<()> {
        if Arc::ptr_eq(&pool.allocator, self.allocator()) {
            Ok(())
        } else {
            Err(CudaError::Capture { op, message: format!("{pool:?} belongs to another device") })
        }
    }

    /// Runs `work` eagerly with this thread's device memory served from `pool`: the run
    /// before a capture, whose placements the capture of the same step repeats.
    pub fn with_graph_pool<T, E: From<CudaError>>(
        &self,
        pool: &GraphPool,
        work: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        self.check_pool("with_graph_pool", pool)?;
        self.refuse_in_capture("with_graph_pool")?;
        #[cfg(feature = "cuda-emu")]
        self.allocator().enter_pool(pool.id, false, None)?;
        #[cfg(not(feature = "cuda-emu"))]
        self.allocator().enter_pool(pool.id, false)?;
        let _leave = Leave { dev: self, capture: false };
        work()
    }

    /// Captures the device work `work` queues into a graph that owns `pool` (see the module
    /// documentation for what a capture refuses). Nothing runs; [`CudaDevice::replay`] runs
    /// it. When `work` fails, the capture is discarded and its error returned.
    pub fn capture<T, E: From<CudaError>>(
        &self,
        pool: GraphPool,
        work: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<(CapturedGraph, T), E> {
        const OP: &str = "capture";
        self.check_pool(OP, &pool)?;
        self.refuse_in_capture(OP)?;
        if self.kernel_timer_running() {
            return Err(CudaError::Capture { op: OP, message: "the kernel timer is running".to_string() }.into());
        }
        let before = self.counters();
        if let Some(gpu) = self.driver() {
            gpu.bind()?;
            // Thread-local: this thread's calls a capture cannot take fail at once.
            let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            gpu.cuda_stream().begin_capture(mode).map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        }
        #[cfg(feature = "cuda-emu")]
        let recording = self.is_emulated().then(|| Arc::new(Recording::default()));
        let state = CaptureState {
            thread: thread::current().id(),
            #[cfg(feature = "cuda-emu")]
            recording: recording.clone(),
        };
        *self.capture_state() = Some(state);
        let entered = {
            #[cfg(feature = "cuda-emu")]
            {
                self.allocator().enter_pool(pool.id, true, recording.clone())
            }
            #[cfg(not(feature = "cuda-emu"))]
            {
                self.allocator().enter_pool(pool.id, true)
            }
        };
        let (outcome, body) = {
            let _leave = Leave { dev: self, capture: true };
            let outcome = match entered {
                Ok(()) => work(),
                Err(e) => Err(e.into()),
            };
            // Ended while the device is still this thread's: no other work lands in the graph.
            let body = self.end_capture(
                #[cfg(feature = "cuda-emu")]
                recording,
            );
            (outcome, body)
        };
        // The capture ran nothing: its work is counted at each replay instead.
        let mut work_done = self.counters().since(&before);
        self.restore_counters(&before);
        let value = outcome?;
        work_done.buffer_requests = 0;
        work_done.driver_allocations = 0;
        Ok((CapturedGraph { body: body?, work: work_done, pool }, value))
    }

    /// Ends the stream's capture (on a GPU, instantiating and uploading the graph).
    fn end_capture(&self, #[cfg(feature = "cuda-emu")] recording: Option<Arc<Recording>>) -> Result<Body> {
        #[cfg(feature = "cuda-emu")]
        if let Some(recording) = recording {
            return Ok(Body::Emulated(recording.take()));
        }
        let gpu = self.driver().ok_or_else(|| CudaError::Unavailable("no driver behind this device".to_string()))?;
        gpu.bind()?;
        let graph = gpu
            .cuda_stream()
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| CudaError::driver("cuStreamEndCapture / cuGraphInstantiate", e))?
            .ok_or_else(|| CudaError::Capture { op: "capture", message: "the driver returned no graph".to_string() })?;
        graph.upload().map_err(|e| CudaError::driver("cuGraphUpload", e))?;
        Ok(Body::Driver(graph))
    }

    /// Queues one replay of `graph` (captured on this device).
    pub fn replay(&self, graph: &CapturedGraph) -> Result<()> {
        const OP: &str = "replay";
        self.check_pool(OP, &graph.pool)?;
        self.refuse_in_capture(OP)?;
        if self.kernel_timer_running() {
            return Err(CudaError::Capture { op: OP, message: "the kernel timer cannot time a replay".to_string() });
        }
        self.count_replay(&graph.work);
        match &graph.body {
            Body::Driver(graph) => {
                let gpu = self.driver().ok_or_else(|| CudaError::Unavailable("no driver".to_string()))?;
                gpu.bind()?;
                graph.launch().map_err(|e| CudaError::driver("cuGraphLaunch", e))
            }
            #[cfg(feature = "cuda-emu")]
            Body::Emulated(nodes) => self.replay_emulated(graph.pool.id, nodes),
        }
    }

    /// Runs an emulated record in order, after checking every address it touches.
    #[cfg(feature = "cuda-emu")]
    fn replay_emulated(&self, pool: u64, nodes: &[Node]) -> Result<()> {
        let emulator = self.emulator("replay")?;
        for (name, addresses) in nodes.iter().filter_map(Node::touches) {
            if let Some(address) = self.allocator().outside_pool(pool, addresses.iter().copied()) {
                return Err(CudaError::Capture {
                    op: "replay",
                    message: format!(
                        "{name} touches {address:#x}, which is no longer a live buffer nor the graph's: a \
                             buffer the captured step read was dropped after the capture (keep it alive as long \
                             as the graph)"
                    ),
                });
            }
        }
        // SAFETY: every address of the record is a live buffer or a block of the graph's
        // pool (checked above), which the graph owns: mapped while it lives.
        unsafe { super::emu::recording::run(nodes, emulator) }
    }

    /// What this thread's device work `op` does now: errors while another thread captures.
    pub(crate) fn capture_role(&self, op: &'static str) -> Result<Role> {
        let state = self.capture_state();
        match &*state {
            None => Ok(Role::Eager),
            Some(capture) if capture.thread == thread::current().id() => {
                #[cfg(feature = "cuda-emu")]
                return Ok(Role::Capturing(capture.recording.clone()));
                #[cfg(not(feature = "cuda-emu"))]
                return Ok(Role::Capturing());
            }
            Some(_) => Err(CudaError::Capture {
                op,
                message: "another thread is capturing a graph on this device: its work would land in the graph"
                    .to_string(),
            }),
        }
    }

    /// Errors while a capture is under way: `op` (a wait for the device, a copy from or to
    /// the host, a collective) cannot be part of a graph.
    pub(crate) fn refuse_in_capture(&self, op: &'static str) -> Result<()> {
        match self.capture_role(op)? {
            Role::Eager => Ok(()),
            Role::Capturing(..) => Err(CudaError::Capture {
                op,
                message: "a graph cannot wait for the device or copy host memory: refill inputs in device buffers \
                          before a replay, and read outputs after it"
                    .to_string(),
            }),
        }
    }

    /// Runs emulated work now, or records it while this thread captures (`addresses`: the
    /// device addresses it touches, asked for only then).
    #[cfg(feature = "cuda-emu")]
    pub(crate) fn emulate(
        &self,
        name: &'static str,
        addresses: impl FnOnce() -> Vec<u64>,
        run: impl Fn(&super::emu::Emulator) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        let emulator = self.emulator(name)?;
        match self.capture_role(name)? {
            Role::Capturing(Some(recording)) => {
                recording.work(name, addresses(), Box::new(run));
                Ok(())
            }
            _ => run(emulator),
        }
    }

    fn capture_state(&self) -> MutexGuard<'_, Option<CaptureState>> {
        self.capture.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
