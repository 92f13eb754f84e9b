//! Errors of tensor operations. Every message names the op and the shapes involved.

/// What went wrong in a tensor operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Two operands whose shapes do not fit together.
    #[error("{op}: shapes {lhs:?} and {rhs:?} do not match")]
    ShapeMismatch {
        /// The op that failed.
        op: &'static str,
        /// The first operand's shape.
        lhs: Vec<usize>,
        /// The second operand's shape.
        rhs: Vec<usize>,
    },
    /// One operand whose shape the op cannot take.
    #[error("{op}: invalid shape {shape:?}: {reason}")]
    InvalidShape {
        /// The op that failed.
        op: &'static str,
        /// The shape it was given.
        shape: Vec<usize>,
        /// What the op needs instead.
        reason: String,
    },
    /// An axis outside `0..rank`.
    #[error("{op}: axis {axis} out of range for a tensor of rank {rank}")]
    AxisOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The axis asked for.
        axis: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// An index (token id, target, position) outside its range.
    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The index given.
        index: usize,
        /// How many there are (valid indices are `0..size`).
        size: usize,
    },
    /// The op computes in f32 only; convert with `to_dtype` first.
    #[error("{op}: needs dtype {expected:?}, got {got:?}")]
    DTypeMismatch {
        /// The op that failed.
        op: &'static str,
        /// The dtype the op computes in.
        expected: crate::DType,
        /// The operand's dtype.
        got: crate::DType,
    },
    /// The op has no implementation on this device (yet).
    #[error("{op}: not available on device {device:?}")]
    UnsupportedDevice {
        /// The op that failed.
        op: &'static str,
        /// The operand's device.
        device: crate::Device,
    },
    /// Operands on different devices (move one with `to_device` first).
    #[error("{op}: operands on different devices ({lhs:?} and {rhs:?})")]
    DeviceMismatch {
        /// The op that failed.
        op: &'static str,
        /// The first operand's device.
        lhs: crate::Device,
        /// The second operand's device.
        rhs: crate::Device,
    },
    /// Data an op would change in place has another holder (an autograd op or a tape still
    /// keeps a clone), which would see it change.
    #[error("{op}: {what} are shared with another holder (an op or a tape still keeps a clone, which would see them change); drop it first, or make new ones")]
    Shared {
        /// The op that failed.
        op: &'static str,
        /// What is shared.
        what: &'static str,
    },
    /// The CUDA backend failed (no GPU, driver or library error, out of memory).
    #[error("{op} on the GPU: {message}")]
    Cuda {
        /// The op that failed.
        op: &'static str,
        /// The backend's message.
        message: String,
    },
}

/// Result of a tensor operation.
pub type Result<T> = std::result::Result<T, Error>;
