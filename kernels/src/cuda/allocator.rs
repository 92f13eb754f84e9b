//! A caching allocator for device memory, so that a training step that asks for the same
//! buffer sizes as the previous one makes no driver allocation at all.
//!
//! What it holds from the driver is a set of segments, and buffers are blocks inside them,
//! placed by best fit, split off and merged again when given back (`segments.rs`): the
//! bytes an activation gave back in the forward can hold a gradient of another size in the
//! backward. Dropping a [`DeviceBuffer`] hands its block back instead of freeing it.
//! Everything runs on the device's single stream, so a block handed out again is only
//! touched by work queued after the work that used it before: no synchronisation is needed
//! on reuse.
//!
//! When the driver reports out-of-memory, the segments with nothing in use are released and
//! the allocation is tried once more.
//!
//! On the emulated device (feature `cuda-emu`) the segments are bookkeeping alone (the same
//! placements, so the same counts as on a GPU), and each buffer gets host memory of its own
//! between guard pages (`emu/memory.rs`), from a cache of such blocks by size class; a
//! buffer sits at the end of its block, and every fresh or reused block is poisoned, so
//! out-of-bounds accesses and reads of unwritten memory show.
//!
//! A CUDA graph (`graph.rs`) gets a private pool of its own ([`GraphPool`]), segments of its
//! own: while one host thread runs a step in it, that thread's requests are placed in the
//! pool's segments, never in the shared ones, so no work outside the graph is handed memory
//! that a replay of the graph writes. During a capture a request the pool cannot place is
//! an error, not a driver allocation (which the capture would record), so the step runs in
//! the pool once first, and a pool places each run's requests where its last run placed
//! the same requests (same order, same sizes) when those bytes are free: the capture finds
//! every block where the run before found it. (Best fit alone would not promise that: the
//! first run placed its requests while the pool's segments were still being added.) The
//! shared arena does the same from one training step to the next once the optimizer marks
//! its steps ([`Allocator::end_step`]), so a steady-state step adds no segment.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, ThreadId};

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::error::{CudaError, Result};
use super::segments::{rounded, segment_bytes, Placement, Segments};

/// The smallest host block of the emulated device, in bytes.
#[cfg(feature = "cuda-emu")]
const MIN_HOST_BLOCK: usize = 256;
/// The emulated device's host block classes per power of two.
#[cfg(feature = "cuda-emu")]
const CLASSES_PER_OCTAVE: usize = 8;

/// Counters of the caching allocator, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Driver allocations: segments added.
    pub allocations: u64,
    /// Requests served from memory already held, without touching the driver.
    pub reuses: u64,
    /// Bytes held from the driver: in use plus cached.
    pub reserved_bytes: usize,
    /// The most bytes ever held from the driver at once (what `reserved_bytes` was before
    /// a release of the cache).
    pub peak_reserved_bytes: usize,
    /// Bytes of the segments' free blocks (graph pools' included).
    pub cached_bytes: usize,
    /// Bytes of the blocks handed out and not yet given back (as the blocks are rounded).
    pub in_use_bytes: usize,
    /// The most bytes ever in use at once: what the step needs, where `reserved_bytes` adds
    /// the free blocks too small or of the wrong kind for what was asked for.
    pub peak_in_use_bytes: usize,
}

/// The size class of an emulated host block for `bytes` (eight per power of two, so at
/// most 12.5 % is wasted): the host memory behind a buffer, not what the device counts.
#[cfg(feature = "cuda-emu")]
fn host_class(bytes: usize) -> usize {
    let bytes = bytes.max(MIN_HOST_BLOCK);
    let octave = bytes.next_power_of_two();
    // Classes between octave/2 and octave are octave/16 apart: bytes > octave/2, so the
    // rounding adds less than bytes/8.
    let step = (octave / (2 * CLASSES_PER_OCTAVE)).max(MIN_HOST_BLOCK);
    bytes.div_ceil(step) * step
}

/// One block of device memory: where it is placed in which arena (`pool`: a graph pool's
/// id, `None` for the shared one). Its bytes are its segment's driver memory on a GPU, and
/// on the emulated device host pages of the buffer's own (`host`).
struct Block {
    #[cfg(feature = "cuda-emu")]
    host: Option<super::emu::memory::HostBlock>,
    placement: Placement,
    pool: Option<u64>,
}

/// A segment's driver memory (on a GPU) and its first byte's address.
struct SegmentMemory {
    _slice: CudaSlice<u8>,
    base: u64,
}

/// Memory held for one user: the device's shared arena, or a graph pool. Its segments, their
/// driver memory and (emulated) the host blocks its buffers gave back, by class, and where
/// every host block it ever had lies, for the replay's check of the addresses it touches.
#[derive(Default)]
struct Arena {
    segments: Segments,
    memory: HashMap<u64, SegmentMemory>,
    /// Whether it repeats placements: a graph pool's runs, the shared arena's training
    /// steps (once [`Allocator::end_step`] has marked one).
    repeats: bool,
    /// The requests of its last run (rounded bytes) and where they went, and those of the
    /// run under way.
    last_run: Vec<(usize, Placement)>,
    this_run: Vec<(usize, Placement)>,
    #[cfg(feature = "cuda-emu")]
    host_blocks: HashMap<usize, Vec<super::emu::memory::HostBlock>>,
    #[cfg(feature = "cuda-emu")]
    spans: Vec<(u64, usize)>,
}

impl Arena {
    /// A graph pool's arena: it repeats its runs' placements.
    fn pool() -> Arena {
        Arena { repeats: true, ..Arena::default() }
    }

    /// Places a request for `bytes`: where the last run placed its request of the same
    /// index when that was of the same size and those bytes are free (when it repeats),
    /// else by best fit; `None` when no free block holds it.
    fn take(&mut self, bytes: usize) -> Option<Placement> {
        let wanted = rounded(bytes);
        let repeated = match self.last_run.get(self.this_run.len()) {
            Some(&(size, placement)) if self.repeats && size == wanted => self.segments.take_at(placement),
            _ => None,
        };
        let placement = repeated.or_else(|| self.segments.take(bytes))?;
        if self.repeats {
            self.this_run.push((wanted, placement));
        }
        Some(placement)
    }

    /// Ends a run: its placements are the ones the next run repeats.
    fn end_run(&mut self) {
        self.last_run = std::mem::take(&mut self.this_run);
    }

    /// Takes over `other`'s segments, their memory and its host blocks.
    fn absorb(&mut self, other: Arena) {
        self.segments.absorb(other.segments);
        self.memory.extend(other.memory);
        #[cfg(feature = "cuda-emu")]
        for (class, blocks) in other.host_blocks {
            self.host_blocks.entry(class).or_default().extend(blocks);
        }
    }
}

/// The host thread whose requests a graph pool serves, and how.
struct PoolUser {
    thread: ThreadId,
    pool: u64,
    /// A capture is under way: a request the pool cannot place is an error, and (on the
    /// emulated device) the poisoning of each block handed out is recorded with the graph's
    /// work.
    capturing: bool,
    #[cfg(feature = "cuda-emu")]
    recording: Option<Arc<super::emu::recording::Recording>>,
}

struct PoolState {
    shared: Arena,
    /// The graph pools alive, by id.
    private: HashMap<u64, Arena>,
    /// The thread a graph pool serves now, if any.
    user: Option<PoolUser>,
    next_pool: u64,
    /// Segment ids, unique across every arena (a pool's segments join the shared ones when
    /// the pool ends).
    next_segment: u64,
    /// The live buffers (address of element 0 → bytes), for the bytes a launch touches.
    live: BTreeMap<u64, usize>,
    stats: AllocatorStats,
}

impl PoolState {
    fn new() -> PoolState {
        PoolState {
            shared: Arena::default(),
            private: HashMap::new(),
            user: None,
            next_pool: 0,
            next_segment: 0,
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

    /// Graph pool `pool`'s arena while it lives, else the shared one.
    fn arena(&mut self, pool: Option<u64>) -> &mut Arena {
        match pool.and_then(|id| self.private.get_mut(&id)) {
            Some(arena) => arena,
            None => &mut self.shared,
        }
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

    /// A block of at least `bytes`, placed in the arena that serves this thread (a graph
    /// pool's, when one does), and where a buffer of `bytes` starts in it (recorded as live
    /// under the same lock). A segment is added when no free block holds the request.
    fn take(&self, bytes: usize) -> Result<(Block, u64)> {
        let mut state = self.lock();
        let user = state.pool_of_this_thread();
        let (pool, capturing) = (user.map(|u| u.pool), user.is_some_and(|u| u.capturing));
        #[cfg(feature = "cuda-emu")]
        let recording = user.and_then(|u| u.recording.clone());
        let placement = match state.arena(pool).take(bytes) {
            Some(placement) => {
                state.stats.reuses += 1;
                placement
            }
            None if capturing => {
                return Err(CudaError::Capture {
                    op: "device allocation",
                    message: format!(
                        "the graph's pool has no free block for {bytes} bytes: run the step once in the pool \
                         (CudaDevice::with_graph_pool) before capturing it, and drop what that run returned"
                    ),
                });
            }
            None => {
                let segment = segment_bytes(bytes);
                let memory = match &self.stream {
                    Some(stream) => {
                        drop(state);
                        let memory = self.driver_memory(stream, segment)?;
                        state = self.lock();
                        Some(memory)
                    }
                    None => None,
                };
                let id = state.next_segment;
                state.next_segment += 1;
                state.stats.allocations += 1;
                state.stats.reserved_bytes += segment;
                state.stats.peak_reserved_bytes = state.stats.peak_reserved_bytes.max(state.stats.reserved_bytes);
                let arena = state.arena(pool);
                arena.segments.add(id, bytes);
                if let Some((slice, base)) = memory {
                    arena.memory.insert(id, SegmentMemory { _slice: slice, base });
                }
                arena.take(bytes).expect("a segment added for a request holds it")
            }
        };
        // The arena the block was placed in (a pool dropped by another thread meanwhile has
        // handed its segments to the shared arena).
        let pool = pool.filter(|id| state.private.contains_key(id));
        let (_host, ptr) = match state.arena(pool).memory.get(&placement.segment) {
            // A GPU: the buffer starts where its block does.
            Some(segment) => (None, segment.base + placement.offset as u64),
            None => {
                let memory = self.emulated_memory(state, placement, pool, bytes);
                state = self.lock();
                match memory {
                    Ok((host, ptr)) => (Some(host), ptr),
                    Err(e) => {
                        state.arena(pool).segments.give_back(placement);
                        return Err(e);
                    }
                }
            }
        };
        let block = Block {
            #[cfg(feature = "cuda-emu")]
            host: _host,
            placement,
            pool,
        };
        state.stats.in_use_bytes += placement.bytes;
        state.stats.peak_in_use_bytes = state.stats.peak_in_use_bytes.max(state.stats.in_use_bytes);
        state.live.insert(ptr, bytes);
        drop(state);
        #[cfg(feature = "cuda-emu")]
        if let (Some(recording), Some(host)) = (recording, &block.host) {
            // A replay poisons the block where the capture's step was handed it, as an eager
            // step would have.
            recording.poison((host.start(), host.bytes()));
        }
        Ok((block, ptr))
    }

    /// Driver memory of `bytes` and its address; on out-of-memory, the segments with
    /// nothing in use are released and the allocation is tried once more.
    fn driver_memory(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<(CudaSlice<u8>, u64)> {
        let fresh = || -> std::result::Result<(CudaSlice<u8>, u64), DriverError> {
            // SAFETY: the bytes are uninitialised; every user of a buffer writes before it
            // reads (or zeroes it explicitly), as the launchers document.
            let slice = unsafe { stream.alloc::<u8>(bytes) }?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(stream);
                ptr
            };
            Ok((slice, ptr))
        };
        match fresh() {
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                self.release_cached();
                stream.synchronize().map_err(|e| CudaError::driver("synchronize after releasing the cache", e))?;
                fresh()
            }
            other => other,
        }
        .map_err(|e| CudaError::driver(format!("device allocation of {bytes} bytes"), e))
    }

    /// Emulated memory for a block placed at `placement` in `pool`'s arena, poisoned: a
    /// host block of its class the arena's buffers gave back, else a new mapping (the lock
    /// is released first: mapping may release the cache); and where a buffer of `bytes`
    /// starts in it: at its end, so that an access past the buffer faults.
    #[cfg(feature = "cuda-emu")]
    fn emulated_memory(
        &self,
        mut state: MutexGuard<'_, PoolState>,
        placement: Placement,
        pool: Option<u64>,
        bytes: usize,
    ) -> Result<(super::emu::memory::HostBlock, u64)> {
        use super::emu::memory::HostBlock;
        let class = host_class(placement.bytes);
        if let Some(host) = state.arena(pool).host_blocks.get_mut(&class).and_then(Vec::pop) {
            drop(state);
            host.poison();
            let ptr = host.place(bytes);
            return Ok((host, ptr));
        }
        drop(state);
        let host = HostBlock::map(class)
            .or_else(|| {
                self.release_cached();
                HostBlock::map(class)
            })
            .ok_or_else(|| CudaError::Driver {
                context: format!("emulated device allocation of {class} bytes"),
                message: "out of host memory (mmap failed)".to_string(),
            })?;
        if pool.is_some() {
            self.lock().arena(pool).spans.push((host.start(), host.bytes()));
        }
        let ptr = host.place(bytes);
        Ok((host, ptr))
    }

    /// Without the emulator every segment has driver memory, so this is never reached (and
    /// no host block type exists to return).
    #[cfg(not(feature = "cuda-emu"))]
    fn emulated_memory(
        &self,
        _state: MutexGuard<'_, PoolState>,
        _at: Placement,
        _pool: Option<u64>,
        _bytes: usize,
    ) -> Result<(std::convert::Infallible, u64)> {
        Err(CudaError::Unavailable("this build has no emulated device (feature cuda-emu)".to_string()))
    }

    /// Puts a block back into its segment, merged with its free neighbours (the shared
    /// arena's, when its graph pool has ended); the buffer at `ptr` in it is no longer live.
    fn give_back(&self, block: Block, ptr: u64) {
        let mut state = self.lock();
        state.live.remove(&ptr);
        state.stats.in_use_bytes -= block.placement.bytes;
        let arena = state.arena(block.pool);
        arena.segments.give_back(block.placement);
        #[cfg(feature = "cuda-emu")]
        if let Some(host) = block.host {
            arena.host_blocks.entry(host_class(block.placement.bytes)).or_default().push(host);
        }
    }

    /// A new, empty graph pool.
    pub(crate) fn new_pool(&self) -> u64 {
        let mut state = self.lock();
        let id = state.next_pool;
        state.next_pool += 1;
        state.private.insert(id, Arena::pool());
        id
    }

    /// Ends graph pool `id`: its segments join the shared arena, with their free blocks and
    /// the blocks still in use, which are given back there.
    pub(crate) fn drop_pool(&self, id: u64) {
        let mut state = self.lock();
        if let Some(arena) = state.private.remove(&id) {
            state.shared.absorb(arena);
        }
    }

    /// Serves the calling thread's requests from graph pool `id` until [`Allocator::leave_pool`]
    /// (`capturing`: refuse what the pool cannot place; `recording`: where a capture on the
    /// emulated device records the poisoning of the blocks it is handed). Errors when a pool already
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
        if let Some(arena) = state.private.get_mut(&id) {
            arena.this_run.clear();
        }
        Ok(())
    }

    /// Serves the calling thread from the shared arena again; the pool's run ends (its
    /// placements are the ones the next run repeats).
    pub(crate) fn leave_pool(&self) {
        let mut state = self.lock();
        let Some(user) = state.user.take() else { return };
        if let Some(arena) = state.private.get_mut(&user.pool) {
            arena.end_run();
        }
    }

    /// Ends a training step in the shared arena: the next step's requests are placed where
    /// this step placed the same requests (same order, same sizes) while those bytes are
    /// free, so a step that repeats the one before adds no segment (best fit alone, starting
    /// from memory the step before left free, may place them otherwise and need one more).
    pub(crate) fn end_step(&self) {
        let mut state = self.lock();
        state.shared.repeats = true;
        state.shared.end_run();
    }

    /// The first of `ptrs` that lies neither in a live buffer nor in a block of graph pool
    /// `id`: memory a replay of that graph would touch after it was handed to someone else.
    #[cfg(feature = "cuda-emu")]
    pub(crate) fn outside_pool(&self, id: u64, ptrs: impl Iterator<Item = u64>) -> Option<u64> {
        let state = self.lock();
        let spans = state.private.get(&id).map_or(&[][..], |arena| &arena.spans[..]);
        let in_live = |p: u64| state.live_buffer_at(p).is_some();
        let in_pool = |p: u64| spans.iter().any(|&(start, bytes)| p >= start && p < start + bytes as u64);
        ptrs.into_iter().find(|&p| !in_live(p) && !in_pool(p))
    }

    /// Returns the shared segments with nothing in use to the driver (and, emulated, the
    /// host blocks the shared buffers gave back to the host). Graph pools keep theirs.
    pub(crate) fn release_cached(&self) {
        let (memory, _host) = {
            let mut state = self.lock();
            let released = state.shared.segments.remove_free_segments();
            state.stats.reserved_bytes -= released.iter().map(|&(_, bytes)| bytes).sum::<usize>();
            let shared = &mut state.shared;
            let memory: Vec<SegmentMemory> = released.iter().filter_map(|(id, _)| shared.memory.remove(id)).collect();
            #[cfg(feature = "cuda-emu")]
            let host: Vec<_> = shared.host_blocks.drain().flat_map(|(_, blocks)| blocks).collect();
            #[cfg(not(feature = "cuda-emu"))]
            let host = ();
            (memory, host)
        };
        // Dropping a CudaSlice frees it in stream order; the driver needs the context current
        // on this thread (a failure is recorded by cudarc and reported by the next check).
        if let Some(stream) = &self.stream {
            let _ = stream.context().bind_to_thread();
        }
        drop(memory);
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> AllocatorStats {
        let state = self.lock();
        let pools: usize = state.private.values().map(|arena| arena.segments.free_bytes()).sum();
        AllocatorStats { cached_bytes: state.shared.segments.free_bytes() + pools, ..state.stats }
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
        if let Some(Block { host: Some(host), .. }) = &block {
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
            if block.host.is_some() {
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

    /// One run of a step in an arena: 20 MiB for a while, then two of 12 MiB at once.
    fn run(arena: &mut Arena, next_segment: &mut u64) -> Vec<Placement> {
        let mut take = |arena: &mut Arena, bytes: usize| {
            arena.take(bytes).unwrap_or_else(|| {
                arena.segments.add(*next_segment, bytes);
                *next_segment += 1;
                arena.take(bytes).expect("a new segment holds it")
            })
        };
        let first = take(arena, 20 << 20);
        arena.segments.give_back(first);
        let (second, third) = (take(arena, 12 << 20), take(arena, 12 << 20));
        arena.segments.give_back(second);
        arena.segments.give_back(third);
        arena.end_run();
        vec![first, second, third]
    }

    #[test]
    fn a_pool_repeats_its_last_runs_placements() {
        let mut next_segment = 0;
        let (mut pool, mut best_fit) = (Arena::pool(), Arena::default());
        let placed = run(&mut pool, &mut next_segment);
        assert_eq!(run(&mut pool, &mut next_segment), placed, "the second run repeats the first");
        // Best fit alone moves the first 12 MiB into the 12 MiB segment the first run added
        // after placing it.
        let first = run(&mut best_fit, &mut next_segment);
        let again = run(&mut best_fit, &mut next_segment);
        assert_ne!(again[1].segment, first[1].segment);
    }

    #[cfg(feature = "cuda-emu")]
    #[test]
    fn host_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(host_class(0), MIN_HOST_BLOCK);
        assert_eq!(host_class(1), MIN_HOST_BLOCK);
        assert_eq!(host_class(MIN_HOST_BLOCK + 1), 2 * MIN_HOST_BLOCK);
        for bytes in [1000, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 << 27] {
            let class = host_class(bytes);
            assert!(class >= bytes && class - bytes <= bytes / 8 + MIN_HOST_BLOCK, "{bytes} -> {class}");
            assert_eq!(class % MIN_HOST_BLOCK, 0);
            assert_eq!(host_class(class), class, "a class is its own class");
        }
    }
}
