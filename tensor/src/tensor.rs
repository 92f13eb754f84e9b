//! The `Tensor` type: shared storage viewed through a shape, strides and an offset.

use std::sync::Arc;

use kernels::cpu::copy::copy_strided;

use crate::shape::contiguous_strides;
use crate::{DType, Device, Error, Result, Storage};

/// An n-d array view. Cloning is cheap (the storage is shared); ops return new tensors.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub(crate) storage: Arc<Storage>,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
    pub(crate) device: Device,
}

impl Tensor {
    /// Wraps `storage` as a contiguous tensor of `shape` (on the storage's device).
    pub fn from_storage(storage: Storage, shape: &[usize]) -> Result<Tensor> {
        crate::alloc::keep_freed_memory();
        let numel: usize = shape.iter().product();
        if storage.len() != numel {
            return Err(Error::InvalidShape {
                op: "from_storage",
                shape: shape.to_vec(),
                reason: format!("{} elements given for {numel}", storage.len()),
            });
        }
        Ok(Tensor {
            device: storage.device(),
            storage: Arc::new(storage),
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        })
    }

    /// A contiguous f32 tensor from `data` (row-major) and `shape`.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_storage(Storage::F32(data), shape)
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element strides of each dimension (0 where broadcast).
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of dimension `axis`, or an error naming the op.
    pub fn dim(&self, op: &'static str, axis: usize) -> Result<usize> {
        self.shape.get(axis).copied().ok_or(Error::AxisOutOfRange { op, axis, rank: self.rank() })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Device the tensor lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// True when the elements are laid out row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.strides == contiguous_strides(&self.shape) || self.numel() <= 1
    }

    /// The f32 host storage behind this view, or an error naming `op` if the dtype is not
    /// f32 or the tensor is on a GPU.
    pub(crate) fn f32_storage(&self, op: &'static str) -> Result<&[f32]> {
        match &*self.storage {
            Storage::F32(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(Error::UnsupportedDevice { op, device: self.device }),
            other => Err(Error::DTypeMismatch { op, expected: DType::F32, got: other.dtype() }),
        }
    }

    /// The elements as a slice when the tensor is contiguous f32; otherwise an error
    /// (call [`Tensor::contiguous`] first).
    pub fn as_slice(&self) -> Result<&[f32]> {
        let data = self.f32_storage("as_slice")?;
        if !self.is_contiguous() {
            return Err(Error::InvalidShape {
                op: "as_slice",
                shape: self.shape.clone(),
                reason: "tensor is not contiguous; call contiguous() first".into(),
            });
        }
        Ok(&data[self.offset..self.offset + self.numel()])
    }

    /// Mutable access to the elements of a contiguous f32 tensor, copying the storage first
    /// if another tensor shares it (copy-on-write). Used by optimizers for in-place updates.
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        self.require_cpu("as_mut_slice")?;
        let shared = Arc::strong_count(&self.storage) > 1 || Arc::weak_count(&self.storage) > 0;
        if shared || !self.is_contiguous() || self.offset != 0 || self.storage.len() != self.numel() {
            *self = self.contiguous()?.deep_copy()?;
        }
        let device = self.device;
        match Arc::get_mut(&mut self.storage) {
            Some(Storage::F32(v)) => Ok(v.as_mut_slice()),
            Some(other) => Err(Error::DTypeMismatch { op: "as_mut_slice", expected: DType::F32, got: other.dtype() }),
            None => Err(Error::UnsupportedDevice { op: "as_mut_slice", device }),
        }
    }

    /// The elements in row-major order as f32 (a copy; converts bf16/f16; downloads a GPU
    /// tensor, waiting for the work that computes it).
    ///
    /// # Panics
    /// If downloading from the GPU fails (a driver error, not bad input); use
    /// [`Tensor::to_host`] to get that as an error.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = crate::pool::buffer(self.numel());
        match &*self.storage {
            Storage::F32(v) => copy_strided(v, self.offset, &self.shape, &self.strides, &mut out),
            other => copy_strided(&other.to_f32_vec(), self.offset, &self.shape, &self.strides, &mut out),
        }
        out
    }

    /// This tensor on the host: itself when already there, else a contiguous copy
    /// (waiting for the GPU work that computes it).
    pub fn to_host(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return self.download();
        }
        Ok(self.clone())
    }

    /// This tensor's values on their way to the host: [`HostLater::wait`] gives the host
    /// copy. On a GPU the copy is queued now, and the wait is for that copy alone, not for
    /// the work queued after it: a training loop reads a step's loss this way after it has
    /// queued the next step, so the GPU does not idle while the host prepares one. Small
    /// tensors only on a GPU (`kernels::cuda::readback::READBACK_BYTES`).
    pub fn read_later(&self) -> Result<HostLater> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return self.read_later_from_gpu();
        }
        Ok(HostLater::Ready(self.clone()))
    }

    /// This tensor on `device`: itself when already there, else a contiguous copy.
    /// Moving to `Device::Cuda` needs the `cuda` feature and a GPU (an error otherwise).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        match device {
            Device::Cpu => self.to_host(),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::upload(&self.to_host()?, ordinal),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                Err(Error::UnsupportedDevice { op: "to_device (built without the cuda feature)", device })
            }
        }
    }

    /// Errors unless `other` is on the same device as `self` (every op checks its operands).
    pub(crate) fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device == other.device {
            Ok(())
        } else {
            Err(Error::DeviceMismatch { op, lhs: self.device, rhs: other.device })
        }
    }

    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::InvalidShape {
                op: "item",
                shape: self.shape.clone(),
                reason: "item() needs exactly one element".into(),
            });
        }
        Ok(self.to_vec()[0])
    }

    /// A contiguous copy with its own storage (never shared).
    pub fn deep_copy(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let dense = self.dense()?;
            let storage = dense.cuda_storage().map(|s| s.converted(self.dtype())).transpose()?;
            let storage = storage.ok_or(Error::UnsupportedDevice { op: "deep_copy", device: self.device })?;
            return Tensor::from_cuda(storage, &self.shape);
        }
        let t = self.contiguous()?;
        Tensor::from_vec(t.as_slice()?.to_vec(), &self.shape)
    }

    /// What an op saves of this input when its backward reads it only as an operand of
    /// matrix products (`dW = dYᵀ·X`): on a GPU under bf16 products, when the storage holds
    /// its own bf16 copy (written beside the values by the op that made them), the same view
    /// backed by that copy alone, so the f32 values are freed with the forward's other
    /// results (autocast saves the bf16 cast as well). The bf16 products read the copy as
    /// before, the same bits; a read as f32 widens it on the device. Otherwise the tensor
    /// itself.
    pub fn saved_for_products(&self) -> Tensor {
        #[cfg(feature = "cuda")]
        if crate::cuda::matmul_precision() == crate::cuda::MatmulPrecision::Bf16 {
            if let Some(backed) = self.cuda_storage().and_then(|storage| storage.bf16_backed()) {
                return Tensor { storage: Arc::new(Storage::Cuda(backed)), ..self.clone() };
            }
        }
        self.clone()
    }

    /// Converts the element type (f32 ↔ bf16 ↔ f16), rounding to nearest even.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let dense = self.dense()?;
            let source =
                dense.cuda_storage().ok_or(Error::UnsupportedDevice { op: "to_dtype", device: self.device })?;
            if dtype == DType::BF16 && dense.offset == 0 && source.len() == dense.numel() {
                // The whole buffer: its shared bf16 copy (made once per storage).
                return Ok(Tensor { storage: source.bf16_copy()?, ..dense });
            }
            return Tensor::from_cuda(source.converted(dtype)?, &self.shape);
        }
        Tensor::from_storage(Storage::from_f32(self.to_vec(), dtype), &self.shape)
    }

    /// The device check of ops that have no GPU implementation.
    pub(crate) fn require_cpu(&self, op: &'static str) -> Result<()> {
        match self.device {
            Device::Cpu => Ok(()),
            device => Err(Error::UnsupportedDevice { op, device }),
        }
    }

    /// True when both tensors have equal shapes and every element is within `atol + rtol·|b|`.
    pub fn all_close(&self, other: &Tensor, rtol: f32, atol: f32) -> bool {
        self.shape == other.shape
            && self.to_vec().iter().zip(other.to_vec()).all(|(&a, b)| (a - b).abs() <= atol + rtol * b.abs())
    }
}

/// A tensor's values on their way to the host ([`Tensor::read_later`]).
pub enum HostLater {
    /// Already on the host.
    Ready(Tensor),
    /// A copy queued on the GPU, of a tensor of this shape.
    #[cfg(feature = "cuda")]
    Queued(kernels::cuda::readback::Readback<f32>, Vec<usize>),
}

impl HostLater {
    /// The host tensor, once its copy has finished (waiting for that copy only).
    pub fn wait(self) -> Result<Tensor> {
        match self {
            HostLater::Ready(tensor) => Ok(tensor),
            #[cfg(feature = "cuda")]
            HostLater::Queued(readback, shape) => {
                let values = readback.wait().map_err(|e| crate::cuda::cuda_error("read_later", e))?;
                Tensor::from_vec(values, &shape)
            }
        }
    }
}
