//! How freed tensor memory goes back to the allocator.
//!
//! A training step allocates and frees the same multi-megabyte activation and gradient
//! buffers every step. glibc's defaults hand such buffers back to the kernel when they are
//! freed (`munmap` above a size threshold, heap trimming below it), so the next step
//! page-faults every page back in and the kernel zeroes it: about 15 % of a llama-tiny step
//! on two cores went to page faults. The first tensor created switches glibc to keep freed
//! memory in the process for reuse, the role PyTorch's caching allocator plays on the GPU.
//! Peak memory is unchanged (the buffers were in use at the peak anyway); resident memory
//! no longer shrinks between steps.
//!
//! Other platforms and allocators keep their defaults.

use std::sync::Once;

static CONFIGURE: Once = Once::new();

/// Applies the allocator settings once per process (cheap after the first call).
pub(crate) fn keep_freed_memory() {
    CONFIGURE.call_once(configure);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn configure() {
    use std::os::raw::c_int;
    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    // glibc <malloc.h>: M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3.
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_THRESHOLD: c_int = -3;
    // Blocks up to 32 MiB (glibc's maximum) come from the heap instead of their own mapping;
    // up to 1 GiB of free memory at the heap top stays mapped.
    const MMAP_THRESHOLD: c_int = 32 << 20;
    const TRIM_THRESHOLD: c_int = 1 << 30;
    // SAFETY: mallopt only changes allocator tunables; it is thread-safe and the values are
    // within the ranges glibc documents (it returns 0 and changes nothing otherwise).
    unsafe {
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn configure() {}
