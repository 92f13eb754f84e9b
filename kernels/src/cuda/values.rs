//! Device arrays of f32 values or of their bf16 rounding, for the kernels that come in both
//! element types: under bf16 products a product's output is stored in bf16 (as autocast
//! stores it: half the bytes written and read), and the kernels that consume it read it so
//! ([`Values`]) or write it so ([`ValuesMut`]); the arithmetic stays f32. [`DeviceValues`]
//! owns such an array (the fused gate's saved `ZU` and its `dL_c`).

use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::opt_ptr;
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

/// An owned buffer of f32 values, or of their bf16 rounding (from their f32 sums).
#[derive(Debug)]
pub enum DeviceValues {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<bf16>),
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

    /// The address of element `at`.
    pub(crate) fn address_at(&self, at: usize) -> u64 {
        match self {
            Values::F32(b) => b.ptr_at(at),
            Values::Bf16(b) => b.ptr_at(at),
        }
    }

    /// The address of element 0.
    pub(crate) fn address(&self) -> u64 {
        self.address_at(0)
    }

    /// The address of element 0 when it holds f32 values, else 0 (a kernel's null pointer).
    pub(crate) fn f32_address(&self) -> u64 {
        if self.is_bf16() {
            0
        } else {
            self.address()
        }
    }

    /// The address of element 0 when it holds bf16 values, else 0.
    pub(crate) fn bf16_address(&self) -> u64 {
        if self.is_bf16() {
            self.address()
        } else {
            0
        }
    }

    /// For a kernel that takes an f32 and a bf16 pointer, one of them null (0): `[address of
    /// element at, 0]` for f32 values, `[0, address of element at]` for bf16 ones.
    pub(crate) fn typed_addresses_at(&self, at: usize) -> [u64; 2] {
        if self.is_bf16() {
            [0, self.address_at(at)]
        } else {
            [self.address_at(at), 0]
        }
    }

    /// [`Values::typed_addresses_at`] as kernel arguments.
    pub(crate) fn typed_args_at(&self, at: usize) -> [Arg; 2] {
        self.typed_addresses_at(at).map(Arg::Ptr)
    }

    /// The kernel argument: the address of element `at`.
    pub(crate) fn arg_at(&self, at: usize) -> Arg {
        Arg::Ptr(self.address_at(at))
    }

    /// The kernel for this element type: `f32_name` or `bf16_name`.
    pub(crate) fn kernel(&self, f32_name: &'static str, bf16_name: &'static str) -> &'static str {
        if self.is_bf16() {
            bf16_name
        } else {
            f32_name
        }
    }
}

impl ValuesMut<'_> {
    /// The same buffer, read-only (its length, address and element type).
    pub fn as_values(&self) -> Values<'_> {
        match self {
            ValuesMut::F32(b) => Values::F32(b),
            ValuesMut::Bf16(b) => Values::Bf16(b),
        }
    }

    /// Sets every element to zero (one memset).
    pub(crate) fn fill_zero(&mut self, dev: &CudaDevice) -> Result<()> {
        match self {
            ValuesMut::F32(b) => dev.fill_zero(b),
            ValuesMut::Bf16(b) => dev.fill_zero(b),
        }
    }
}

impl DeviceValues {
    /// A fresh buffer of `len` elements, bf16 when `bf16` is set.
    pub fn alloc(dev: &CudaDevice, len: usize, bf16: bool) -> Result<DeviceValues> {
        Ok(if bf16 { DeviceValues::Bf16(dev.alloc(len)?) } else { DeviceValues::F32(dev.alloc(len)?) })
    }

    /// The buffer to read.
    pub fn values(&self) -> Values<'_> {
        match self {
            DeviceValues::F32(b) => Values::F32(b),
            DeviceValues::Bf16(b) => Values::Bf16(b),
        }
    }

    /// The buffer to write.
    pub fn values_mut(&mut self) -> ValuesMut<'_> {
        match self {
            DeviceValues::F32(b) => ValuesMut::F32(b),
            DeviceValues::Bf16(b) => ValuesMut::Bf16(b),
        }
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        self.values().len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The kernel of a backward that reads an `input` and its output's `gradient`, each f32 or
/// bf16: `[both f32, bf16 input and f32 gradient, both bf16]`. A bf16 gradient beside an f32
/// input is refused (under bf16 products the input is stored in bf16 too).
pub(crate) fn kernel_for_gradient(
    op: &'static str,
    input: Values<'_>,
    gradient: Values<'_>,
    [f32_kernel, bf16_input, all_bf16]: [&'static str; 3],
) -> Result<&'static str> {
    match (input.is_bf16(), gradient.is_bf16()) {
        (false, false) => Ok(f32_kernel),
        (true, false) => Ok(bf16_input),
        (true, true) => Ok(all_bf16),
        (false, true) => Err(CudaError::shape(op, "a bf16 gradient needs a bf16 input (bf16 products)")),
    }
}

/// The two kernel arguments of an output written either in f32, with its bf16 twin when `twin`
/// is given (the rounding the bf16 products that read it take), or in bf16 alone (`out` bf16,
/// no twin): the f32 address or null, then the bf16 address (the output's or the twin's) or
/// null. Errors naming `op` unless both are `dev`'s, the twin has the output's length, and a
/// bf16 output comes without one.
pub(crate) fn output_with_twin(
    dev: &CudaDevice,
    op: &'static str,
    out: Values<'_>,
    twin: Option<&DeviceBuffer<bf16>>,
) -> Result<[Arg; 2]> {
    out.check_owner(dev, op)?;
    if let Some(twin) = twin {
        dev.check_owner(op, twin)?;
        ensure(!out.is_bf16(), op, || "a bf16 output takes no bf16 twin".to_string())?;
        ensure(twin.len() == out.len(), op, || {
            format!("a bf16 twin has {} elements, its output {}", twin.len(), out.len())
        })?;
    }
    let bf16 = if out.is_bf16() { out.arg_at(0) } else { opt_ptr(twin) };
    Ok([Arg::Ptr(out.f32_address()), bf16])
}
