//! Direct access to a GPU tensor's f32 device buffer, for code that updates tensors where
//! they live (the optimizers' fused steps) or hands them to a `kernels::cuda` launcher that
//! has no tensor-level op (the gradient norm). The device twin of [`Tensor::as_mut_slice`]
//! and [`Tensor::as_slice`].

use std::sync::Arc;

use kernels::cuda::optim::Bf16Destination;
use kernels::cuda::{CudaDevice, DeviceBuffer};

use super::CudaStorage;
use crate::{DType, Error, Result, Storage, Tensor};

impl Tensor {
    /// The device and the f32 buffer of this GPU tensor for in-place writes, copying the
    /// storage first (on the device) when another tensor shares it or this view is not
    /// exactly its buffer: copy-on-write, as [`Tensor::as_mut_slice`] does on the host.
    /// Errors naming `op` for a CPU tensor or bf16 storage.
    pub fn cuda_f32_mut(&mut self, op: &'static str) -> Result<(Arc<CudaDevice>, &mut DeviceBuffer<f32>)> {
        let (dev, storage) = self.unique_cuda_f32(op)?;
        Ok((dev, storage.f32_buffer_mut(op)?))
    }

    /// As [`Tensor::cuda_f32_mut`], for an update that also rewrites the bf16 copy bf16
    /// products read: the f32 buffer and, when the tensor has a bf16 copy, where the update
    /// writes the new one (a fresh buffer, or the tensor's rows of a fused projection's packed
    /// weight: `CudaStorage::f32_buffer_mut_for_update`).
    #[allow(clippy::type_complexity)]
    pub fn cuda_f32_mut_with_bf16_copy(
        &mut self,
        op: &'static str,
    ) -> Result<(Arc<CudaDevice>, &mut DeviceBuffer<f32>, Option<Bf16Destination<'_>>)> {
        let (dev, storage) = self.unique_cuda_f32(op)?;
        let (values, copy) = storage.f32_buffer_mut_for_update(op)?;
        Ok((dev, values, copy))
    }

    /// The storage of this GPU tensor when the tensor is the only owner of its whole dense
    /// buffer (a write in place changes nothing another tensor sees); `None` otherwise, with
    /// no copy made: for adding onto a gradient sum in place (`accumulate`, `add_matmul`, the
    /// fused projection's `dx`), where the caller has another way when it is shared.
    pub(crate) fn sole_dense_cuda_storage(&mut self) -> Option<&mut CudaStorage> {
        if !self.is_contiguous() || self.offset != 0 || self.storage.len() != self.numel() {
            return None;
        }
        match Arc::get_mut(&mut self.storage) {
            Some(Storage::Cuda(storage)) => Some(storage),
            _ => None,
        }
    }

    /// The device and the storage of this GPU f32 tensor, made its own dense buffer first
    /// (copy-on-write, see [`Tensor::cuda_f32_mut`]).
    fn unique_cuda_f32(&mut self, op: &'static str) -> Result<(Arc<CudaDevice>, &mut CudaStorage)> {
        let dev = self.cuda_device(op)?;
        if self.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op, expected: DType::F32, got: self.dtype() });
        }
        let shared = Arc::strong_count(&self.storage) > 1 || Arc::weak_count(&self.storage) > 0;
        if shared || !self.is_contiguous() || self.offset != 0 || self.storage.len() != self.numel() {
            *self = self.deep_copy()?;
        }
        let device = self.device;
        match Arc::get_mut(&mut self.storage) {
            Some(Storage::Cuda(storage)) => Ok((dev, storage)),
            _ => Err(Error::UnsupportedDevice { op, device }),
        }
    }

    /// Runs `f` with the device and this GPU tensor's elements as one dense f32 device
    /// buffer (copied on the device first when the view is strided, offset or part of a
    /// larger buffer). Errors naming `op` for a CPU tensor or bf16 storage.
    pub fn with_cuda_f32<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Arc<CudaDevice>, &DeviceBuffer<f32>) -> Result<R>,
    ) -> Result<R> {
        let dev = self.cuda_device(op)?;
        let dense = self.dense()?;
        f(&dev, dense.cuda_f32(op)?)
    }
}
