//! Device storage: one buffer on one GPU, f32 or bf16, and the device that owns it.

use std::sync::{Arc, OnceLock};

use half::bf16;
use kernels::cuda::{elementwise, CudaDevice, DeviceBuffer};

use super::cuda_error;
use crate::{DType, Result, Storage};

/// The elements of a CUDA tensor.
#[derive(Debug)]
pub enum CudaData {
    F32(DeviceBuffer<f32>),
    BF16(DeviceBuffer<bf16>),
}

/// A device buffer together with the [`CudaDevice`] it was allocated on (kept alive as
/// long as any tensor uses it).
///
/// An f32 storage also remembers its bf16 copy once one is made ([`CudaStorage::bf16_copy`]):
/// under bf16 matrix products a weight is converted once per step, not once per product
/// that reads it (forward and backward), and so are an activation that feeds several
/// products (q, k and v) or is read again by its weight's gradient, and an output gradient
/// read by both of its layer's backward products. Writing the f32 buffer forgets the copy,
/// unless the write writes a new copy too ([`CudaStorage::f32_buffer_mut_with_bf16_copy`]:
/// the optimizer's step, and ops whose results bf16 products read): then a weight is
/// converted once per run, and such a result not at all.
#[derive(Debug)]
pub struct CudaStorage {
    device: Arc<CudaDevice>,
    data: CudaData,
    bf16_copy: OnceLock<Arc<Storage>>,
}

impl CudaStorage {
    /// Wraps an f32 buffer of `device`.
    pub fn f32(device: &Arc<CudaDevice>, buffer: DeviceBuffer<f32>) -> CudaStorage {
        CudaStorage { device: Arc::clone(device), data: CudaData::F32(buffer), bf16_copy: OnceLock::new() }
    }

    /// Wraps a bf16 buffer of `device`.
    pub fn bf16(device: &Arc<CudaDevice>, buffer: DeviceBuffer<bf16>) -> CudaStorage {
        CudaStorage { device: Arc::clone(device), data: CudaData::BF16(buffer), bf16_copy: OnceLock::new() }
    }

    /// An uninitialised f32 buffer of `len` elements on `device` (every launcher that takes
    /// it as output overwrites it entirely).
    pub fn alloc(device: &Arc<CudaDevice>, len: usize) -> Result<CudaStorage> {
        let buffer = device.alloc(len).map_err(|e| cuda_error("alloc", e))?;
        Ok(CudaStorage::f32(device, buffer))
    }

    /// `len` f32 zeros on `device` (zeros that are the result: an empty sum, a fresh tensor).
    pub fn zeros(device: &Arc<CudaDevice>, len: usize) -> Result<CudaStorage> {
        let buffer = device.zeros(len).map_err(|e| cuda_error("zeros", e))?;
        Ok(CudaStorage::f32(device, buffer))
    }

    /// A copy of host f32 values on `device`.
    pub fn upload_f32(device: &Arc<CudaDevice>, values: &[f32]) -> Result<CudaStorage> {
        let buffer = device.upload(values).map_err(|e| cuda_error("upload", e))?;
        Ok(CudaStorage::f32(device, buffer))
    }

    /// A copy of host bf16 values on `device`.
    pub fn upload_bf16(device: &Arc<CudaDevice>, values: &[bf16]) -> Result<CudaStorage> {
        let buffer = device.upload(values).map_err(|e| cuda_error("upload", e))?;
        Ok(CudaStorage::bf16(device, buffer))
    }

    /// The owning device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            CudaData::F32(b) => b.len(),
            CudaData::BF16(b) => b.len(),
        }
    }

    /// True when no element is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            CudaData::F32(_) => DType::F32,
            CudaData::BF16(_) => DType::BF16,
        }
    }

    /// The f32 buffer, or an error naming `op` for bf16 storage.
    pub fn f32_buffer(&self, op: &'static str) -> Result<&DeviceBuffer<f32>> {
        match &self.data {
            CudaData::F32(b) => Ok(b),
            CudaData::BF16(_) => Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 }),
        }
    }

    /// The f32 buffer for writing, or an error naming `op` for bf16 storage. Forgets the
    /// bf16 copy, which the write makes stale.
    pub fn f32_buffer_mut(&mut self, op: &'static str) -> Result<&mut DeviceBuffer<f32>> {
        self.bf16_copy.take();
        match &mut self.data {
            CudaData::F32(b) => Ok(b),
            CudaData::BF16(_) => Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 }),
        }
    }

    /// Whether the storage holds a bf16 copy (a bf16 product has read it since its last write).
    pub fn has_bf16_copy(&self) -> bool {
        self.bf16_copy.get().is_some()
    }

    /// The f32 buffer for a write that also writes its bf16 copy: a fresh bf16 buffer becomes
    /// the copy and is returned beside the f32 buffer, and the caller must queue a write of
    /// both (the values, and them rounded to nearest even), so that bf16 products read the
    /// copy without a conversion (an op producing a product's input, the optimizer's step).
    /// An earlier copy is not written: tensors still holding it keep their values.
    pub fn f32_buffer_mut_with_bf16_copy(
        &mut self,
        op: &'static str,
    ) -> Result<(&mut DeviceBuffer<f32>, &mut DeviceBuffer<bf16>)> {
        self.bf16_copy.take();
        let CudaStorage { device, data, bf16_copy } = self;
        let CudaData::F32(values) = data else {
            return Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 });
        };
        let fresh = device.alloc(values.len()).map_err(|e| cuda_error("alloc", e))?;
        let _ = bf16_copy.set(Arc::new(Storage::Cuda(CudaStorage::bf16(device, fresh))));
        let copy = match bf16_copy.get_mut().and_then(Arc::get_mut) {
            Some(Storage::Cuda(CudaStorage { data: CudaData::BF16(copy), .. })) => copy,
            _ => unreachable!("the copy set above is a bf16 device storage held only here"),
        };
        Ok((values, copy))
    }

    /// The bf16 buffer, or an error naming `op` for f32 storage.
    pub fn bf16_buffer(&self, op: &'static str) -> Result<&DeviceBuffer<bf16>> {
        match &self.data {
            CudaData::BF16(b) => Ok(b),
            CudaData::F32(_) => Err(crate::Error::DTypeMismatch { op, expected: DType::BF16, got: DType::F32 }),
        }
    }

    /// A host copy (waits for the queued work that writes this buffer).
    pub fn download(&self) -> Result<Storage> {
        match &self.data {
            CudaData::F32(b) => Ok(Storage::F32(self.device.download(b).map_err(|e| cuda_error("download", e))?)),
            CudaData::BF16(b) => Ok(Storage::BF16(self.device.download(b).map_err(|e| cuda_error("download", e))?)),
        }
    }

    /// The strided view `[offset + Σ i_d·strides[d]]` copied row-major into a new buffer
    /// (bf16 views are widened to f32 first).
    pub fn copy_strided(&self, offset: usize, shape: &[usize], strides: &[usize]) -> Result<CudaStorage> {
        let widened;
        let src = match &self.data {
            CudaData::F32(b) => b,
            CudaData::BF16(_) => {
                widened = self.converted(DType::F32)?;
                widened.f32_buffer("copy_strided")?
            }
        };
        let mut out = CudaStorage::alloc(&self.device, shape.iter().product())?;
        elementwise::copy_strided(&self.device, src, offset, shape, strides, out.f32_buffer_mut("copy_strided")?)
            .map_err(|e| cuda_error("copy_strided", e))?;
        Ok(out)
    }

    /// The whole buffer in bf16, converted on first use and then shared: the storage of a
    /// tensor read by bf16 products. Each write of the f32 buffer goes through
    /// [`CudaStorage::f32_buffer_mut`], which forgets the copy, so it never goes stale.
    pub fn bf16_copy(&self) -> Result<Arc<Storage>> {
        if let Some(copy) = self.bf16_copy.get() {
            return Ok(Arc::clone(copy));
        }
        let copy = Arc::new(Storage::Cuda(self.converted(DType::BF16)?));
        Ok(Arc::clone(self.bf16_copy.get_or_init(|| copy)))
    }

    /// The whole buffer converted to `dtype` on the device (f32 ↔ bf16, rounding to nearest
    /// even; a copy when the type is unchanged). F16 is not a device type.
    pub fn converted(&self, dtype: DType) -> Result<CudaStorage> {
        let dev = &self.device;
        let err = |e| cuda_error("to_dtype", e);
        match (&self.data, dtype) {
            (CudaData::F32(src), DType::F32) => {
                let mut dst = dev.alloc(src.len()).map_err(err)?;
                dev.copy_within_device(src, 0, &mut dst, 0, src.len()).map_err(err)?;
                Ok(CudaStorage::f32(dev, dst))
            }
            (CudaData::BF16(src), DType::BF16) => {
                let mut dst = dev.alloc(src.len()).map_err(err)?;
                dev.copy_within_device(src, 0, &mut dst, 0, src.len()).map_err(err)?;
                Ok(CudaStorage::bf16(dev, dst))
            }
            (CudaData::F32(src), DType::BF16) => {
                let mut dst = dev.alloc(src.len()).map_err(err)?;
                elementwise::to_bf16(dev, src, &mut dst).map_err(err)?;
                Ok(CudaStorage::bf16(dev, dst))
            }
            (CudaData::BF16(src), DType::F32) => {
                let mut dst = dev.alloc(src.len()).map_err(err)?;
                elementwise::to_f32(dev, src, &mut dst).map_err(err)?;
                Ok(CudaStorage::f32(dev, dst))
            }
            (_, DType::F16) => Err(crate::Error::UnsupportedDevice {
                op: "to_dtype (f16)",
                device: crate::Device::Cuda(dev.ordinal()),
            }),
        }
    }
}
