//! Per-thread scratch buffers for the temporary tiles a kernel needs inside one task (a
//! block of gate logits, say), so a parallel pass over many small blocks does not allocate
//! and zero-fill a fresh buffer per block.
//!
//! Each thread keeps a small stack of buffers: [`with_scratch`] lends the top one (grown
//! when too short) for the duration of a closure and takes it back afterwards, so nested
//! calls get distinct buffers. The contents are stale: callers overwrite before reading.

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a buffer of exactly `len` elements whose contents are unspecified.
pub fn with_scratch<T>(len: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
    let mut buffer = SCRATCH.with(|stack| stack.borrow_mut().pop()).unwrap_or_default();
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    let result = f(&mut buffer[..len]);
    SCRATCH.with(|stack| stack.borrow_mut().push(buffer));
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_calls_get_distinct_buffers_and_buffers_are_reused() {
        let outer_address = with_scratch(100, |outer| {
            outer.fill(1.0);
            with_scratch(50, |inner| {
                inner.fill(2.0);
                assert_ne!(inner.as_ptr(), outer.as_ptr());
            });
            assert!(outer.iter().all(|&v| v == 1.0), "the inner buffer did not alias the outer");
            outer.as_ptr()
        });
        let again = with_scratch(80, |buffer| buffer.as_ptr());
        assert_eq!(again, outer_address, "the buffer was kept for the next call");
    }
}
