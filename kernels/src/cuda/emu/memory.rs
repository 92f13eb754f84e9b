//! Emulated device memory: host pages between guard pages, and the registry of live buffers
//! that turns a faulting address into "element 1024 of argument `y`".
//!
//! Each allocator block is its own mapping with a guard page on either side. A buffer sits
//! at the *end* of its block (rounded to 16 bytes, the widest vector access of the kernels),
//! so reading or writing one element past it faults at once when its size is a multiple of
//! 16 bytes; the few bytes of padding otherwise, and 64 bytes before the buffer, are poison
//! (0xff) that [`check_canaries`] verifies after each launch. Fresh and reused blocks are
//! poisoned whole, so a kernel that reads memory nobody wrote sees NaN (f32, bf16) rather
//! than a plausible zero.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::ffi::{tp_emu_map, tp_emu_page_bytes, tp_emu_unmap};

/// The byte that fills memory no one has written.
pub(crate) const POISON: u8 = 0xff;
/// Alignment of a buffer's start (the kernels' widest access is 16 bytes).
const ALIGN: usize = 16;
/// Poisoned bytes checked before each buffer.
const CANARY_BEFORE: usize = 64;

/// One allocator block of emulated device memory (unmapped on drop).
pub(crate) struct HostBlock {
    start: u64,
    bytes: usize,
}

// SAFETY: the block is plain memory owned by this value; the allocator hands it to one
// buffer at a time.
unsafe impl Send for HostBlock {}
unsafe impl Sync for HostBlock {}

impl HostBlock {
    /// A block of at least `bytes`, poisoned; `None` when the mapping fails.
    pub(crate) fn map(bytes: usize) -> Option<HostBlock> {
        // SAFETY: plain FFI calls; a null return is checked.
        let page = unsafe { tp_emu_page_bytes() };
        let bytes = bytes.div_ceil(page).max(1) * page;
        let start = unsafe { tp_emu_map(bytes) };
        if start.is_null() {
            return None;
        }
        let block = HostBlock { start: start as u64, bytes };
        block.poison();
        Some(block)
    }

    /// The block's first byte (its device address).
    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    /// The block's length in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Fills the whole block with [`POISON`].
    pub(crate) fn poison(&self) {
        // SAFETY: the block's own mapped range.
        unsafe { std::ptr::write_bytes(self.start as *mut u8, POISON, self.bytes) };
    }

    /// Where a buffer of `bytes` starts: as late as its alignment allows.
    pub(crate) fn place(&self, bytes: usize) -> u64 {
        self.start + (self.bytes - bytes.div_ceil(ALIGN) * ALIGN) as u64
    }

    /// One past the block's last byte.
    fn end(&self) -> u64 {
        self.start + self.bytes as u64
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        // SAFETY: the range came from tp_emu_map and no buffer uses it any more.
        unsafe { tp_emu_unmap(self.start as *mut c_void, self.bytes) };
    }
}

/// A live buffer of emulated memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LiveBuffer {
    /// First element.
    pub ptr: u64,
    /// Bytes of the elements.
    pub bytes: usize,
    /// Element type name (`f32`, `bf16`, ...).
    pub type_name: &'static str,
    /// Bytes of one element.
    pub elem_bytes: usize,
    block_start: u64,
    block_end: u64,
}

impl LiveBuffer {
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.bytes / self.elem_bytes.max(1)
    }

    /// `f32[1024]`.
    pub(crate) fn describe(&self) -> String {
        format!("{}[{}]", self.type_name, self.len())
    }

    /// Whether `address` is in the buffer's block or the guard pages around it.
    fn near(&self, address: u64, page: u64) -> bool {
        address + page >= self.block_start && address < self.block_end + page
    }

    /// Whether `[address, address + bytes)` lies inside the buffer's elements.
    pub(crate) fn holds(&self, address: u64, bytes: usize) -> bool {
        address >= self.ptr && address + bytes as u64 <= self.ptr + self.bytes as u64
    }
}

fn registry() -> MutexGuard<'static, BTreeMap<u64, LiveBuffer>> {
    static LIVE: OnceLock<Mutex<BTreeMap<u64, LiveBuffer>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(BTreeMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// Records a buffer of `len` elements of `type_name` at `ptr` in `block`.
pub(crate) fn register(block: &HostBlock, ptr: u64, len: usize, elem_bytes: usize, type_name: &'static str) {
    let buffer = LiveBuffer {
        ptr,
        bytes: len * elem_bytes,
        type_name,
        elem_bytes,
        block_start: block.start,
        block_end: block.end(),
    };
    registry().insert(ptr, buffer);
}

/// Records `buffer` again unless a buffer is live at its address; whether it did. A graph
/// replay revives the buffers its captured work touched, which its step has dropped since,
/// for as long as that work runs, so the checks of a launch see them as the capture did.
pub(crate) fn revive(buffer: LiveBuffer) -> bool {
    let mut live = registry();
    if live.contains_key(&buffer.ptr) {
        return false;
    }
    live.insert(buffer.ptr, buffer);
    true
}

/// Forgets the buffer at `ptr`.
pub(crate) fn unregister(ptr: u64) {
    registry().remove(&ptr);
}

/// The live buffer whose elements contain `address`.
pub(crate) fn containing(address: u64) -> Option<LiveBuffer> {
    let live = registry();
    let (_, buffer) = live.range(..=address).next_back()?;
    (address < buffer.ptr + buffer.bytes.max(1) as u64).then_some(*buffer)
}

/// The live buffer whose block or guard pages contain `address` (for a fault's report).
pub(crate) fn nearest(address: u64) -> Option<LiveBuffer> {
    // SAFETY: plain FFI call.
    let page = unsafe { tp_emu_page_bytes() } as u64;
    registry().values().find(|b| b.near(address, page)).copied()
}

/// A corrupted canary of `buffer`: the byte offset (relative to the buffer's start, negative
/// before it) of the first written poison byte, if any.
pub(crate) fn check_canaries(buffer: &LiveBuffer) -> Option<i64> {
    let end = buffer.ptr + buffer.bytes as u64;
    let padded_end = buffer.ptr + (buffer.bytes.div_ceil(ALIGN) * ALIGN) as u64;
    let before = buffer.ptr.saturating_sub(CANARY_BEFORE as u64).max(buffer.block_start);
    let read = |from: u64, to: u64| -> Option<u64> {
        (from..to).find(|&a| {
            // SAFETY: [from, to) lies inside the buffer's mapped block.
            unsafe { *(a as *const u8) != POISON }
        })
    };
    if let Some(a) = read(end, padded_end.min(buffer.block_end)) {
        return Some((a - buffer.ptr) as i64);
    }
    read(before, buffer.ptr).map(|a| a as i64 - buffer.ptr as i64)
}
