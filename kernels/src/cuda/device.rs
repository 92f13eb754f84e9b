//! One CUDA device: its context, the single stream all its work goes to, a cuBLAS handle,
//! the compiled kernels, the caching allocator and the pinned staging ring; host ↔ device
//! copies (uploads through the staging ring, `staging.rs`).
//!
//! The CUDA libraries are loaded at run time (cudarc's `dynamic-loading`), so a machine
//! without a driver builds and runs everything else; [`CudaDevice::new`] then returns
//! [`CudaError::Unavailable`] saying which library or device is missing, instead of the
//! panic cudarc's loader would raise.
//!
//! All work of a device (kernels, cuBLAS, copies) is queued on one stream, so it runs in
//! the order it was issued; cudarc's per-buffer event tracking is switched off.
//!
//! With feature `cuda-emu`, a device can also be the emulated one (`emu/`): when no driver
//! loads, or when `TRANSPONDER_CUDA=emulate`, [`CudaDevice::new`] opens it instead
//! (`TRANSPONDER_CUDA=driver` refuses the fallback). Its work runs synchronously on the
//! host; the launchers, the allocator and the copies keep their code paths.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{result as driver, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::allocator::{Allocator, AllocatorStats, DeviceBuffer, DeviceScalar};
use super::counters::{Counters, DeviceCounters, GemmKind};
use super::error::{ensure, CudaError, Result};
use super::module::{panic_message, Arg, KernelCache, KernelFamily};
use super::readback::ReadbackSlots;
use super::staging::{Staging, StagingStream, CHUNK_BYTES};
use super::timer::{KernelTime, KernelTimer};

/// A CUDA device with its stream, cuBLAS handle, kernels and memory pool.
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    capability: (i32, i32),
    backend: Backend,
    allocator: Arc<Allocator>,
    staging: Staging,
    readback: Arc<ReadbackSlots>,
    counters: Counters,
    timer: KernelTimer,
    /// The arrival counters of the kernels that finish in their last block
    /// ([`CudaDevice::arrival_counters`]); made, and grown, on demand.
    arrivals: Mutex<Option<DeviceBuffer<u32>>>,
    /// The capture under way, if any (`graph.rs`).
    pub(crate) capture: Mutex<Option<CaptureState>>,
}

/// The thread capturing a CUDA graph on a device (`graph.rs`), and (emulated) where its
/// work is recorded.
pub(crate) struct CaptureState {
    pub(crate) thread: std::thread::ThreadId,
    #[cfg(feature = "cuda-emu")]
    pub(crate) recording: Option<Arc<super::emu::recording::Recording>>,
}

/// What runs the device's work.
enum Backend {
    /// A GPU through the driver.
    Driver(Driver),
    /// The CPU emulator.
    #[cfg(feature = "cuda-emu")]
    Emulated(super::emu::Emulator),
}

/// A GPU's context, stream, cuBLAS handle and loaded kernels.
pub(crate) struct Driver {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, set once: its products never allocate one themselves, so a CUDA
    /// graph captures them without a memory node (PyTorch does the same).
    _blas_workspace: DeviceBuffer<f32>,
    kernels: KernelCache,
}

/// Bytes of cuBLAS's workspace: PyTorch's default on Hopper (`CUBLAS_WORKSPACE_CONFIG=:4096:8`).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl Driver {
    /// The cuBLAS handle (bound to the device's stream).
    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// Makes the context current on the calling thread (needed before raw calls).
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding the context", e))
    }

    /// The raw stream all the device's work is queued on.
    pub(crate) fn stream(&self) -> cudarc::driver::sys::CUstream {
        self.stream.cu_stream()
    }

    /// The device's one stream.
    pub(crate) fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's context (page-locked memory and events are made in it).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// Checks that the CUDA libraries can be loaded, so cudarc's loader will not panic.
fn probe_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries by their usual names.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [(driver, "libcuda (the NVIDIA driver)"), (nvrtc, "libnvrtc"), (cublas, "libcublas")]
        .into_iter()
        .filter(|(present, _)| !present)
        .map(|(_, name)| name)
        .collect();
    ensure(missing.is_empty(), "CudaDevice::new", String::new)
        .map_err(|_| CudaError::Unavailable(format!("cannot load {}", missing.join(", "))))
}

impl CudaDevice {
    /// Opens device `ordinal` (0 for the first GPU). Fails with [`CudaError::Unavailable`]
    /// when the driver, NVRTC or cuBLAS cannot be loaded or no such GPU exists. With feature
    /// `cuda-emu`, device 0 is then the emulated one (see the module documentation).
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        match std::env::var("TRANSPONDER_CUDA").as_deref() {
            Ok("emulate") => CudaDevice::emulated_ordinal(ordinal),
            Ok("driver") => CudaDevice::on_driver(ordinal),
            Ok(other) if !other.is_empty() => {
                Err(CudaError::Unavailable(format!("TRANSPONDER_CUDA={other:?}: expected `driver` or `emulate`")))
            }
            _ => match CudaDevice::on_driver(ordinal) {
                Err(CudaError::Unavailable(why)) if cfg!(feature = "cuda-emu") => CudaDevice::emulated_ordinal(ordinal)
                    .map_err(|e| match e {
                        CudaError::Unavailable(emu) => CudaError::Unavailable(format!("{why}; {emu}")),
                        other => other,
                    }),
                other => other,
            },
        }
    }

    /// How many devices [`CudaDevice::new`] can open: the driver's GPUs, else (feature
    /// `cuda-emu`) the emulated device 0, else none. `TRANSPONDER_CUDA` is honoured as there.
    pub fn count() -> usize {
        let emulated = usize::from(cfg!(feature = "cuda-emu"));
        let mode = std::env::var("TRANSPONDER_CUDA");
        if mode.as_deref() == Ok("emulate") {
            return emulated;
        }
        let gpus = probe_libraries()
            .ok()
            .and_then(|()| catch_unwind(CudaContext::device_count).ok()?.ok())
            .map_or(0, |n| usize::try_from(n).unwrap_or(0));
        if gpus > 0 || mode.as_deref() == Ok("driver") {
            gpus
        } else {
            emulated
        }
    }

    /// A GPU through the driver.
    fn on_driver(ordinal: usize) -> Result<CudaDevice> {
        probe_libraries()?;
        catch_unwind(AssertUnwindSafe(|| CudaDevice::open(ordinal))).unwrap_or_else(|panic| {
            Err(CudaError::Unavailable(format!("CUDA library call panicked: {}", panic_message(&panic))))
        })
    }

    /// Emulated device `ordinal` (only 0 exists).
    fn emulated_ordinal(ordinal: usize) -> Result<CudaDevice> {
        if ordinal != 0 {
            return Err(CudaError::Unavailable(format!("device {ordinal} requested; the emulator has only device 0")));
        }
        CudaDevice::emulated()
    }

    /// A fresh emulated device (its own allocator, schedule and mutants), whatever drivers
    /// the machine has. Tests that change the schedule or use mutants open their own.
    #[cfg(feature = "cuda-emu")]
    pub fn emulated() -> Result<CudaDevice> {
        Ok(CudaDevice {
            ordinal: 0,
            name: "CPU emulator".to_string(),
            capability: (8, 0),
            backend: Backend::Emulated(super::emu::Emulator::new()?),
            allocator: Arc::new(Allocator::emulated()),
            staging: Staging::default(),
            readback: Arc::default(),
            counters: Counters::default(),
            timer: KernelTimer::default(),
            arrivals: Mutex::default(),
            capture: Mutex::default(),
        })
    }

    /// Without feature `cuda-emu` there is no emulated device.
    #[cfg(not(feature = "cuda-emu"))]
    pub fn emulated() -> Result<CudaDevice> {
        Err(CudaError::Unavailable("no driver, and this build has no emulated device (feature cuda-emu)".to_string()))
    }

    /// Whether this is the emulated device.
    pub fn is_emulated(&self) -> bool {
        !matches!(self.backend, Backend::Driver(_))
    }

    /// The device as `cuda:N`, with ` (emulated)` on the emulator: for messages and logs.
    pub fn label(&self) -> String {
        let suffix = if self.is_emulated() { " (emulated)" } else { "" };
        format!("cuda:{}{suffix}", self.ordinal)
    }

    /// Sets the order in which the emulator runs the threads of a barrier phase.
    #[cfg(feature = "cuda-emu")]
    pub fn set_emulator_schedule(&self, schedule: super::emu::Schedule) -> Result<()> {
        self.emulator("set_emulator_schedule")?.set_schedule(schedule);
        Ok(())
    }

    /// Runs `mutant` in place of its kernel family on this (emulated) device from now on.
    #[cfg(feature = "cuda-emu")]
    pub fn use_mutant(&self, mutant: super::emu::Mutant) -> Result<()> {
        self.emulator("use_mutant")?.use_mutant(mutant)
    }

    #[cfg(feature = "cuda-emu")]
    pub(crate) fn emulator(&self, op: &'static str) -> Result<&super::emu::Emulator> {
        match &self.backend {
            Backend::Emulated(emulator) => Ok(emulator),
            Backend::Driver(_) => Err(CudaError::shape(op, format!("{} is not the emulated device", self.label()))),
        }
    }

    /// The driver state, or `None` on the emulated device.
    pub(crate) fn driver(&self) -> Option<&Driver> {
        match &self.backend {
            Backend::Driver(driver) => Some(driver),
            #[cfg(feature = "cuda-emu")]
            Backend::Emulated(_) => None,
        }
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::Unavailable(format!("the driver found no usable GPU ({e:?})")))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::Unavailable(format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::Unavailable(format!("cannot open device {ordinal}: {e:?}")))?;
        // SAFETY: this device queues all its work on the one stream created below, so no
        // buffer is ever used by two streams and the per-buffer events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| CudaError::driver("creating the stream", e))?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| CudaError::blas("creating the cuBLAS handle", e))?;
        let capability =
            ctx.compute_capability().map_err(|e| CudaError::driver("reading the compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let allocator = Arc::new(Allocator::new(Arc::clone(&stream)));
        let workspace = DeviceBuffer::<f32>::new(&allocator, BLAS_WORKSPACE_BYTES / 4)?;
        // SAFETY: the workspace is device memory of BLAS_WORKSPACE_BYTES that lives as long
        // as the handle (both are fields of the driver state) and is used by nothing else.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.device_ptr() as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(|e| CudaError::blas("cublasSetWorkspace", e))?;
        let driver = Driver { ctx, stream, blas, _blas_workspace: workspace, kernels: KernelCache::new(capability) };
        Ok(CudaDevice {
            ordinal,
            name,
            capability,
            backend: Backend::Driver(driver),
            allocator,
            staging: Staging::default(),
            readback: Arc::default(),
            counters: Counters::default(),
            timer: KernelTimer::default(),
            arrivals: Mutex::default(),
            capture: Mutex::default(),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)` compute capability, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Compiles and loads every kernel family now (otherwise each is compiled on first use;
    /// the emulator's kernels were compiled with the crate).
    pub fn compile_all(&self) -> Result<()> {
        if let Some(driver) = self.driver() {
            for family in KernelFamily::ALL {
                driver.kernels.module(&driver.ctx, family)?;
            }
        }
        Ok(())
    }

    /// Waits until all queued work has finished; reports errors of asynchronous work.
    pub fn synchronize(&self) -> Result<()> {
        self.refuse_in_capture("synchronize")?;
        self.counters.sync();
        match self.driver() {
            Some(driver) => driver.stream.synchronize().map_err(|e| CudaError::driver("stream synchronize", e)),
            None => Ok(()),
        }
    }

    /// The caching allocator's counters.
    pub fn allocator_stats(&self) -> AllocatorStats {
        self.allocator.stats()
    }

    /// The caching allocator (graph pools are made in it).
    pub(crate) fn allocator(&self) -> &Arc<Allocator> {
        &self.allocator
    }

    /// The work counted on this device since it was opened: take one snapshot before and
    /// one after a step and subtract ([`DeviceCounters::since`]).
    pub fn counters(&self) -> DeviceCounters {
        let stats = self.allocator.stats();
        let driver_allocations = stats.allocations + self.staging.allocations();
        self.counters.snapshot(stats.allocations + stats.reuses, driver_allocations)
    }

    /// Sets the counters back to `snapshot` (a capture's work is counted at its replays).
    pub(crate) fn restore_counters(&self, snapshot: &DeviceCounters) {
        self.counters.restore(snapshot);
    }

    /// Counts one graph replay that queues `work`.
    pub(crate) fn count_replay(&self, work: &DeviceCounters) {
        self.counters.replay(work);
    }

    /// Whether the kernel timer runs (a capture and a replay refuse it).
    pub(crate) fn kernel_timer_running(&self) -> bool {
        self.timer.is_running()
    }

    /// Starts timing every launch and cuBLAS call with a pair of CUDA events (the host's
    /// clock on the emulated device), until [`CudaDevice::stop_kernel_timer`].
    pub fn start_kernel_timer(&self) {
        self.timer.start();
    }

    /// Stops the kernel timer and returns the time of each kernel since it started,
    /// slowest first; waits for the device.
    pub fn stop_kernel_timer(&self) -> Result<Vec<KernelTime>> {
        if self.timer.is_running() {
            self.synchronize()?;
        }
        self.timer.stop()
    }

    /// Runs `queue` (which queues one launch or cuBLAS call of `name`) under the kernel
    /// timer when it runs.
    fn timed(&self, name: &'static str, family: &'static str, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        let stream = self.driver().map(|gpu| gpu.stream.as_ref());
        let span = self.timer.begin(stream, name, family)?;
        queue()?;
        self.timer.end(stream, span)
    }

    /// Counts and (under the kernel timer) times one cuBLAS call `name` of `kind`, doing
    /// `flops` over `bytes`, queued by `call`.
    pub(crate) fn cublas_call(
        &self,
        name: &'static str,
        kind: GemmKind,
        (flops, bytes): (u64, u64),
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.capture_role(name)?;
        self.counters.gemm(name, kind, flops, bytes);
        self.timed(name, "cublas", call)
    }

    /// The device address of `count` arrival counters (`u32`, all 0), for a kernel whose
    /// blocks add up their partial sums in the block that arrives last at a counter
    /// (`last_block_to_arrive`, common.cuh). Every such launch leaves its counters at 0 (the
    /// last block resets its own), so the launches of every kernel share one buffer: they
    /// never run at the same time, as the device queues all its work on one stream (the
    /// emulator runs one launch at a time). Made and zeroed at the first call, and again,
    /// larger, when a launch needs more counters than any before (so not in a steady state).
    pub(crate) fn arrival_counters(&self, count: usize) -> Result<u64> {
        let mut arrivals = self.arrivals.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if arrivals.as_ref().is_none_or(|buffer| buffer.len() < count) {
            *arrivals = Some(self.zeros(count.next_power_of_two().max(64))?);
        }
        Ok(arrivals.as_ref().map_or(0, DeviceBuffer::device_ptr))
    }

    /// Ends a training step for the caching allocator: the next step's buffers are placed
    /// where this step's same requests were, so a step that repeats the one before makes no
    /// driver allocation (`allocator.rs`). The optimizers call it as they clear gradients.
    pub fn end_step(&self) {
        self.allocator.end_step();
    }

    /// Returns the allocator's cached (unused) blocks to the driver.
    pub fn release_cached_memory(&self) {
        self.allocator.release_cached();
    }

    /// An uninitialised buffer of `len` elements (its contents are unspecified until written).
    pub fn alloc<T: DeviceScalar>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::new(&self.allocator, len)
    }

    /// A buffer of `len` zeros.
    pub fn zeros<T: DeviceScalar>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let mut buffer = self.alloc(len)?;
        self.fill_zero(&mut buffer)?;
        Ok(buffer)
    }

    /// Sets every element of `buffer` to zero (all-zero bits: 0.0 for the float types).
    pub fn fill_zero<T: DeviceScalar>(&self, buffer: &mut DeviceBuffer<T>) -> Result<()> {
        self.check_owner("fill_zero", buffer)?;
        if buffer.is_empty() {
            return Ok(());
        }
        self.capture_role("fill_zero")?;
        self.counters.memset(buffer.num_bytes());
        let Some(gpu) = self.driver() else {
            let (ptr, bytes) = (buffer.device_ptr(), buffer.num_bytes());
            // SAFETY: the emulated buffer's own host range (a replay checks it is still the
            // graph's before it runs).
            return self.emulate_here("fill_zero", vec![ptr], move || unsafe {
                std::ptr::write_bytes(ptr as *mut u8, 0, bytes)
            });
        };
        gpu.bind()?;
        // SAFETY: the address range is the buffer's own, and the memset is queued on the
        // stream that orders every use of it.
        unsafe { driver::memset_d8_async(buffer.device_ptr(), 0, buffer.num_bytes(), gpu.stream()) }
            .map_err(|e| CudaError::driver("cuMemsetD8Async", e))
    }

    /// A new device buffer holding a copy of `host`.
    pub fn upload<T: DeviceScalar>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buffer = self.alloc(host.len())?;
        self.copy_to_device(host, &mut buffer)?;
        Ok(buffer)
    }

    /// Copies `host` into `buffer` (equal lengths) through the pinned staging ring, in
    /// chunks of at most 4 MiB: queued, the host slice is free again on return.
    pub fn copy_to_device<T: DeviceScalar>(&self, host: &[T], buffer: &mut DeviceBuffer<T>) -> Result<()> {
        self.check_owner("copy_to_device", buffer)?;
        self.refuse_in_capture("copy_to_device")?;
        ensure(host.len() == buffer.len(), "copy_to_device", || {
            format!("host slice has {} elements, device buffer {}", host.len(), buffer.len())
        })?;
        // SAFETY: the device scalars are plain numbers without padding: their bytes are valid u8.
        let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, std::mem::size_of_val(host)) };
        let gpu = match self.driver() {
            Some(gpu) => {
                gpu.bind()?;
                Some(StagingStream { ctx: &gpu.ctx, stream: &gpu.stream })
            }
            None => None,
        };
        for (index, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
            self.counters.upload(chunk.len());
            // SAFETY: the chunk's destination lies inside the buffer (equal byte lengths,
            // checked above), and every later use of the buffer is queued on the same stream.
            let staged =
                unsafe { self.staging.copy(gpu.as_ref(), chunk, buffer.device_ptr() + (index * CHUNK_BYTES) as u64) }?;
            if staged.waited {
                self.counters.sync();
            }
        }
        Ok(())
    }

    /// The free slots of [`CudaDevice::read_later`].
    pub(crate) fn readback_slots(&self) -> &Arc<ReadbackSlots> {
        &self.readback
    }

    /// Counts a readback of `bytes` (a copy into page-locked host memory).
    pub(crate) fn count_readback(&self, bytes: usize) {
        self.counters.readback(bytes);
    }

    /// A host copy of `buffer` (waits for the queued work that writes it).
    pub fn download<T: DeviceScalar>(&self, buffer: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut host = vec![T::default(); buffer.len()];
        self.copy_to_host(buffer, &mut host)?;
        Ok(host)
    }

    /// Copies `buffer` into `host` (equal lengths), waiting for the queued work.
    pub fn copy_to_host<T: DeviceScalar>(&self, buffer: &DeviceBuffer<T>, host: &mut [T]) -> Result<()> {
        self.check_owner("copy_to_host", buffer)?;
        ensure(host.len() == buffer.len(), "copy_to_host", || {
            format!("host slice has {} elements, device buffer {}", host.len(), buffer.len())
        })?;
        if host.is_empty() {
            return Ok(());
        }
        self.refuse_in_capture("copy_to_host")?;
        self.counters.download(std::mem::size_of_val(host));
        let Some(gpu) = self.driver() else {
            self.counters.sync();
            // SAFETY: the emulated buffer's own host range of host.len() elements.
            unsafe { std::ptr::copy_nonoverlapping(buffer.device_ptr() as *const T, host.as_mut_ptr(), host.len()) };
            return Ok(());
        };
        gpu.bind()?;
        // SAFETY: the source is the buffer's own range; `host` stays borrowed until the
        // synchronize below has waited for the copy.
        unsafe { driver::memcpy_dtoh_async(host, buffer.device_ptr(), gpu.stream()) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))?;
        self.synchronize()
    }

    /// Copies `count` elements from `src[src_offset..]` to `dst[dst_offset..]` on the device.
    pub fn copy_within_device<T: DeviceScalar>(
        &self,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        dst: &mut DeviceBuffer<T>,
        dst_offset: usize,
        count: usize,
    ) -> Result<()> {
        self.check_owner("copy_within_device", src)?;
        self.check_owner("copy_within_device", dst)?;
        ensure(src_offset + count <= src.len() && dst_offset + count <= dst.len(), "copy_within_device", || {
            format!("range out of bounds (src {}, dst {}, count {count})", src.len(), dst.len())
        })?;
        if count == 0 {
            return Ok(());
        }
        let bytes = count * std::mem::size_of::<T>();
        self.capture_role("copy_within_device")?;
        self.counters.device_copy(bytes);
        let Some(gpu) = self.driver() else {
            let (from, to) = (src.ptr_at(src_offset), dst.ptr_at(dst_offset));
            // SAFETY: both ranges were checked against their (emulated, host) buffers above
            // (a replay checks they are still the graph's); `copy` allows them to overlap.
            return self.emulate_here("copy_within_device", vec![from, to], move || unsafe {
                std::ptr::copy(from as *const u8, to as *mut u8, bytes)
            });
        };
        gpu.bind()?;
        // SAFETY: both ranges were checked against their buffers above.
        unsafe { driver::memcpy_dtod_async(dst.ptr_at(dst_offset), src.ptr_at(src_offset), bytes, gpu.stream()) }
            .map_err(|e| CudaError::driver("cuMemcpyDtoDAsync", e))
    }

    /// Counts one NCCL collective over `bytes` (before the backend is chosen, like the rest);
    /// refused during a capture (collectives are not captured).
    #[cfg(feature = "nccl")]
    pub(crate) fn count_collective(&self, bytes: usize) -> Result<()> {
        self.refuse_in_capture("NCCL collective")?;
        self.counters.collective(bytes);
        Ok(())
    }

    /// Errors unless `buffer` was allocated by this device.
    pub(crate) fn check_owner<T: DeviceScalar>(&self, op: &'static str, buffer: &DeviceBuffer<T>) -> Result<()> {
        ensure(buffer.belongs_to(&self.allocator), op, || format!("{buffer:?} belongs to another device"))
    }

    /// Emulated memory work (a memset, a copy), run now or recorded by a capture.
    #[cfg(feature = "cuda-emu")]
    fn emulate_here(
        &self,
        name: &'static str,
        addresses: Vec<u64>,
        run: impl Fn() + Send + Sync + 'static,
    ) -> Result<()> {
        self.emulate(
            name,
            || addresses,
            move |_| {
                run();
                Ok(())
            },
        )
    }

    /// Without an emulator, there is no emulated work.
    #[cfg(not(feature = "cuda-emu"))]
    fn emulate_here(&self, name: &'static str, _addresses: Vec<u64>, _run: impl Fn()) -> Result<()> {
        Err(CudaError::Unavailable(format!("{name}: no driver and no emulated device")))
    }

    /// Launches kernel `name` of `family` with `args` (in the kernel's parameter order).
    pub(crate) fn launch(
        &self,
        family: KernelFamily,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return Ok(());
        }
        self.capture_role(name)?;
        let addresses = args.iter().flat_map(Arg::addresses);
        self.counters.kernel(name, self.allocator.bytes_referenced(addresses));
        self.timed(name, family.name(), || self.queue_launch(family, name, cfg, args))
    }

    /// Queues the launch on the GPU, or runs it on the emulator.
    fn queue_launch(&self, family: KernelFamily, name: &'static str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        #[allow(clippy::infallible_destructuring_match)] // one arm without feature cuda-emu
        let gpu = match &self.backend {
            Backend::Driver(gpu) => gpu,
            #[cfg(feature = "cuda-emu")]
            Backend::Emulated(_) => {
                let args = args.to_vec();
                let addresses = || args.iter().flat_map(Arg::addresses).collect();
                let run = {
                    let args = args.clone();
                    move |emulator: &super::emu::Emulator| {
                        super::emu::launch::launch(emulator, family, name, cfg, &args)
                    }
                };
                return self.emulate(name, addresses, run);
            }
        };
        let function: CudaFunction = gpu.kernels.function(&gpu.ctx, family, name)?;
        let mut builder = gpu.stream.launch_builder(&function);
        for arg in args {
            match arg {
                Arg::Ptr(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
                Arg::Dims(v) => builder.arg(v),
                Arg::Ptrs(v) => builder.arg(v),
                Arg::Lengths(v) => builder.arg(v),
                Arg::PtrTable(v) => builder.arg(&**v),
                Arg::LengthTable(v) => builder.arg(&**v),
            };
        }
        // SAFETY: every launcher checks buffer lengths and shapes against the kernel's
        // indexing before calling this, and passes arguments in the kernel's order with the
        // kernel's types (device addresses as u64, int, long long, float).
        unsafe { builder.launch(cfg) }.map(|_| ()).map_err(|e| CudaError::driver(format!("launch of {name}"), e))
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.capability;
        write!(f, "CudaDevice({}: {}, sm_{major}{minor})", self.label(), self.name)
    }
}
