//! Device storage: one buffer on one GPU, f32 or bf16, and the device that owns it.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use half::bf16;
use kernels::cuda::optim::Bf16Destination;
use kernels::cuda::{elementwise, CudaDevice, DeviceBuffer, ValuesMut};

use super::cuda_error;
use crate::{DType, Result, Storage};

/// The elements of a CUDA tensor.
#[derive(Debug)]
pub enum CudaData {
    F32(DeviceBuffer<f32>),
    BF16(DeviceBuffer<bf16>),
    /// f32 values held as their bf16 rounding only (an activation a product saved for its
    /// backward: [`CudaStorage::bf16_backed`]); widened to f32 on the device the first time
    /// something reads them as f32, and kept.
    Bf16Backed {
        copy: Arc<Storage>,
        widened: OnceLock<DeviceBuffer<f32>>,
    },
}

/// A device buffer together with the [`CudaDevice`] it was allocated on (kept alive as
/// long as any tensor uses it).
///
/// An f32 storage also remembers its bf16 copy once one is made ([`CudaStorage::bf16_copy`]):
/// under bf16 matrix products a weight is converted once per step, not once per product
/// that reads it (forward and backward), and so are an activation that feeds several
/// products (q, k and v) or is read again by its weight's gradient, and an output gradient
/// read by both of its layer's backward products. Writing the f32 buffer forgets the copy,
/// unless the write writes a new copy too (the optimizer's step,
/// [`CudaStorage::f32_buffer_mut_for_update`], and ops whose results bf16 products read,
/// [`CudaStorage::f32_buffer_mut_with_bf16_copy`]): then a weight is converted once per run,
/// and such a result not at all.
///
/// The copy is usually a bf16 storage of its own. The weights of a fused gated projection
/// (`W`, `A_c`, `A_s`) share one instead: their rows of the packed `[W; A_c; A_s]` that the
/// projection's GEMM reads as one operand ([`CudaStorage::shared_packed_bf16_copy`],
/// [`CudaStorage::share_packed_bf16_copy`]). The optimizer's step rewrites each weight's rows
/// in place ([`CudaStorage::f32_buffer_mut_for_update`]), and any other write forgets them as
/// it forgets an own copy, so the projection packs again only after such a write.
///
/// An activation that bf16 products read and then save for their backward is saved as its
/// bf16 copy alone ([`CudaStorage::bf16_backed`]), so its f32 buffer is freed with the rest
/// of the forward's results.
#[derive(Debug)]
pub struct CudaStorage {
    device: Arc<CudaDevice>,
    data: CudaData,
    /// Behind a lock because a reader may set it (`bf16_copy`, the fused projection's
    /// packing) through a shared reference; writers of the values reset it through `&mut`.
    bf16_copy: Mutex<Option<Bf16Copy>>,
}

/// The bf16 copy behind `lock`, reached through `&mut` (no other reference, so no locking).
fn unlocked(lock: &mut Mutex<Option<Bf16Copy>>) -> &mut Option<Bf16Copy> {
    lock.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where an f32 storage's bf16 copy (the values rounded to nearest even) is.
#[derive(Debug)]
enum Bf16Copy {
    /// A bf16 storage of its own, the whole buffer.
    Own(Arc<Storage>),
    /// Elements `at..at + len` of a buffer packed with the copies of other storages, back to
    /// back: a fused gated projection's `[W; A_c; A_s]`.
    Packed { buffer: Arc<DeviceBuffer<bf16>>, at: usize },
}

impl CudaStorage {
    /// Wraps an f32 buffer of `device`.
    pub fn f32(device: &Arc<CudaDevice>, buffer: DeviceBuffer<f32>) -> CudaStorage {
        CudaStorage { device: Arc::clone(device), data: CudaData::F32(buffer), bf16_copy: Mutex::new(None) }
    }

    /// Wraps a bf16 buffer of `device`.
    pub fn bf16(device: &Arc<CudaDevice>, buffer: DeviceBuffer<bf16>) -> CudaStorage {
        CudaStorage { device: Arc::clone(device), data: CudaData::BF16(buffer), bf16_copy: Mutex::new(None) }
    }

    /// An uninitialised buffer of `len` f32 values for a kernel to write through
    /// [`CudaStorage::values_mut`], held as their bf16 rounding when `rounded` (a product's
    /// output stored in bf16, as autocast stores it: widened on the device only if something
    /// reads it as f32).
    pub fn alloc_values(device: &Arc<CudaDevice>, len: usize, rounded: bool) -> Result<CudaStorage> {
        if !rounded {
            return CudaStorage::alloc(device, len);
        }
        let buffer = device.alloc(len).map_err(|e| cuda_error("alloc", e))?;
        let copy = Arc::new(Storage::Cuda(CudaStorage::bf16(device, buffer)));
        let data = CudaData::Bf16Backed { copy, widened: OnceLock::new() };
        Ok(CudaStorage { device: Arc::clone(device), data, bf16_copy: Mutex::new(None) })
    }

    /// Where a kernel writes the values: the f32 buffer (forgetting the bf16 copy, as
    /// [`CudaStorage::f32_buffer_mut`]), or the bf16 rounding of a storage held so and by
    /// nothing else (one from [`CudaStorage::alloc_values`]); a bf16-backed storage that shares
    /// its rounding becomes plain f32 first. Errors naming `op` for bf16 storage.
    pub fn values_mut(&mut self, op: &'static str) -> Result<ValuesMut<'_>> {
        let sole_rounding = matches!(&self.data, CudaData::Bf16Backed { copy, .. }
            if Arc::strong_count(copy) == 1 && Arc::weak_count(copy) == 0);
        if !sole_rounding {
            return Ok(ValuesMut::F32(self.f32_buffer_mut(op)?));
        }
        let CudaData::Bf16Backed { copy, widened } = &mut self.data else { unreachable!("checked above") };
        // The write makes any widened values stale.
        *widened = OnceLock::new();
        match Arc::get_mut(copy) {
            Some(Storage::Cuda(CudaStorage { data: CudaData::BF16(rounded), .. })) => Ok(ValuesMut::Bf16(rounded)),
            _ => unreachable!("a sole bf16 backing is a bf16 device storage"),
        }
    }

    /// The bf16 values of a storage held as its bf16 rounding ([`CudaStorage::bf16_backed`],
    /// [`CudaStorage::alloc_values`]), for kernels that read them directly; `None` otherwise.
    pub fn bf16_backing(&self) -> Option<&DeviceBuffer<bf16>> {
        match &self.data {
            CudaData::Bf16Backed { copy, .. } => match &**copy {
                Storage::Cuda(CudaStorage { data: CudaData::BF16(values), .. }) => Some(values),
                _ => unreachable!("a bf16 backing is a bf16 device storage"),
            },
            _ => None,
        }
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

    /// The same values backed by this storage's own bf16 copy alone, when it has one (or is
    /// itself so backed): what a product saves of an input whose backward reads it only as a
    /// bf16 product operand. Its dtype is still f32; [`CudaStorage::f32_buffer`] widens the
    /// copy back (one conversion launch, once) if anything reads it as f32.
    pub fn bf16_backed(&self) -> Option<CudaStorage> {
        let copy = match &self.data {
            CudaData::Bf16Backed { copy, .. } => Arc::clone(copy),
            CudaData::F32(_) => match &*self.lock_bf16_copy() {
                Some(Bf16Copy::Own(own)) => Arc::clone(own),
                _ => return None,
            },
            CudaData::BF16(_) => return None,
        };
        let data = CudaData::Bf16Backed { copy, widened: OnceLock::new() };
        Some(CudaStorage { device: Arc::clone(&self.device), data, bf16_copy: Mutex::new(None) })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            CudaData::F32(b) => b.len(),
            CudaData::BF16(b) => b.len(),
            CudaData::Bf16Backed { copy, .. } => copy.len(),
        }
    }

    /// True when no element is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            CudaData::F32(_) | CudaData::Bf16Backed { .. } => DType::F32,
            CudaData::BF16(_) => DType::BF16,
        }
    }

    /// The f32 buffer, or an error naming `op` for bf16 storage. A bf16-backed storage is
    /// widened here, on first use.
    pub fn f32_buffer(&self, op: &'static str) -> Result<&DeviceBuffer<f32>> {
        match &self.data {
            CudaData::F32(b) => Ok(b),
            CudaData::BF16(_) => Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 }),
            CudaData::Bf16Backed { copy, widened } => {
                if let Some(values) = widened.get() {
                    return Ok(values);
                }
                let Storage::Cuda(copy) = &**copy else { unreachable!("a bf16 backing is device storage") };
                let values = copy.converted(DType::F32)?;
                let CudaData::F32(values) = values.data else { unreachable!("converted to f32") };
                // Storages are shared across threads: another reader may have widened first.
                Ok(widened.get_or_init(|| values))
            }
        }
    }

    /// Turns a bf16-backed storage into a plain f32 one (its values widened, its backing its
    /// bf16 copy), before a write.
    fn make_f32(&mut self, op: &'static str) -> Result<()> {
        if !matches!(self.data, CudaData::Bf16Backed { .. }) {
            return Ok(());
        }
        self.f32_buffer(op)?;
        let CudaData::Bf16Backed { copy, widened } = &mut self.data else { unreachable!("checked above") };
        let (copy, values) = (Arc::clone(copy), widened.take().expect("widened above"));
        self.data = CudaData::F32(values);
        *unlocked(&mut self.bf16_copy) = Some(Bf16Copy::Own(copy));
        Ok(())
    }

    /// The f32 buffer for writing, or an error naming `op` for bf16 storage. Forgets the
    /// bf16 copy, which the write makes stale.
    pub fn f32_buffer_mut(&mut self, op: &'static str) -> Result<&mut DeviceBuffer<f32>> {
        self.make_f32(op)?;
        self.forget_bf16_copy();
        match &mut self.data {
            CudaData::F32(b) => Ok(b),
            CudaData::BF16(_) => Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 }),
            CudaData::Bf16Backed { .. } => unreachable!("made f32 above"),
        }
    }

    /// Drops the bf16 copy (own, or this storage's rows of a packed buffer), which a write of
    /// the values makes stale.
    fn forget_bf16_copy(&mut self) {
        *unlocked(&mut self.bf16_copy) = None;
    }

    /// The bf16 copy, locked for reading or setting through a shared reference.
    fn lock_bf16_copy(&self) -> MutexGuard<'_, Option<Bf16Copy>> {
        self.bf16_copy.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        self.make_f32(op)?;
        // Dropped before the fresh one is allocated: the allocator may hand its memory back.
        self.forget_bf16_copy();
        let CudaStorage { device, data, bf16_copy } = self;
        let CudaData::F32(values) = data else {
            return Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 });
        };
        let fresh = device.alloc(values.len()).map_err(|e| cuda_error("alloc", e))?;
        let slot = unlocked(bf16_copy);
        *slot = Some(Bf16Copy::Own(Arc::new(Storage::Cuda(CudaStorage::bf16(device, fresh)))));
        let copy = match slot {
            Some(Bf16Copy::Own(own)) => match Arc::get_mut(own) {
                Some(Storage::Cuda(CudaStorage { data: CudaData::BF16(copy), .. })) => copy,
                _ => unreachable!("the copy set above is a bf16 device storage held only here"),
            },
            _ => unreachable!("the copy set above is an own copy"),
        };
        Ok((values, copy))
    }

    /// The f32 buffer for the optimizer's in-place update, and where the update must write
    /// the values' bf16 copy (rounded to nearest even) so that it stays current: `None` when
    /// the storage has no copy (no bf16 product reads it), its own copy rewritten in place
    /// when nothing else holds that copy, a fresh own copy in place of one still held
    /// elsewhere (as [`CudaStorage::f32_buffer_mut_with_bf16_copy`]: the holder keeps its
    /// values), or this storage's rows of its packed buffer, rewritten in place (the fused
    /// projection's next GEMM reads them with no conversion). Rewriting in place keeps the
    /// copy's address from step to step, which a training step replayed as a CUDA graph needs
    /// (its products read the address they were captured with).
    ///
    /// Writing the packed rows in place changes nothing a caller still reads: the packed
    /// buffer is held only by the storages whose copies it holds and by the fused projections
    /// that read it, which also hold those storages; the optimizer reaches a storage held by
    /// nothing but its parameter (a shared one is copied first, without its bf16 copy).
    pub fn f32_buffer_mut_for_update(
        &mut self,
        op: &'static str,
    ) -> Result<(&mut DeviceBuffer<f32>, Option<Bf16Destination<'_>>)> {
        self.make_f32(op)?;
        let held_elsewhere = |own: &Arc<Storage>| Arc::strong_count(own) > 1 || Arc::weak_count(own) > 0;
        if matches!(unlocked(&mut self.bf16_copy), Some(Bf16Copy::Own(own)) if held_elsewhere(own)) {
            let (values, fresh) = self.f32_buffer_mut_with_bf16_copy(op)?;
            return Ok((values, Some(Bf16Destination { buffer: fresh, at: 0 })));
        }
        let CudaStorage { data, bf16_copy, .. } = self;
        let CudaData::F32(values) = data else {
            return Err(crate::Error::DTypeMismatch { op, expected: DType::F32, got: DType::BF16 });
        };
        match unlocked(bf16_copy) {
            Some(Bf16Copy::Packed { buffer, at }) => Ok((values, Some(Bf16Destination { buffer, at: *at }))),
            Some(Bf16Copy::Own(own)) => match Arc::get_mut(own) {
                Some(Storage::Cuda(CudaStorage { data: CudaData::BF16(copy), .. })) => {
                    Ok((values, Some(Bf16Destination { buffer: copy, at: 0 })))
                }
                _ => Err(crate::Error::DTypeMismatch { op, expected: DType::BF16, got: DType::F32 }),
            },
            None => Ok((values, None)),
        }
    }

    /// The packed bf16 buffer that holds the copies of `members` back to back in their order,
    /// when each member's copy is its rows of that one buffer (they were packed together and
    /// none has been written since, except by the optimizer's step, which rewrites the rows);
    /// `None` otherwise.
    pub fn shared_packed_bf16_copy(members: &[&CudaStorage]) -> Option<Arc<DeviceBuffer<bf16>>> {
        let mut shared: Option<Arc<DeviceBuffer<bf16>>> = None;
        let mut expected_at = 0;
        for member in members {
            let copy = member.lock_bf16_copy();
            let Some(Bf16Copy::Packed { buffer, at }) = &*copy else { return None };
            let same_buffer = shared.as_ref().is_none_or(|first| Arc::ptr_eq(first, buffer));
            if !same_buffer || *at != expected_at {
                return None;
            }
            shared = Some(Arc::clone(buffer));
            expected_at += member.len();
        }
        shared.filter(|buffer| buffer.len() == expected_at)
    }

    /// Makes `packed` the bf16 copy of every member, each its rows back to back in order, in
    /// place of whatever copy it had. The caller has just queued `packed`'s write: the members'
    /// values rounded to nearest even, as one buffer (the fused projection's `[W; A_c; A_s]`).
    pub fn share_packed_bf16_copy(members: &[&CudaStorage], packed: &Arc<DeviceBuffer<bf16>>) {
        let mut at = 0;
        for member in members {
            *member.lock_bf16_copy() = Some(Bf16Copy::Packed { buffer: Arc::clone(packed), at });
            at += member.len();
        }
    }

    /// The bf16 buffer, or an error naming `op` for f32 storage.
    pub fn bf16_buffer(&self, op: &'static str) -> Result<&DeviceBuffer<bf16>> {
        match &self.data {
            CudaData::BF16(b) => Ok(b),
            CudaData::F32(_) | CudaData::Bf16Backed { .. } => {
                Err(crate::Error::DTypeMismatch { op, expected: DType::BF16, got: DType::F32 })
            }
        }
    }

    /// A host copy (waits for the queued work that writes this buffer).
    pub fn download(&self) -> Result<Storage> {
        let download = |e| cuda_error("download", e);
        match &self.data {
            CudaData::F32(_) | CudaData::Bf16Backed { .. } => {
                Ok(Storage::F32(self.device.download(self.f32_buffer("download")?).map_err(download)?))
            }
            CudaData::BF16(b) => Ok(Storage::BF16(self.device.download(b).map_err(download)?)),
        }
    }

    /// The strided view `[offset + Σ i_d·strides[d]]` copied row-major into a new buffer
    /// (bf16 views are widened to f32 first).
    pub fn copy_strided(&self, offset: usize, shape: &[usize], strides: &[usize]) -> Result<CudaStorage> {
        let widened;
        let src = match &self.data {
            CudaData::F32(_) | CudaData::Bf16Backed { .. } => self.f32_buffer("copy_strided")?,
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
    ///
    /// A storage whose copy is its rows of a packed buffer (a fused gated projection's
    /// weight, read by no other product) gets a conversion each call, not kept: the packed
    /// buffer is never handed out as a tensor, so the optimizer can rewrite it in place.
    pub fn bf16_copy(&self) -> Result<Arc<Storage>> {
        if let CudaData::Bf16Backed { copy, .. } = &self.data {
            return Ok(Arc::clone(copy));
        }
        let mut copy = self.lock_bf16_copy();
        match &*copy {
            Some(Bf16Copy::Own(own)) => Ok(Arc::clone(own)),
            Some(Bf16Copy::Packed { .. }) => Ok(Arc::new(Storage::Cuda(self.converted(DType::BF16)?))),
            None => {
                let own = Arc::new(Storage::Cuda(self.converted(DType::BF16)?));
                *copy = Some(Bf16Copy::Own(Arc::clone(&own)));
                Ok(own)
            }
        }
    }

    /// Whether the storage keeps a bf16 copy of its own (made by [`CudaStorage::bf16_copy`] or
    /// written beside the values), which a bf16 product can read for any view of it.
    pub fn has_own_bf16_copy(&self) -> bool {
        matches!(self.data, CudaData::Bf16Backed { .. }) || matches!(&*self.lock_bf16_copy(), Some(Bf16Copy::Own(_)))
    }

    /// The whole buffer converted to `dtype` on the device (f32 ↔ bf16, rounding to nearest
    /// even; a copy when the type is unchanged). F16 is not a device type.
    pub fn converted(&self, dtype: DType) -> Result<CudaStorage> {
        let dev = &self.device;
        let err = |e| cuda_error("to_dtype", e);
        match (&self.data, dtype) {
            // The widened values are the copy's, exactly: convert from the copy either way.
            (CudaData::Bf16Backed { copy, .. }, DType::F32 | DType::BF16) => match &**copy {
                Storage::Cuda(copy) => copy.converted(dtype),
                _ => unreachable!("a bf16 backing is device storage"),
            },
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
