//! Small device → host copies the host reads later ([`CudaDevice::read_later`]).
//!
//! A plain download waits for the whole stream: everything queued before it, and, when the
//! host reads a training step's loss after queueing the next step, that next step too, so the
//! GPU would idle while the host prepares the step after it. Here the copy is queued into
//! page-locked memory with an event recorded after it, and [`Readback::wait`] waits for that
//! event only: the copy and the work before it, not the work queued since.
//!
//! The page-locked memory and the events are kept in a free list per device and reused, so a
//! steady-state loop that reads back a few values per step asks nothing of the driver. The
//! counters count a readback as a pinned device → host copy; its wait, for that copy alone,
//! is not counted as a synchronisation (the emulated device, which copies at once, never
//! waits, and both count the same).

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaEvent, PinnedHostSlice};

use super::allocator::{DeviceBuffer, DeviceScalar};
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};

/// The most bytes one readback holds (a step's loss, norm and verdict are 16).
pub const READBACK_BYTES: usize = 256;

/// Page-locked memory for one readback and the event recorded after its copy.
struct Slot {
    memory: PinnedHostSlice<u8>,
    event: CudaEvent,
}

/// A device's free readback slots.
#[derive(Default)]
pub(crate) struct ReadbackSlots {
    free: Mutex<Vec<Slot>>,
}

impl ReadbackSlots {
    fn take(&self) -> Option<Slot> {
        self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop()
    }

    fn give_back(&self, slot: Slot) {
        self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(slot);
    }
}

/// Values copied from the device, readable once their copy has finished ([`Readback::wait`]).
pub struct Readback<T: DeviceScalar> {
    state: State<T>,
}

enum State<T> {
    /// On a GPU: the queued copy of `len` values, whose slot goes back to `slots` once read.
    Queued { slot: Option<Slot>, slots: Arc<ReadbackSlots>, len: usize },
    /// On the emulated device, which copies at once.
    Ready(Vec<T>),
}

impl<T: DeviceScalar> Readback<T> {
    /// Waits for the copy (not for the work queued after it) and returns the values.
    pub fn wait(mut self) -> Result<Vec<T>> {
        match &mut self.state {
            State::Ready(values) => Ok(std::mem::take(values)),
            State::Queued { slot, slots, len } => {
                let slot = slot.take().expect("a queued readback holds its slot until read");
                let values = read_slot::<T>(&slot, *len);
                slots.give_back(slot);
                values
            }
        }
    }
}

impl<T: DeviceScalar> Drop for Readback<T> {
    fn drop(&mut self) {
        if let State::Queued { slot, slots, .. } = &mut self.state {
            if let Some(slot) = slot.take() {
                // The copy may still be writing an unread slot: reused only once it is done.
                if slot.event.synchronize().is_ok() {
                    slots.give_back(slot);
                }
            }
        }
    }
}

/// The `len` values of `slot` once the copy into it has finished.
fn read_slot<T: DeviceScalar>(slot: &Slot, len: usize) -> Result<Vec<T>> {
    slot.event.synchronize().map_err(|e| CudaError::driver("cuEventSynchronize (readback)", e))?;
    let bytes = slot.memory.as_slice().map_err(|e| CudaError::driver("reading the readback memory", e))?;
    let mut values = vec![T::default(); len];
    // SAFETY: the copy wrote len·size_of::<T>() ≤ READBACK_BYTES bytes of T's at the start of
    // the slot, and has finished (the event above); `values` holds exactly that many bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            values.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(&values[..]),
        )
    };
    Ok(values)
}

impl CudaDevice {
    /// Queues a copy of `buffer` (at most [`READBACK_BYTES`]) to the host, after the work
    /// queued so far, without waiting: [`Readback::wait`] then waits for that copy only.
    pub fn read_later<T: DeviceScalar>(&self, buffer: &DeviceBuffer<T>) -> Result<Readback<T>> {
        const OP: &str = "read_later";
        self.check_owner(OP, buffer)?;
        let bytes = buffer.num_bytes();
        ensure(bytes <= READBACK_BYTES, OP, || format!("{bytes} bytes; a readback holds at most {READBACK_BYTES}"))?;
        self.refuse_in_capture(OP)?;
        self.count_readback(bytes);
        let Some(gpu) = self.driver() else {
            let mut values = vec![T::default(); buffer.len()];
            // SAFETY: the emulated buffer's own host range of buffer.len() elements.
            unsafe {
                std::ptr::copy_nonoverlapping(buffer.device_ptr() as *const T, values.as_mut_ptr(), buffer.len())
            };
            return Ok(Readback { state: State::Ready(values) });
        };
        gpu.bind()?;
        let slots = self.readback_slots();
        let mut slot = match slots.take() {
            Some(slot) => slot,
            None => {
                let ctx = gpu.context();
                // SAFETY: the memory is written by the copy below before it is read. Not
                // write-combined: the host reads it.
                let memory = unsafe { ctx.alloc_pinned_with_flags::<u8>(READBACK_BYTES, 0) }
                    .map_err(|e| CudaError::driver("cuMemHostAlloc (readback)", e))?;
                let event = ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| CudaError::driver("cuEventCreate (readback)", e))?;
                Slot { memory, event }
            }
        };
        let host = slot.memory.as_mut_ptr().map_err(|e| CudaError::driver("reading the readback memory", e))?;
        // SAFETY: the destination is the slot's page-locked memory, at least `bytes` long and
        // read only after the event recorded next; the source is the buffer's own range.
        unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), buffer.device_ptr(), bytes, gpu.stream()) }
            .result()
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync (readback)", e))?;
        slot.event.record(gpu.cuda_stream()).map_err(|e| CudaError::driver("cuEventRecord (readback)", e))?;
        let state = State::Queued { slot: Some(slot), slots: Arc::clone(slots), len: buffer.len() };
        Ok(Readback { state })
    }
}
