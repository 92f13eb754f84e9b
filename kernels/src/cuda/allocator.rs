//! A caching allocator for device memory, so that a training step that asks for the same
//! buffer sizes as the previous one makes no driver allocation at all.
//!
//! Requests are rounded up to a size class (eight classes per power of two, so at most
//! 12.5 % is wasted; 256 bytes at least) and served from a free list per class. Dropping a
//! [`DeviceBuffer`] hands its block back to the free list instead of freeing it. Everything
//! runs on the device's single stream, so a block handed out again is only touched by work
//! queued after the work that used it before: no synchronisation is needed on reuse.
//!
//! When the driver reports out-of-memory, the cached blocks are released and the
//! allocation is tried once more.
//!
//! On the emulated device (feature `cuda-emu`) a block is host memory between guard pages
//! (`emu/memory.rs`); a buffer then sits at the end of its block, and every fresh or reused
//! block is poisoned, so out-of-bounds accesses and reads of unwritten memory show.
//!
//! A CUDA graph (`graph.rs`) gets a private pool of its own ([`GraphPool`]): while one host
//! thread runs a step in it, that thread's requests are served from the pool's free lists
//! and its blocks go back there, never to the shared lists, so no work outside the graph is
//! handed memory that a replay of the graph writes. During a capture a request the pool
//! cannot serve is an error, not a driver allocation (which the capture would record): the
//! step is run once in the pool first, which leaves every block the capture asks for free.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, ThreadId};

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::error::{CudaError, Result};

/// The smallest block handed out, in bytes (also the alignment every block keeps).
const MIN_BLOCK: usize = 256;
/// Size classes per power of two.
const CLASSES_PER_OCTAVE: usize = 8;

/// Counters of the caching allocator, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Blocks obtained from the driver (`cuMemAllocAsync`).
    pub allocations: u64,
    /// Requests served from a free list without touching the driver.
    pub reuses: u64,
    /// Bytes held from the driver: in use plus cached.
    pub reserved_bytes: usize,
    /// Bytes sitting in the free lists.
    pub cached_bytes: usize,
    /// Bytes of the blocks handed out and not yet given back (their size classes).
    pub in_use_bytes: usize,
    /// The most bytes ever in use at once: what the step needs, where `reserved_bytes` adds
    /// what the free lists held of other size classes.
    pub peak_in_use_bytes: usize,
}

impl AllocatorStats {
    /// Counts a block of `class` bytes handed out.
    fn hand_out(&mut self, class: usize) {
        self.in_use_bytes += class;
        self.peak_in_use_bytes = self.peak_in_use_bytes.max(self.in_use_bytes);
    }
}

/// The size class (bytes actually reserved) of a request for `bytes`.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(MIN_BLOCK);
    let octave = bytes.next_power_of_two();
    // Classes between octave/2 and octave are octave/16 apart: bytes > octave/2, so the
    // rounding adds less than bytes/8.
    let step = (octave / (2 * CLASSES_PER_OCTAVE)).max(MIN_BLOCK);
    bytes.div_ceil(step) * step
}

/// Where a block's bytes live.
enum Memory {
    /// GPU memory from the driver (freed when the slice drops).
    Device { _slice: CudaSlice<u8> },
    /// Host pages of the emulated device.
    #[cfg(feature = "cuda-emu")]
    Emulated(super::emu::memory::HostBlock),
}

/// One block of device memory and its raw address.
struct Block {
    memory: Memory,
    ptr: u64,
    class: usize,
    /// The graph pool the block belongs to; `None` for the shared free lists.
    pool: Option<u64>,
}

#[cfg(feature = "cuda-emu")]
impl Block {
    /// The block's address range: its first byte and its length.
    fn span(&self) -> (u64, usize) {
        match &self.memory {
            Memory::Device { .. } => (self.ptr, self.class),
            Memory::Emulated(host) => (host.start(), host.bytes()),
        }
    }
}

/// One graph's private pool: its free blocks by class, and (emulated) where all its blocks
/// lie, for the replay's check of the addresses it touches.
#[derive(Default)]
struct PrivatePool {
    free: HashMap<usize, Vec<Block>>,
    #[cfg(feature = "cuda-emu")]
    spans: Vec<(u64, usize)>,
}

/// The host thread whose requests a graph pool serves, and how.
struct PoolUser {
    thread: ThreadId,
    pool: u64,
    /// A capture is under way: a request the pool cannot serve is an error, and (on the
    /// emulated device) the poisoning of a reused block is recorded with the graph's work.
    capturing: bool,
    #[cfg(feature = "cuda-emu")]
    recording: Option<Arc<super::emu::recording::Recording>>,
}

struct PoolState {
    free: HashMap<usize, Vec<Block>>,
    /// The graph pools alive, by id.
    private: HashMap<u64, PrivatePool>,
    /// The thread a graph pool serves now, if any.
    user: Option<PoolUser>,
    next_pool: u64,
    /// The live buffers (address of element 0 → bytes), for the bytes a launch touches.
    live: BTreeMap<u64, usize>,
    stats: AllocatorStats,
}

impl PoolState {
    fn new() -> PoolState {
        PoolState {
            free: HashMap::new(),
            private: HashMap::new(),
            user: None,
            next_pool: 0,
            live: BTreeMap::new(),
            stats: AllocatorStats::default(),
        }
    }

    /// The live buffer (its first byte's address and its bytes) that `address` points into.
    fn live_buffer_at(&self, address: u64) -> Option<(u64, usize)> {
        let (&start, &bytes) = self.live.range(..=address).next_back()?;
        (address < start + bytes as u64).then_some((start, bytes))
    }

    /// The graph pool that serves the calling thread now, and whether it is capturing.
    fn pool_of_this_thread(&self) -> Option<&PoolUser> {
        self.user.as_ref().filter(|user| user.thread == thread::current().id())
    }
}

/// The per-device pool behind every [`DeviceBuffer`].
pub(crate) struct Allocator {
    /// The stream allocations are ordered on; `None` on the emulated device.
    stream: Option<Arc<CudaStream>>,
    state: Mutex<PoolState>,
}

impl Allocator {
    /// An empty pool allocating on `stream`.
    pub(crate) fn new(stream: Arc<CudaStream>) -> Allocator {
        Allocator { stream: Some(stream), state: Mutex::new(PoolState::new()) }
    }

    /// An empty pool of emulated device memory.
    #[cfg(feature = "cuda-emu")]
    pub(crate) fn emulated() -> Allocator {
        Allocator { stream: None, state: Mutex::new(PoolState::new()) }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding the lock leaves the lists consistent (every update is one
        // push or pop), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A block of at least `bytes`, from the free list when one of its class is cached (the
    /// graph pool's, when one serves this thread), and where a buffer of `bytes` starts in
    /// it (recorded as live under the same lock).
    fn take(&self, bytes: usize) -> Result<(Block, u64)> {
        let class = size_class(bytes);
        let pool = {
            let mut state = self.lock();
            let user = state.pool_of_this_thread();
            let (pool, capturing) = (user.map(|u| u.pool), user.is_some_and(|u| u.capturing));
            #[cfg(feature = "cuda-emu")]
            let recording = user.and_then(|u| u.recording.clone());
            let cached = match pool {
                Some(id) => state.private.get_mut(&id).and_then(|p| p.free.get_mut(&class)).and_then(Vec::pop),
                None => state.free.get_mut(&class).and_then(Vec::pop),
            };
            if let Some(block) = cached {
                state.stats.reuses += 1;
                state.stats.hand_out(class);
                if pool.is_none() {
                    state.stats.cached_bytes -= class;
                }
                let ptr = Allocator::place(&block, bytes);
                state.live.insert(ptr, bytes);
                drop(state);
                #[cfg(feature = "cuda-emu")]
                if let Memory::Emulated(host) = &block.memory {
                    host.poison();
                    // A replay poisons the block where the capture's step reused it, as an
                    // eager step would have.
                    if let Some(recording) = recording {
                        recording.poison(block.span());
                    }
                }
                return Ok((block, ptr));
            }
            if capturing {
                return Err(CudaError::Capture {
                    op: "device allocation",
                    message: format!(
                        "the graph's pool has no free block of {class} bytes: run the step once in the pool \
                         (CudaDevice::with_graph_pool) before capturing it, and drop what that run returned"
                    ),
                });
            }
            pool
        };
        let mut block = match &self.stream {
            Some(stream) => self.fresh_on_device(stream, class)?,
            None => self.fresh_emulated(class)?,
        };
        let ptr = Allocator::place(&block, bytes);
        let mut state = self.lock();
        state.stats.allocations += 1;
        state.stats.reserved_bytes += class;
        state.stats.hand_out(class);
        state.live.insert(ptr, bytes);
        // A pool dropped meanwhile (by another thread) leaves the block to the shared lists.
        if let Some(_private) = pool.and_then(|id| state.private.get_mut(&id)) {
            #[cfg(feature = "cuda-emu")]
            _private.spans.push(block.span());
            block.pool = pool;
        }
        Ok((block, ptr))
    }

    fn fresh_on_device(&self, stream: &Arc<CudaStream>, class: usize) -> Result<Block> {
        let fresh = || -> std::result::Result<Block, DriverError> {
            // SAFETY: the bytes are uninitialised; every user of a buffer writes before it
            // reads (or zeroes it explicitly), as the launchers document.
            let slice = unsafe { stream.alloc::<u8>(class) }?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(stream);
                ptr
            };
            Ok(Block { memory: Memory::Device { _slice: slice }, ptr, class, pool: None })
        };
        match fresh() {
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                self.release_cached();
                stream.synchronize().map_err(|e| CudaError::driver("synchronize after releasing the cache", e))?;
                fresh()
            }
            other => other,
        }
        .map_err(|e| CudaError::driver(format!("device allocation of {class} bytes"), e))
    }

    #[cfg(feature = "cuda-emu")]
    fn fresh_emulated(&self, class: usize) -> Result<Block> {
        let map = || super::emu::memory::HostBlock::map(class);
        let host = map()
            .or_else(|| {
                self.release_cached();
                map()
            })
            .ok_or_else(|| CudaError::Driver {
                context: format!("emulated device allocation of {class} bytes"),
                message: "out of host memory (mmap failed)".to_string(),
            })?;
        Ok(Block { ptr: host.start(), memory: Memory::Emulated(host), class, pool: None })
    }

    #[cfg(not(feature = "cuda-emu"))]
    fn fresh_emulated(&self, _class: usize) -> Result<Block> {
        Err(CudaError::Unavailable("this build has no emulated device (feature cuda-emu)".to_string()))
    }

    /// Where a buffer of `bytes` starts in `block`: its start on a GPU, its end (so that
    /// an access past it faults) on the emulated device.
    fn place(block: &Block, _bytes: usize) -> u64 {
        match &block.memory {
            Memory::Device { .. } => block.ptr,
            #[cfg(feature = "cuda-emu")]
            Memory::Emulated(host) => host.place(_bytes),
        }
    }

    /// Puts a block back on its free list (its graph pool's, while that pool lives); the
    /// buffer at `ptr` in it is no longer live.
    fn give_back(&self, mut block: Block, ptr: u64) {
        let mut state = self.lock();
        state.live.remove(&ptr);
        state.stats.in_use_bytes -= block.class;
        if let Some(private) = block.pool.and_then(|id| state.private.get_mut(&id)) {
            private.free.entry(block.class).or_default().push(block);
            return;
        }
        block.pool = None;
        state.stats.cached_bytes += block.class;
        state.free.entry(block.class).or_default().push(block);
    }

    /// A new, empty graph pool.
    pub(crate) fn new_pool(&self) -> u64 {
        let mut state = self.lock();
        let id = state.next_pool;
        state.next_pool += 1;
        state.private.insert(id, PrivatePool::default());
        id
    }

    /// Ends graph pool `id`: its free blocks join the shared free lists, and so will its
    /// blocks still in use when they are dropped.
    pub(crate) fn drop_pool(&self, id: u64) {
        let mut state = self.lock();
        let Some(private) = state.private.remove(&id) else { return };
        for mut block in private.free.into_values().flatten() {
            block.pool = None;
            state.stats.cached_bytes += block.class;
            state.free.entry(block.class).or_default().push(block);
        }
    }

    /// Serves the calling thread's requests from graph pool `id` until [`Allocator::leave_pool`]
    /// (`capturing`: refuse what the pool cannot serve; `recording`: where a capture on the
    /// emulated device records the poisoning of reused blocks). Errors when a pool already
    /// serves a thread.
    pub(crate) fn enter_pool(
        &self,
        id: u64,
        capturing: bool,
        #[cfg(feature = "cuda-emu")] recording: Option<Arc<super::emu::recording::Recording>>,
    ) -> Result<()> {
        let mut state = self.lock();
        if state.user.is_some() {
            return Err(CudaError::Capture {
                op: "graph pool",
                message: "a graph pool already serves a thread of this device: one step in a pool at a time"
                    .to_string(),
            });
        }
        if !state.private.contains_key(&id) {
            return Err(CudaError::Capture { op: "graph pool", message: format!("pool {id} does not exist") });
        }
        let thread = thread::current().id();
        #[cfg(feature = "cuda-emu")]
        let user = PoolUser { thread, pool: id, capturing, recording };
        #[cfg(not(feature = "cuda-emu"))]
        let user = PoolUser { thread, pool: id, capturing };
        state.user = Some(user);
        Ok(())
    }

    /// Serves the calling thread from the shared free lists again.
    pub(crate) fn leave_pool(&self) {
        self.lock().user = None;
    }

    /// The first of `ptrs` that lies neither in a live buffer nor in a block of graph pool
    /// `id`: memory a replay of that graph would touch after it was handed to someone else.
    #[cfg(feature = "cuda-emu")]
    pub(crate) fn outside_pool(&self, id: u64, ptrs: impl Iterator<Item = u64>) -> Option<u64> {
        let state = self.lock();
        let spans = state.private.get(&id).map_or(&[][..], |p| &p.spans[..]);
        let in_live = |p: u64| state.live_buffer_at(p).is_some();
        let in_pool = |p: u64| spans.iter().any(|&(start, bytes)| p >= start && p < start + bytes as u64);
        ptrs.into_iter().find(|&p| !in_live(p) && !in_pool(p))
    }

    /// Returns every cached block to the driver.
    pub(crate) fn release_cached(&self) {
        let blocks: Vec<Block> = {
            let mut state = self.lock();
            let released = state.stats.cached_bytes;
            state.stats.reserved_bytes -= released;
            state.stats.cached_bytes = 0;
            state.free.drain().flat_map(|(_, blocks)| blocks).collect()
        };
        // Dropping a CudaSlice frees it in stream order; the driver needs the context current
        // on this thread (a failure is recorded by cudarc and reported by the next check).
        if let Some(stream) = &self.stream {
            let _ = stream.context().bind_to_thread();
        }
        drop(blocks);
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> AllocatorStats {
        self.lock().stats
    }

    /// The bytes of the distinct live buffers that the addresses `ptrs` point into
    /// (addresses outside every buffer count nothing).
    pub(crate) fn bytes_referenced(&self, ptrs: impl Iterator<Item = u64>) -> u64 {
        let state = self.lock();
        let mut starts: Vec<(u64, usize)> = ptrs.filter_map(|p| state.live_buffer_at(p)).collect();
        starts.sort_unstable();
        starts.dedup();
        starts.iter().map(|&(_, bytes)| bytes as u64).sum()
    }
}

/// Element types a [`DeviceBuffer`] can hold.
pub trait DeviceScalar: Copy + Default + Send + Sync + 'static + private::Sealed {
    /// The type's name in messages.
    const NAME: &'static str;
}

impl DeviceScalar for f32 {
    const NAME: &'static str = "f32";
}

impl DeviceScalar for half::bf16 {
    const NAME: &'static str = "bf16";
}

impl DeviceScalar for u32 {
    const NAME: &'static str = "u32";
}

impl DeviceScalar for f64 {
    const NAME: &'static str = "f64";
}

mod private {
    /// Only the element types the kernels are written for.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u32 {}
    impl Sealed for f64 {}
}

/// A device array of `len` elements of `T`, owned, from the device's caching allocator.
///
/// Dropping it returns the memory to the allocator (not to the driver). Freshly allocated
/// contents are unspecified until written.
pub struct DeviceBuffer<T: DeviceScalar> {
    block: Option<Block>,
    /// Element 0's device address (0 when empty).
    ptr: u64,
    len: usize,
    allocator: Arc<Allocator>,
    _marker: PhantomData<T>,
}

impl<T: DeviceScalar> DeviceBuffer<T> {
    /// An uninitialised buffer of `len` elements.
    pub(crate) fn new(allocator: &Arc<Allocator>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| CudaError::shape("alloc", format!("{len} elements of {} overflow", T::NAME)))?;
        let (block, ptr) = if bytes == 0 {
            (None, 0)
        } else {
            let (block, ptr) = allocator.take(bytes)?;
            (Some(block), ptr)
        };
        #[cfg(feature = "cuda-emu")]
        if let Some(Block { memory: Memory::Emulated(host), .. }) = &block {
            super::emu::memory::register(host, ptr, len, std::mem::size_of::<T>(), T::NAME);
        }
        Ok(DeviceBuffer { block, ptr, len, allocator: Arc::clone(allocator), _marker: PhantomData })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the elements (not of the size class behind them).
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The raw device address of element 0 (0 for an empty buffer).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The raw device address of element `offset` (`offset ≤ len`).
    pub(crate) fn ptr_at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.len, "ptr_at: offset past the end");
        self.device_ptr() + (offset * std::mem::size_of::<T>()) as u64
    }

    /// Whether this buffer came from the allocator of `allocator`'s device.
    pub(crate) fn belongs_to(&self, allocator: &Arc<Allocator>) -> bool {
        Arc::ptr_eq(&self.allocator, allocator)
    }
}

/// A contiguous run of a buffer's elements, `len` of them from element `at`: part of a
/// buffer read as a whole one (a parameter's gradient inside a packed gradient buffer that
/// one product wrote for several parameters).
#[derive(Clone, Copy, Debug)]
pub struct DeviceRun<'a, T: DeviceScalar> {
    buffer: &'a DeviceBuffer<T>,
    at: usize,
    len: usize,
}

impl<'a, T: DeviceScalar> DeviceRun<'a, T> {
    /// Elements `at..at + len` of `buffer`; errors when they run past its end.
    pub fn new(buffer: &'a DeviceBuffer<T>, at: usize, len: usize) -> Result<DeviceRun<'a, T>> {
        if at.checked_add(len).is_none_or(|end| end > buffer.len()) {
            return Err(CudaError::shape(
                "device run",
                format!("elements {at}..{at}+{len} of a buffer of {}", buffer.len()),
            ));
        }
        Ok(DeviceRun { buffer, at, len })
    }

    /// The buffer it is part of.
    pub fn buffer(&self) -> &'a DeviceBuffer<T> {
        self.buffer
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of its first element.
    pub fn device_ptr(&self) -> u64 {
        self.buffer.ptr_at(self.at)
    }
}

impl<'a, T: DeviceScalar> From<&'a DeviceBuffer<T>> for DeviceRun<'a, T> {
    /// The whole buffer.
    fn from(buffer: &'a DeviceBuffer<T>) -> DeviceRun<'a, T> {
        DeviceRun { buffer, at: 0, len: buffer.len() }
    }
}

impl<T: DeviceScalar> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            #[cfg(feature = "cuda-emu")]
            if matches!(block.memory, Memory::Emulated(_)) {
                super::emu::memory::unregister(self.ptr);
            }
            self.allocator.give_back(block, self.ptr);
        }
    }
}

impl<T: DeviceScalar> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer<{}>[{}] at {:#x}", T::NAME, self.len, self.device_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(size_class(0), MIN_BLOCK);
        assert_eq!(size_class(1), MIN_BLOCK);
        assert_eq!(size_class(MIN_BLOCK + 1), 2 * MIN_BLOCK);
        for bytes in [1000, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 << 27] {
            let class = size_class(bytes);
            assert!(class >= bytes && class - bytes <= bytes / 8 + MIN_BLOCK, "{bytes} -> {class}");
            assert_eq!(class % MIN_BLOCK, 0);
            assert_eq!(size_class(class), class, "a class is its own class");
        }
    }
}
