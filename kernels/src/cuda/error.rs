//! The one error type of the CUDA backend. Every launcher checks its arguments before it
//! launches and returns [`CudaError::Shape`] instead of panicking; driver, cuBLAS and NVRTC
//! failures carry the call that failed, and so do NCCL's.

use std::fmt;

/// What went wrong in the CUDA backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaError {
    /// No usable device: the driver library is missing, no GPU is visible, or a CUDA library
    /// (NVRTC, cuBLAS) could not be loaded. The string says which.
    Unavailable(String),
    /// A CUDA driver call failed.
    Driver {
        /// The operation that failed (e.g. `"cuMemAllocAsync of 4096 bytes"`).
        context: String,
        /// The driver's own message.
        message: String,
    },
    /// A cuBLAS call failed.
    Blas {
        /// The operation that failed.
        context: String,
        /// cuBLAS's status.
        message: String,
    },
    /// NVRTC could not compile a kernel family.
    Compile {
        /// The `.cu` file that failed.
        file: &'static str,
        /// The NVRTC compile log (the compiler's error messages).
        log: String,
    },
    /// The arguments of a launcher disagree with each other (lengths, shapes, limits).
    Shape {
        /// The launcher, e.g. `"rms_norm_forward"`.
        op: &'static str,
        /// What is wrong, naming the argument.
        message: String,
    },
    /// A kernel failed on the emulated device (out-of-bounds access, deadlock, a launch
    /// outside the driver's limits, ...).
    Emulated {
        /// The kernel.
        kernel: String,
        /// What went wrong, naming the block, thread, argument or offset where known.
        message: String,
    },
    /// An NCCL call failed (on the emulated device: the host collective behind it).
    Nccl {
        /// The call, e.g. `"ncclAllReduce of 1024 f32"`.
        call: String,
        /// NCCL's message (or the host collective's, naming the ranks involved).
        message: String,
    },
    /// Work a CUDA graph capture cannot take (a host wait, a copy from the host, a device
    /// allocation, another thread's work while the device captures), or a replay that
    /// cannot run; named by the call.
    Capture {
        /// The call that was refused, e.g. `"synchronize"`.
        op: &'static str,
        /// Why, and what to do instead.
        message: String,
    },
    /// A device-side check failed (e.g. a cross-entropy target out of range).
    Invalid {
        /// The launcher.
        op: &'static str,
        /// What the device reported.
        message: String,
    },
}

impl CudaError {
    /// A [`CudaError::Shape`] for `op`.
    pub fn shape(op: &'static str, message: impl Into<String>) -> CudaError {
        CudaError::Shape { op, message: message.into() }
    }

    /// A [`CudaError::Driver`] from a cudarc driver error.
    pub fn driver(context: impl Into<String>, error: impl fmt::Debug) -> CudaError {
        CudaError::Driver { context: context.into(), message: format!("{error:?}") }
    }

    /// A [`CudaError::Blas`] from a cudarc cuBLAS error.
    pub fn blas(context: impl Into<String>, error: impl fmt::Debug) -> CudaError {
        CudaError::Blas { context: context.into(), message: format!("{error:?}") }
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::Unavailable(why) => write!(f, "CUDA unavailable: {why}"),
            CudaError::Driver { context, message } => write!(f, "CUDA driver error in {context}: {message}"),
            CudaError::Blas { context, message } => write!(f, "cuBLAS error in {context}: {message}"),
            CudaError::Compile { file, log } => write!(f, "NVRTC failed to compile {file}:\n{log}"),
            CudaError::Shape { op, message } => write!(f, "{op}: {message}"),
            CudaError::Invalid { op, message } => write!(f, "{op}: {message}"),
            CudaError::Capture { op, message } => write!(f, "CUDA graph: {op}: {message}"),
            CudaError::Nccl { call, message } => write!(f, "NCCL error in {call}: {message}"),
            CudaError::Emulated { kernel, message } => write!(f, "kernel {kernel} on cuda:0 (emulated): {message}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// Result of the CUDA backend.
pub type Result<T> = std::result::Result<T, CudaError>;

/// Returns a [`CudaError::Shape`] from `op` unless `condition` holds.
pub(crate) fn ensure(condition: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if condition {
        Ok(())
    } else {
        Err(CudaError::shape(op, message()))
    }
}

/// Checks that a buffer named `name` holds exactly `want` elements.
pub(crate) fn ensure_len(op: &'static str, name: &str, got: usize, want: usize) -> Result<()> {
    ensure(got == want, op, || format!("{name} has {got} elements, expected {want}"))
}
