//! Tensors on a CUDA GPU (feature `cuda`): the device registry, device storage and host ↔
//! device copies. The CUDA half of each op is not here: it sits beside the op's CPU half,
//! as the `cuda` module at the end of `tensor/src/ops/<family>.rs`, launching
//! `kernels::cuda::<family>`.
//!
//! ```text
//! mod.rs          device(ordinal): one shared CudaDevice per GPU; Tensor::to_device;
//!                 output/accumulated: a fresh device tensor filled by a launcher
//! storage.rs      CudaStorage: a DeviceBuffer (f32 or bf16) and the device that owns it
//! mutate.rs       copy-on-write access to a device buffer for in-place updates
//! ```
//!
//! An op on a CUDA tensor runs on that tensor's GPU: every operand must be on the same
//! device ([`crate::Error::DeviceMismatch`] otherwise) and the result stays there. Nothing
//! is copied between host and device behind the caller's back, except the few scalars an
//! op returns to the host by definition (a loss value, an `item()`).

pub(crate) mod mutate;
pub(crate) mod storage;

use std::sync::{Arc, Mutex, OnceLock};

use half::bf16;
use kernels::cuda::{CudaDevice, CudaError, DeviceBuffer, DeviceRun, Values, ValuesMut};

use crate::{DType, Error, Result, Storage, Tensor};

pub use crate::ops::matmul::cuda::{matmul_precision, set_matmul_precision, MatmulPrecision};
pub use crate::ops::reduce::cuda::sum_squares;
pub use storage::CudaStorage;

/// The devices opened so far, by ordinal.
fn registry() -> &'static Mutex<Vec<Option<Arc<CudaDevice>>>> {
    static DEVICES: OnceLock<Mutex<Vec<Option<Arc<CudaDevice>>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(Vec::new()))
}

/// GPU `ordinal`, opened on first use and shared by every tensor on it afterwards.
/// Fails with a message naming what is missing (driver, NVRTC, cuBLAS, the GPU itself).
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    let mut devices = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(Some(dev)) = devices.get(ordinal) {
        return Ok(Arc::clone(dev));
    }
    let dev = Arc::new(CudaDevice::new(ordinal).map_err(|e| cuda_error("open device", e))?);
    if devices.len() <= ordinal {
        devices.resize(ordinal + 1, None);
    }
    devices[ordinal] = Some(Arc::clone(&dev));
    Ok(dev)
}

/// How many GPUs [`device`] can open (the emulated device counts as one).
pub fn device_count() -> usize {
    CudaDevice::count()
}

/// True when GPU 0 can be opened (tests use this to skip, saying so, on machines without one).
pub fn is_available() -> bool {
    device(0).is_ok()
}

/// Wraps a CUDA error as a tensor error naming `op`.
pub(crate) fn cuda_error(op: &'static str, error: CudaError) -> Error {
    Error::Cuda { op, message: error.to_string() }
}

/// A launcher's error (its message names the launcher) as a tensor error.
impl From<CudaError> for Error {
    fn from(error: CudaError) -> Error {
        cuda_error("kernel launch", error)
    }
}

impl Tensor {
    /// This tensor's device storage, or `None` on the CPU.
    pub(crate) fn cuda_storage(&self) -> Option<&CudaStorage> {
        match &*self.storage {
            Storage::Cuda(storage) => Some(storage),
            _ => None,
        }
    }

    /// The GPU this tensor lives on, or an error naming `op` for a CPU tensor.
    pub(crate) fn cuda_device(&self, op: &'static str) -> Result<Arc<CudaDevice>> {
        self.cuda_storage().map(|s| Arc::clone(s.device())).ok_or(Error::UnsupportedDevice { op, device: self.device })
    }

    /// A contiguous tensor of `shape` over freshly written device storage.
    pub(crate) fn from_cuda(storage: CudaStorage, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_storage(Storage::Cuda(storage), shape)
    }

    /// The f32 device buffer of a [`Tensor::dense`] view (call that first), or an error
    /// naming `op` for CPU, bf16 or non-dense tensors.
    pub fn cuda_f32(&self, op: &'static str) -> Result<&DeviceBuffer<f32>> {
        self.dense_storage(op)?.f32_buffer(op)
    }

    /// The values of a [`Tensor::dense`] f32 view for a kernel that reads either element
    /// type: the bf16 rounding they are held as (a product stored in bf16), else the f32
    /// buffer; errors as [`Tensor::cuda_f32`].
    pub fn cuda_values(&self, op: &'static str) -> Result<Values<'_>> {
        let storage = self.dense_storage(op)?;
        match storage.bf16_backing() {
            Some(rounded) => Ok(Values::Bf16(rounded)),
            None => Ok(Values::F32(storage.f32_buffer(op)?)),
        }
    }

    /// The device storage of a dense view: exactly its elements, in order, from offset 0.
    pub(crate) fn dense_storage(&self, op: &'static str) -> Result<&CudaStorage> {
        let storage = self.cuda_storage().ok_or(Error::UnsupportedDevice { op, device: self.device })?;
        if !self.is_contiguous() || self.offset != 0 || storage.len() != self.numel() {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "a CUDA launcher needs a dense view; call dense() first".into(),
            });
        }
        Ok(storage)
    }

    /// The f32 device elements of a contiguous GPU tensor, wherever they start in its buffer
    /// (a gradient that is one part of a packed gradient buffer needs no copy, where
    /// [`Tensor::cuda_f32`] needs the whole buffer); errors for a strided view.
    pub fn cuda_f32_run(&self, op: &'static str) -> Result<DeviceRun<'_, f32>> {
        let storage = self.cuda_storage().ok_or(Error::UnsupportedDevice { op, device: self.device })?;
        if !self.is_contiguous() {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "a run of a CUDA buffer needs a contiguous view; call contiguous() first".into(),
            });
        }
        Ok(DeviceRun::new(storage.f32_buffer(op)?, self.offset, self.numel())?)
    }

    /// [`Tensor::read_later`] of a GPU tensor: its values as f32, copied into a readback.
    pub(crate) fn read_later_from_gpu(&self) -> Result<crate::HostLater> {
        const OP: &str = "read_later";
        let dense = self.to_dtype(DType::F32)?.dense()?;
        let dev = dense.cuda_device(OP)?;
        let readback = dev.read_later(dense.cuda_f32(OP)?).map_err(|e| cuda_error(OP, e))?;
        Ok(crate::HostLater::Queued(readback, self.shape.clone()))
    }

    /// A contiguous host copy of this GPU tensor.
    pub(crate) fn download(&self) -> Result<Tensor> {
        let dense = self.dense()?;
        let storage = dense.cuda_storage().ok_or(Error::UnsupportedDevice { op: "download", device: self.device })?;
        Tensor::from_storage(storage.download()?, &self.shape)
    }

    /// A view whose device buffer holds exactly its elements in row-major order (offset 0),
    /// copying on the device when this view is strided, offset or a part of a larger buffer.
    /// The layout every CUDA launcher takes.
    pub fn dense(&self) -> Result<Tensor> {
        let storage = self.cuda_storage().ok_or(Error::UnsupportedDevice { op: "dense", device: self.device })?;
        if self.is_contiguous() && self.offset == 0 && storage.len() == self.numel() {
            return Ok(self.clone());
        }
        let copy = storage.copy_strided(self.offset, &self.shape, &self.strides)?;
        Tensor::from_cuda(copy, &self.shape)
    }
}

/// A new f32 tensor of `shape` on `dev`, written by `launch` (which must overwrite every
/// element: the buffer comes from the caching allocator uninitialised).
pub(crate) fn output(
    dev: &Arc<CudaDevice>,
    op: &'static str,
    shape: &[usize],
    launch: impl FnOnce(&mut DeviceBuffer<f32>) -> Result<()>,
) -> Result<Tensor> {
    let mut out = CudaStorage::alloc(dev, shape.iter().product())?;
    launch(out.f32_buffer_mut(op)?)?;
    Tensor::from_cuda(out, shape)
}

/// The buffers an op writes for a result that bf16 products read (a normalised activation,
/// an FFN activation or its gradients): the f32 buffer and, with bf16 products on
/// ([`matmul_precision`]), a fresh bf16 copy the kernel writes beside it (the values rounded
/// to nearest even), so the products that read the result convert nothing.
pub(crate) fn product_input_buffers<'a>(
    storage: &'a mut CudaStorage,
    op: &'static str,
) -> Result<(&'a mut DeviceBuffer<f32>, Option<&'a mut DeviceBuffer<bf16>>)> {
    if matmul_precision() == MatmulPrecision::Bf16 {
        let (values, copy) = storage.f32_buffer_mut_with_bf16_copy(op)?;
        return Ok((values, Some(copy)));
    }
    Ok((storage.f32_buffer_mut(op)?, None))
}

/// [`output`] for a result that bf16 products read: `launch` also writes the bf16 copy when
/// it is given one ([`product_input_buffers`]).
pub(crate) fn product_input_output(
    dev: &Arc<CudaDevice>,
    op: &'static str,
    shape: &[usize],
    launch: impl FnOnce(&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>) -> Result<()>,
) -> Result<Tensor> {
    let mut out = CudaStorage::alloc(dev, shape.iter().product())?;
    let (values, copy) = product_input_buffers(&mut out, op)?;
    launch(values, copy)?;
    Tensor::from_cuda(out, shape)
}

/// A new tensor of `shape` on `dev` that only products read (a normalised activation): under
/// bf16 products ([`matmul_precision`]) `launch` writes its values rounded to nearest even
/// and nothing else (a bf16-backed storage, [`CudaStorage::alloc_values`]: no f32 buffer is
/// written, and one is made only if something reads the values as f32), else in f32.
pub(crate) fn product_only_output(
    dev: &Arc<CudaDevice>,
    op: &'static str,
    shape: &[usize],
    launch: impl FnOnce(ValuesMut<'_>) -> Result<()>,
) -> Result<Tensor> {
    let mut out = product_only_storage(dev, shape.iter().product())?;
    launch(out.values_mut(op)?)?;
    Tensor::from_cuda(out, shape)
}

/// The uninitialised storage of [`product_only_output`]: `len` values held as their bf16
/// rounding alone under bf16 products, else in f32 (for an op with several such results).
pub(crate) fn product_only_storage(dev: &Arc<CudaDevice>, len: usize) -> Result<CudaStorage> {
    CudaStorage::alloc_values(dev, len, matmul_precision() == MatmulPrecision::Bf16)
}

/// Copies a host tensor to GPU `ordinal` (f32 and bf16 keep their type; f16 is widened).
pub(crate) fn upload(t: &Tensor, ordinal: usize) -> Result<Tensor> {
    let dev = device(ordinal)?;
    let host = t.contiguous()?;
    let storage = match &*host.storage {
        Storage::BF16(values) => {
            let start = host.offset;
            CudaStorage::upload_bf16(&dev, &values[start..start + host.numel()])?
        }
        _ => CudaStorage::upload_f32(&dev, &host.to_vec())?,
    };
    Tensor::from_cuda(storage, &t.shape)
}
