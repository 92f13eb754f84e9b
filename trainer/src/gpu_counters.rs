//! A GPU step's counters and kernel times for the benches: launches by kernel, products by
//! precision, host synchronisations, copies and allocations (`kernels::cuda::counters`),
//! and the time per kernel family from the event timer (`kernels::cuda::timer`). On the CPU
//! (or in a build without CUDA) there is nothing to count and both report `null`.

use anyhow::Result;
use serde_json::Value;
use tensor::Device;

/// A device's counters at one moment; two give the counts of the work in between.
pub struct CounterSnapshot {
    #[cfg(feature = "cuda")]
    counters: Option<kernels::cuda::DeviceCounters>,
}

#[cfg(feature = "cuda")]
impl CounterSnapshot {
    /// The counters of `device` now (none on the CPU).
    pub fn take(device: Device) -> Result<CounterSnapshot> {
        let counters = match device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(tensor::cuda::device(ordinal)?.counters()),
        };
        Ok(CounterSnapshot { counters })
    }

    /// The counts from `earlier` to `self` (`None` on the CPU).
    pub fn since(&self, earlier: &CounterSnapshot) -> Option<kernels::cuda::DeviceCounters> {
        Some(self.counters.as_ref()?.since(earlier.counters.as_ref()?))
    }

    /// [`CounterSnapshot::since`] as JSON: every scalar counter by name, plus
    /// `launches_by_kernel` and `bytes_by_kernel`; `null` on the CPU.
    pub fn since_json(&self, earlier: &CounterSnapshot) -> Value {
        let Some(delta) = self.since(earlier) else { return Value::Null };
        let mut object = serde_json::Map::new();
        for (name, value) in delta.totals() {
            object.insert(name.to_string(), Value::from(value));
        }
        object.insert("launches_by_kernel".to_string(), serde_json::json!(delta.launches_by_kernel));
        object.insert("bytes_by_kernel".to_string(), serde_json::json!(delta.bytes_by_kernel));
        Value::Object(object)
    }
}

#[cfg(not(feature = "cuda"))]
impl CounterSnapshot {
    /// Nothing to count without the CUDA backend.
    pub fn take(_device: Device) -> Result<CounterSnapshot> {
        Ok(CounterSnapshot {})
    }

    /// `null`: nothing was counted.
    pub fn since_json(&self, _earlier: &CounterSnapshot) -> Value {
        Value::Null
    }
}

/// Runs `work` under the GPU's kernel timer and returns its time per kernel family as JSON
/// (`[{"family", "calls", "ms"}]`, slowest first), printing the ten slowest kernels to
/// stderr; runs `work` untimed and returns `null` on the CPU.
#[cfg(feature = "cuda")]
pub fn time_kernels(device: Device, work: impl FnOnce() -> Result<()>) -> Result<Value> {
    let Device::Cuda(ordinal) = device else {
        work()?;
        return Ok(Value::Null);
    };
    let dev = tensor::cuda::device(ordinal)?;
    dev.start_kernel_timer();
    let outcome = work();
    let times = dev.stop_kernel_timer()?;
    outcome?;
    let clock = if dev.is_emulated() { "host clock of the emulation" } else { "CUDA events" };
    let busy: f64 = times.iter().map(|t| t.ms).sum();
    eprintln!("kernel time of one step on {} ({clock}): {busy:.3} ms in {} kernels", dev.label(), times.len());
    eprintln!("{:<40} {:<12} {:>7} {:>10}", "kernel", "family", "calls", "ms");
    for t in times.iter().take(10) {
        eprintln!("{:<40} {:<12} {:>7} {:>10.3}", t.name, t.family, t.calls, t.ms);
    }
    let families = kernels::cuda::timer::by_family(&times);
    let rows =
        families.into_iter().map(|(family, calls, ms)| serde_json::json!({"family": family, "calls": calls, "ms": ms}));
    Ok(rows.collect())
}

/// Without the CUDA backend there is no timer: runs `work` and returns `null`.
#[cfg(not(feature = "cuda"))]
pub fn time_kernels(_device: Device, work: impl FnOnce() -> Result<()>) -> Result<Value> {
    work()?;
    Ok(Value::Null)
}
