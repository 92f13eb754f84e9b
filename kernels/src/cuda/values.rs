//! Borrowed device arrays of f32 values or of their bf16 rounding, for the kernels that come
//! in both element types: under bf16 products a product's output is stored in bf16 (as
//! autocast stores it: half the bytes written and read), and the kernels that consume it read
//! it so ([`Values`]) or write it so ([`ValuesMut`]); the arithmetic stays f32.

use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::Result;
use super::module::Arg;

/// Values a kernel reads: f32, or their bf16 rounding.
#[derive(Clone, Copy, Debug)]
pub enum Values<'a> {
    F32(&'a DeviceBuffer<f32>),
    Bf16(&'a DeviceBuffer<bf16>),
}

/// Values a kernel writes: f32, or rounded to bf16 (nearest even).
#[derive(Debug)]
pub enum ValuesMut<'a> {
    F32(&'a mut DeviceBuffer<f32>),
    Bf16(&'a mut DeviceBuffer<bf16>),
}

impl Values<'_> {
    /// Its elements.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(b) => b.len(),
            Values::Bf16(b) => b.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds bf16 values.
    pub fn is_bf16(&self) -> bool {
        matches!(self, Values::Bf16(_))
    }

    /// Errors unless it lives on `dev`.
    pub(crate) fn check_owner(&self, dev: &CudaDevice, op: &'static str) -> Result<()> {
        match self {
            Values::F32(b) => dev.check_owner(op, b),
            Values::Bf16(b) => dev.check_owner(op, b),
        }
    }

    /// The kernel argument: the address of element `at`.
    pub(crate) fn arg_at(&self, at: usize) -> Arg {
        Arg::Ptr(match self {
            Values::F32(b) => b.ptr_at(at),
            Values::Bf16(b) => b.ptr_at(at),
        })
    }
}

impl ValuesMut<'_> {
    /// Its elements.
    pub fn len(&self) -> usize {
        match self {
            ValuesMut::F32(b) => b.len(),
            ValuesMut::Bf16(b) => b.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds bf16 values.
    pub fn is_bf16(&self) -> bool {
        matches!(self, ValuesMut::Bf16(_))
    }

    /// Errors unless it lives on `dev`.
    pub(crate) fn check_owner(&self, dev: &CudaDevice, op: &'static str) -> Result<()> {
        match self {
            ValuesMut::F32(b) => dev.check_owner(op, b),
            ValuesMut::Bf16(b) => dev.check_owner(op, b),
        }
    }

    /// The address of element 0.
    pub(crate) fn address(&self) -> u64 {
        match self {
            ValuesMut::F32(b) => b.device_ptr(),
            ValuesMut::Bf16(b) => b.device_ptr(),
        }
    }

    /// The kernel argument: the address of element 0.
    pub(crate) fn arg(&self) -> Arg {
        Arg::Ptr(self.address())
    }
}
