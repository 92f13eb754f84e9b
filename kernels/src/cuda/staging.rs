//! Pinned (page-locked) host staging for host → device copies: a small ring of reusable
//! slots per device, so a copy is a true asynchronous DMA from page-locked memory (which a
//! CUDA graph can capture) instead of a copy from pageable memory that the driver stages.
//!
//! A copy takes a free slot, writes the host bytes into it, queues the device copy on the
//! device's stream and records the slot's event after it. Safety: a slot is written only
//! while it is free, that is, while no copy from it is queued or in flight: it was never
//! used, or the event recorded after its last copy has completed (the stream runs in order,
//! so that copy has finished reading the slot). A busy slot is never written: when no free
//! slot fits, a new slot is allocated, and a free slot too small for the copy is replaced by
//! a larger one (freeing a free slot is safe for the same reason). A slot is dropped only
//! after waiting for its event.
//!
//! Slots are powers of two from [`MIN_SLOT_BYTES`] to [`CHUNK_BYTES`]; a longer copy goes
//! in chunks of [`CHUNK_BYTES`]. The ring stops growing at [`MAX_STAGING_BYTES`]: a copy
//! that would need more waits for the stream (a counted synchronisation), after which every
//! slot is free. Once warm, the ring holds as many slots as copies the host has queued ahead
//! of the device, so a steady-state step that uploads the same sizes each time finds free
//! slots and asks nothing of the driver. The emulated device runs copies at once, so its
//! slots are free again as soon as a copy returns: it keeps the same slots and counts, and
//! its allocations are the GPU's when each copy has finished before the next one is queued.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::error::{CudaError, Result};

/// The smallest slot.
const MIN_SLOT_BYTES: usize = 4 << 10;
/// The largest slot: longer copies go in chunks of this size.
pub(crate) const CHUNK_BYTES: usize = 4 << 20;
/// The most page-locked memory the ring holds before a copy waits for the stream instead.
const MAX_STAGING_BYTES: usize = 64 << 20;

/// A GPU's context and the stream its copies are queued on.
pub(crate) struct StagingStream<'a> {
    /// The context that owns the page-locked memory and the events.
    pub ctx: &'a Arc<CudaContext>,
    /// The device's stream.
    pub stream: &'a Arc<CudaStream>,
}

/// One slot: page-locked memory (plain host memory on the emulated device) and, on a GPU,
/// the event recorded after the last copy from it (`busy` until it has completed).
struct Slot {
    memory: SlotMemory,
    capacity: usize,
    event: Option<CudaEvent>,
    busy: bool,
}

enum SlotMemory {
    Pinned(PinnedHostSlice<u8>),
    #[cfg(feature = "cuda-emu")]
    Host(Box<[u8]>),
}

impl Slot {
    fn new(gpu: Option<&StagingStream>, capacity: usize) -> Result<Slot> {
        let memory = match gpu {
            // SAFETY: the memory is written before it is read (by `copy`).
            Some(gpu) => SlotMemory::Pinned(
                unsafe { gpu.ctx.alloc_pinned::<u8>(capacity) }
                    .map_err(|e| CudaError::driver("cuMemHostAlloc (staging)", e))?,
            ),
            #[cfg(feature = "cuda-emu")]
            None => SlotMemory::Host(vec![0u8; capacity].into_boxed_slice()),
            #[cfg(not(feature = "cuda-emu"))]
            None => unreachable!("without feature cuda-emu every device is a GPU"),
        };
        Ok(Slot { memory, capacity, event: None, busy: false })
    }

    /// Whether no copy from the slot is queued or in flight.
    fn is_free(&mut self) -> Result<bool> {
        if let (true, Some(event)) = (self.busy, &self.event) {
            self.busy = !event.try_is_complete().map_err(|e| CudaError::driver("cuEventQuery (staging)", e))?;
        }
        Ok(!self.busy)
    }

    fn ptr(&mut self) -> Result<*mut u8> {
        match &mut self.memory {
            SlotMemory::Pinned(pinned) => {
                pinned.as_mut_ptr().map_err(|e| CudaError::driver("reading the staging memory", e))
            }
            #[cfg(feature = "cuda-emu")]
            SlotMemory::Host(host) => Ok(host.as_mut_ptr()),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The memory must outlive the copy from it; an error here means the context is gone.
        if let (true, Some(event)) = (self.busy, &self.event) {
            let _ = event.synchronize();
        }
    }
}

/// The staging ring of one device.
#[derive(Default)]
pub(crate) struct Staging {
    state: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    slots: Vec<Slot>,
    allocations: u64,
}

impl Ring {
    fn bytes(&self) -> usize {
        self.slots.iter().map(|slot| slot.capacity).sum()
    }
}

/// What a staged copy cost beyond the copy itself.
pub(crate) struct Staged {
    /// Whether the host waited for the stream (the ring was full).
    pub waited: bool,
}

impl Staging {
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Page-locked allocations made so far (driver allocations, like the device memory's).
    pub(crate) fn allocations(&self) -> u64 {
        self.lock().allocations
    }

    /// Copies `src` (at most [`CHUNK_BYTES`]) to device address `dst` through a free slot:
    /// queued on `gpu`'s stream, or done at once on the emulated device (`gpu` is `None`).
    ///
    /// # Safety
    /// `dst` must be the start of `src.len()` writable bytes of device memory whose later
    /// users are queued after this copy on the same stream.
    pub(crate) unsafe fn copy(&self, gpu: Option<&StagingStream>, src: &[u8], dst: u64) -> Result<Staged> {
        debug_assert!(src.len() <= CHUNK_BYTES);
        let mut ring = self.lock();
        let (index, waited) = Self::free_slot(&mut ring, gpu, src.len())?;
        let slot = &mut ring.slots[index];
        let staged = slot.ptr()?;
        // SAFETY: the slot is free (no copy reads it) and holds at least src.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), staged, src.len()) };
        match gpu {
            Some(gpu) => {
                // SAFETY: the source is the slot's page-locked memory, which is not written
                // again before the event recorded next has completed; the destination is
                // the caller's.
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, staged as *const _, src.len(), gpu.stream.cu_stream()) }
                    .result()
                    .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync (staged)", e))?;
                let event = match &mut slot.event {
                    Some(event) => event,
                    empty => empty.insert(
                        gpu.ctx
                            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                            .map_err(|e| CudaError::driver("cuEventCreate (staging)", e))?,
                    ),
                };
                event.record(gpu.stream).map_err(|e| CudaError::driver("cuEventRecord (staging)", e))?;
                slot.busy = true;
            }
            // SAFETY: on the emulated device `dst` is host memory of src.len() bytes.
            None => unsafe { std::ptr::copy_nonoverlapping(staged, dst as *mut u8, src.len()) },
        }
        Ok(Staged { waited })
    }

    /// A free slot of at least `bytes`: a fitting free one, else a free one grown, else a new
    /// one; when the ring is full, after waiting for the stream. Also whether it waited.
    fn free_slot(ring: &mut Ring, gpu: Option<&StagingStream>, bytes: usize) -> Result<(usize, bool)> {
        let capacity = bytes.next_power_of_two().clamp(MIN_SLOT_BYTES, CHUNK_BYTES);
        let mut waited = false;
        loop {
            let mut free = Vec::new();
            for (index, slot) in ring.slots.iter_mut().enumerate() {
                if slot.is_free()? {
                    free.push(index);
                }
            }
            if let Some(&index) = free.iter().find(|&&index| ring.slots[index].capacity >= bytes) {
                return Ok((index, waited));
            }
            // Replacing the largest free slot (too small) or adding one: within the bound?
            let replaced = free.iter().copied().max_by_key(|&index| ring.slots[index].capacity);
            let released = replaced.map_or(0, |index| ring.slots[index].capacity);
            if ring.bytes() - released + capacity <= MAX_STAGING_BYTES || waited {
                let slot = Slot::new(gpu, capacity)?;
                ring.allocations += 1;
                return Ok(match replaced {
                    Some(index) => {
                        ring.slots[index] = slot;
                        (index, waited)
                    }
                    None => {
                        ring.slots.push(slot);
                        (ring.slots.len() - 1, waited)
                    }
                });
            }
            // Full: wait until every queued copy has finished, then every slot is free.
            if let Some(gpu) = gpu {
                gpu.stream.synchronize().map_err(|e| CudaError::driver("stream synchronize (staging)", e))?;
            }
            waited = true;
        }
    }
}
