//! Reuse of freed f32 buffers: the CPU counterpart of a GPU caching allocator.
//!
//! A training step allocates the same activation and gradient buffers, in the same sizes,
//! every step. Allocating them fresh costs a `calloc` each, and `calloc` must zero-fill
//! memory the allocator hands back (≈5 % of a llama-tiny step on two cores went to
//! `memset`), although most kernels overwrite every element anyway. So when a tensor's f32
//! storage is dropped its buffer comes back here, filed by length, and the next request of
//! that length takes it:
//! - [`buffer`] hands it out as it is (stale values), for outputs a kernel overwrites
//!   entirely (matmul, elementwise, norms, softmax, RoPE, attention);
//! - [`zeros`] zero-fills it first, for outputs a caller scatters into (the backward of
//!   a maximum, a sum whose result starts at 0).
//!
//! After the first step, a step's tensor buffers all come from the pool. Small buffers
//! (below [`MIN_POOLED_LEN`]) go straight to the allocator, and the pool holds at most
//! [`MAX_POOLED_BYTES`]: beyond that, freed buffers are released. [`release`] empties it,
//! and [`ReleaseOnDrop`] does so at the end of a scope whose shapes will not recur (each
//! training run and each generated token in the trainer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Buffers shorter than this (16 KiB) are cheap to allocate and are not kept.
pub const MIN_POOLED_LEN: usize = 4096;

/// The most memory the pool keeps (2 GiB).
pub const MAX_POOLED_BYTES: usize = 2 << 30;

/// Freed buffers by length, and their total size in bytes.
struct Pool {
    free: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

static POISON: AtomicBool = AtomicBool::new(false);

/// Testing aid: while on, every reused buffer [`buffer`] hands out is first filled with NaN,
/// so a kernel that reads an element it did not write yields NaN instead of a plausible
/// stale value (tests/tests/pool_reuse.rs). Off by default.
pub fn poison_reused_buffers(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

fn with_pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
    // A panic while the lock was held cannot leave the pool inconsistent (every update is a
    // single push or pop), so a poisoned lock is still usable.
    let mut guard = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    f(guard.get_or_insert_with(|| Pool { free: HashMap::new(), bytes: 0 }))
}

fn bytes_of(len: usize) -> usize {
    len * std::mem::size_of::<f32>()
}

/// A freed buffer of exactly `len` elements, if the pool holds one.
fn take(len: usize) -> Option<Vec<f32>> {
    if len < MIN_POOLED_LEN {
        return None;
    }
    with_pool(|pool| {
        let found = pool.free.get_mut(&len).and_then(Vec::pop);
        if found.is_some() {
            pool.bytes -= bytes_of(len);
        }
        found
    })
}

/// A buffer of `len` elements with unspecified (finite, stale) contents: for outputs the
/// caller overwrites entirely.
pub fn buffer(len: usize) -> Vec<f32> {
    match take(len) {
        Some(mut values) => {
            if POISON.load(Ordering::Relaxed) {
                values.fill(f32::NAN);
            }
            values
        }
        None => vec![0.0; len],
    }
}

/// A buffer of `len` zeros: for outputs the caller scatters or adds into. Only a reused buffer
/// is cleared; a new one comes zeroed from the allocator.
pub fn zeros(len: usize) -> Vec<f32> {
    match take(len) {
        Some(mut values) => {
            values.fill(0.0);
            values
        }
        None => vec![0.0; len],
    }
}

/// Takes back a buffer that is no longer used: what dropping f32 storage does, and what
/// callers do with scratch buffers they took with [`buffer`] or [`zeros`].
pub fn recycle(values: Vec<f32>) {
    let len = values.len();
    if len < MIN_POOLED_LEN || values.capacity() != len {
        return;
    }
    with_pool(|pool| {
        if pool.bytes + bytes_of(len) <= MAX_POOLED_BYTES {
            pool.bytes += bytes_of(len);
            pool.free.entry(len).or_default().push(values);
        }
    });
}

/// Frees every pooled buffer (for example after training, before a phase with other shapes).
pub fn release() {
    with_pool(|pool| {
        pool.free.clear();
        pool.bytes = 0;
    });
}

/// Empties the pool when dropped. For a phase whose buffer sizes will not come again: a
/// training run (the next run in the same process, as in `compare`, has other shapes), or
/// one token of text generation (the context grows by one token per step).
pub struct ReleaseOnDrop;

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers of exactly `len` elements the pool holds now.
    fn pooled_of_len(len: usize) -> usize {
        with_pool(|pool| pool.free.get(&len).map_or(0, Vec::len))
    }

    /// The pool is global and other tests free tensors into it while this one runs, so
    /// every check is on a length no other test uses, never on the pool's total.
    #[test]
    fn reuses_freed_buffers_by_length_and_zeroes_on_request() {
        let len = MIN_POOLED_LEN + 12_345;
        let mut values = buffer(len);
        values.fill(7.0);
        let address = values.as_ptr();
        recycle(values);
        assert_eq!(pooled_of_len(len), 1);
        let again = buffer(len);
        assert_eq!(again.as_ptr(), address, "the freed buffer is handed out again");
        assert_eq!(again[0], 7.0, "buffer() keeps stale contents");
        assert_eq!(pooled_of_len(len), 0);
        recycle(again);
        let zeroed = zeros(len);
        assert_eq!(zeroed.as_ptr(), address);
        assert!(zeroed.iter().all(|&v| v == 0.0), "zeros() clears a reused buffer");
        // Small buffers are not kept.
        recycle(vec![1.0; 8]);
        assert_eq!(pooled_of_len(8), 0);
        recycle(zeroed);
        assert_eq!(pooled_of_len(len), 1);
        release();
        assert_eq!(pooled_of_len(len), 0);
    }
}
