//! Typed, owned element buffers behind tensors.

use half::{bf16, f16};

/// A tensor's elements. Shared between views through an `Arc`.
#[derive(Debug)]
pub enum Storage {
    /// f32 elements in host memory.
    F32(Vec<f32>),
    /// bf16 elements in host memory.
    BF16(Vec<bf16>),
    /// f16 elements in host memory.
    F16(Vec<f16>),
    /// A buffer on a GPU (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

/// f32 buffers go back to [`crate::pool`] for the next tensor of the same length.
impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::F32(values) = self {
            crate::pool::recycle(std::mem::take(values));
        }
    }
}

impl Storage {
    /// Number of elements held.
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::BF16(v) => v.len(),
            Storage::F16(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }

    /// True when no element is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device holding the elements.
    pub fn device(&self) -> crate::Device {
        match self {
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => crate::Device::Cuda(s.device().ordinal()),
            _ => crate::Device::Cpu,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> crate::DType {
        match self {
            Storage::F32(_) => crate::DType::F32,
            Storage::BF16(_) => crate::DType::BF16,
            Storage::F16(_) => crate::DType::F16,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.dtype(),
        }
    }

    /// Every element widened to f32 (a copy; device storage is downloaded first).
    ///
    /// # Panics
    /// If downloading device storage fails (a driver error, not bad input).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            Storage::F32(v) => v.clone(),
            Storage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.download().unwrap_or_else(|e| panic!("{e}")).to_f32_vec(),
        }
    }

    /// Builds storage of `dtype` from f32 values (rounding to nearest even).
    pub fn from_f32(values: Vec<f32>, dtype: crate::DType) -> Storage {
        match dtype {
            crate::DType::F32 => Storage::F32(values),
            crate::DType::BF16 => Storage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            crate::DType::F16 => Storage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
        }
    }
}
