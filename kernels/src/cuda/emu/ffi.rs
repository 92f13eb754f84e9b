//! The C ABI between the Rust side of the emulator and runtime.cpp / the generated kernel
//! tables (kernels/build.rs).

use std::ffi::{c_char, c_void, CStr};

/// A kernel's trampoline: unpacks the argument list and calls the kernel for the running
/// fiber's thread.
pub(crate) type Trampoline = unsafe extern "C" fn(*mut *mut c_void);

/// One kernel of a family's table (`TpKernel` in cuda_emu.h).
#[repr(C)]
pub(crate) struct TpKernel {
    name: *const c_char,
    trampoline: Trampoline,
    signature: unsafe extern "C" fn() -> *const c_char,
    params: *const c_char,
}

impl TpKernel {
    /// The kernel's name.
    pub(crate) fn name(&self) -> &'static str {
        // SAFETY: the generated table holds string literals.
        unsafe { CStr::from_ptr(self.name) }.to_str().unwrap_or("?")
    }

    /// The kernel's trampoline.
    pub(crate) fn trampoline(&self) -> Trampoline {
        self.trampoline
    }

    /// One letter per parameter: `p` pointer, `i` int, `l` long long, `f` float, `d` dims.
    pub(crate) fn signature(&self) -> &'static str {
        // SAFETY: the function returns a static NUL-terminated array.
        unsafe { CStr::from_ptr((self.signature)()) }.to_str().unwrap_or("?")
    }

    /// The parameter names, in order, as written in the `.cu` source.
    pub(crate) fn params(&self) -> Vec<&'static str> {
        // SAFETY: the generated table holds string literals.
        unsafe { CStr::from_ptr(self.params) }.to_str().unwrap_or("").split(',').collect()
    }
}

/// CUDA's `dim3`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

/// What ended a block early (`TpBlockError` in runtime.cpp).
#[repr(C)]
pub(crate) struct TpBlockError {
    pub kind: i32,
    pub is_write: i32,
    pub address: u64,
    pub thread: Dim3,
    pub message: [c_char; 512],
}

impl TpBlockError {
    /// An empty report for tp_emu_run_block to fill in.
    pub(crate) fn new() -> TpBlockError {
        TpBlockError { kind: 0, is_write: 0, address: 0, thread: Dim3 { x: 0, y: 0, z: 0 }, message: [0; 512] }
    }

    /// The runtime's message.
    pub(crate) fn message(&self) -> String {
        let bytes: Vec<u8> = self.message.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// `TpBlockError::kind` values.
pub(crate) mod kind {
    pub const FAULT: i32 = 1;
    pub const TRAP: i32 = 2;
    pub const DEADLOCK: i32 = 3;
    pub const COLLECTIVE: i32 = 4;
    pub const STACK_OVERFLOW: i32 = 5;
    pub const SHARED_OVERFLOW: i32 = 6;
}

extern "C" {
    /// Runs one block of a launch (see runtime.cpp); returns 0 or the error kind.
    pub(crate) fn tp_emu_run_block(
        kernel: Trampoline,
        args: *mut *mut c_void,
        grid: Dim3,
        block: Dim3,
        block_index: Dim3,
        dynamic_shared_bytes: usize,
        order: i32,
        seed: u64,
        error: *mut TpBlockError,
    ) -> i32;
    /// `bytes` (a page multiple) of zeroed memory between two guard pages, or null.
    pub(crate) fn tp_emu_map(bytes: usize) -> *mut c_void;
    /// Unmaps a block of `tp_emu_map`.
    pub(crate) fn tp_emu_unmap(start: *mut c_void, bytes: usize);
    /// The page (and guard) size.
    pub(crate) fn tp_emu_page_bytes() -> usize;
}

include!(concat!(env!("OUT_DIR"), "/emu_tables.rs"));
