//! Errors of tensor operations. Every message names the op and the shapes involved.

/// What went wrong in a tensor operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Two operands whose shapes do not fit together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} do not match")]
    ShapeMismatch { op: &'static str, lhs: Vec<usize>, rhs: Vec<usize> },
    /// One operand whose shape the op cannot take.
    #[error("{op}: invalid shape {shape:?}: {reason}")]
    InvalidShape { op: &'static str, shape: Vec<usize>, reason: String },
    /// An axis outside `0..rank`.
    #[error("{op}: axis {axis} out of range for a tensor of rank {rank}")]
    AxisOutOfRange { op: &'static str, axis: usize, rank: usize },
    /// An index (token id, target, position) outside its range.
    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange { op: &'static str, index: usize, size: usize },
    /// The op computes in f32 only; convert with `to_dtype` first.
    #[error("{op}: needs dtype {expected:?}, got {got:?}")]
    DTypeMismatch { op: &'static str, expected: crate::DType, got: crate::DType },
    /// The op has no implementation on this device (yet).
    #[error("{op}: not available on device {device:?}")]
    UnsupportedDevice { op: &'static str, device: crate::Device },
    /// Operands on different devices (move one with `to_device` first).
    #[error("{op}: operands on different devices ({lhs:?} and {rhs:?})")]
    DeviceMismatch { op: &'static str, lhs: crate::Device, rhs: crate::Device },
    /// The CUDA backend failed (no GPU, driver or library error, out of memory).
    #[error("{op} on the GPU: {message}")]
    Cuda { op: &'static str, message: String },
}

/// Result of a tensor operation.
pub type Result<T> = std::result::Result<T, Error>;
