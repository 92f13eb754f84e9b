//! Element types and devices.

/// Element type of a tensor's storage. Compute kernels run in f32; bf16 and f16 are for
/// storage (checkpoints, memory) and convert through [`crate::Tensor::to_dtype`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision, the compute type.
    F32,
    /// bfloat16: f32's exponent range with 8 significand bits.
    BF16,
    /// IEEE half precision: 11 significand bits, range ±65504.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

/// Where a tensor lives: host memory, or GPU `n` (feature `cuda`). An op without a kernel
/// for a device returns [`crate::Error::UnsupportedDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// The GPU with this ordinal.
    Cuda(usize),
}
