//! A per-kernel timer: while it runs, every launch and cuBLAS call is bracketed by two CUDA
//! events on the device's stream; stopping it waits for the stream and sums the elapsed
//! times by kernel, so a training step's GPU time splits by kernel and family.
//!
//! The events time the GPU's execution of each launch, not the host's work in between, so
//! the sum is the step's busy time; the step's wall time minus it is the host- or
//! launch-bound part. Recording two events per launch costs a few microseconds of host
//! time each: time steps with the timer for the split, without it for the rate.
//!
//! On the emulated device a launch runs on the host before `launch` returns, so the timer
//! reads the host's clock around it: it exercises the same bookkeeping, but its times are
//! the emulation's, not a GPU's.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::error::{CudaError, Result};

/// Total time of one kernel over the timed interval.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel's name (a cuBLAS call by its function: `cublasGemmEx`, `cublasSgemm`).
    pub name: &'static str,
    /// Its family: the `.cu` file without extension, or `cublas`.
    pub family: &'static str,
    /// Launches timed.
    pub calls: u64,
    /// Milliseconds summed over them.
    pub ms: f64,
}

/// One end of a timed launch.
enum Mark {
    /// An event recorded on the GPU's stream.
    Event(CudaEvent),
    /// The host's clock (emulated device).
    Host(Instant),
}

impl Mark {
    /// Milliseconds from `self` to `end` (waits for a GPU event).
    fn ms_until(&self, end: &Mark) -> Result<f64> {
        match (self, end) {
            (Mark::Event(start), Mark::Event(end)) => {
                start.elapsed_ms(end).map(f64::from).map_err(|e| CudaError::driver("reading a timing event", e))
            }
            (Mark::Host(start), Mark::Host(end)) => Ok((*end - *start).as_secs_f64() * 1e3),
            _ => Err(CudaError::Driver {
                context: "reading the kernel timer".to_string(),
                message: "a span began on one kind of device and ended on another".to_string(),
            }),
        }
    }
}

/// A launch being timed: its start mark, until [`KernelTimer::end`] adds the end.
pub(crate) struct Span {
    name: &'static str,
    family: &'static str,
    start: Mark,
}

/// The timer of one device: off, or collecting spans.
#[derive(Default)]
pub(crate) struct KernelTimer {
    spans: Mutex<Option<Vec<(Span, Mark)>>>,
}

impl KernelTimer {
    fn lock(&self) -> MutexGuard<'_, Option<Vec<(Span, Mark)>>> {
        self.spans.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts collecting (dropping what an earlier, unfinished interval collected).
    pub(crate) fn start(&self) {
        *self.lock() = Some(Vec::new());
    }

    /// Whether the timer is collecting.
    pub(crate) fn is_running(&self) -> bool {
        self.lock().is_some()
    }

    /// The start of a launch of `name` (of `family`) about to be queued on `stream`
    /// (`None`: the emulated device); `None` when the timer is off.
    pub(crate) fn begin(
        &self,
        stream: Option<&CudaStream>,
        name: &'static str,
        family: &'static str,
    ) -> Result<Option<Span>> {
        if !self.is_running() {
            return Ok(None);
        }
        Ok(Some(Span { name, family, start: mark(stream)? }))
    }

    /// The end of `span`'s launch, just queued on `stream`.
    pub(crate) fn end(&self, stream: Option<&CudaStream>, span: Option<Span>) -> Result<()> {
        let Some(span) = span else { return Ok(()) };
        let end = mark(stream)?;
        if let Some(spans) = self.lock().as_mut() {
            spans.push((span, end));
        }
        Ok(())
    }

    /// Stops collecting and returns the time per kernel, slowest first (waits for the GPU).
    pub(crate) fn stop(&self) -> Result<Vec<KernelTime>> {
        let spans = self.lock().take().unwrap_or_default();
        let mut by_kernel: BTreeMap<(&'static str, &'static str), (u64, f64)> = BTreeMap::new();
        for (span, end) in &spans {
            let ms = span.start.ms_until(end)?;
            let entry = by_kernel.entry((span.family, span.name)).or_default();
            entry.0 += 1;
            entry.1 += ms;
        }
        let mut times: Vec<KernelTime> =
            by_kernel.into_iter().map(|((family, name), (calls, ms))| KernelTime { name, family, calls, ms }).collect();
        times.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(times)
    }
}

/// A mark now: an event recorded on `stream`, or the host clock without one.
fn mark(stream: Option<&CudaStream>) -> Result<Mark> {
    match stream {
        Some(stream) => stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map(Mark::Event)
            .map_err(|e| CudaError::driver("recording a timing event", e)),
        None => Ok(Mark::Host(Instant::now())),
    }
}

/// Time per family: the kernels of `times` summed by family, slowest first.
pub fn by_family(times: &[KernelTime]) -> Vec<(&'static str, u64, f64)> {
    let mut families: BTreeMap<&'static str, (u64, f64)> = BTreeMap::new();
    for t in times {
        let entry = families.entry(t.family).or_default();
        entry.0 += t.calls;
        entry.1 += t.ms;
    }
    let mut rows: Vec<(&'static str, u64, f64)> = families.into_iter().map(|(f, (c, ms))| (f, c, ms)).collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    rows
}
