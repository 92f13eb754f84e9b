//! Per-device counters of the work a device is asked to do: kernel launches by kernel,
//! cuBLAS products and their FLOPs by precision, memsets, host synchronisations, copies,
//! the bytes each launch touches, and NCCL collectives.
//!
//! They are counted where the work is queued (`CudaDevice::launch`, the cuBLAS wrappers,
//! the copy and fill methods, `synchronize`), before the backend is chosen, so a GPU and the
//! emulated device count the same step alike: a step's counts can be read in CPU CI and
//! checked against budgets (launches per step, no synchronisation, no driver allocation, no
//! f32 product off the tensor cores), and set beside the GPU's timings.
//!
//! Take a snapshot with `CudaDevice::counters` before and after the work of interest and
//! subtract: [`DeviceCounters::since`].

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// What a device has been asked to do since it was opened (a snapshot).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Kernel launches and cuBLAS calls, by kernel name (cuBLAS calls by function).
    pub launches_by_kernel: BTreeMap<&'static str, u64>,
    /// Bytes touched by kernel launches and cuBLAS calls, by the same names (the part of
    /// `bytes_touched` that is not memsets and copies): where a step's memory traffic goes.
    pub bytes_by_kernel: BTreeMap<&'static str, u64>,
    /// Every launch: kernels plus cuBLAS calls (the sum of `launches_by_kernel`).
    pub launches: u64,
    /// cuBLAS products with bf16 operands on the tensor cores (`cublasGemmEx`).
    pub bf16_gemm_calls: u64,
    /// cuBLAS products in f32 on the CUDA cores (`cublasSgemm`, default math mode: no TF32).
    pub f32_gemm_calls: u64,
    /// FLOPs (2·m·n·k per product) of the bf16 tensor-core products.
    pub bf16_tensor_core_gemm_flops: u64,
    /// FLOPs of the f32 products, which run without tensor cores.
    pub f32_simt_gemm_flops: u64,
    /// Device memsets (`fill_zero`).
    pub memsets: u64,
    /// Waits of the host for the device: `synchronize`, and every download (which waits).
    pub syncs: u64,
    /// Host → device copies.
    pub host_to_device_copies: u64,
    /// Bytes copied host → device.
    pub host_to_device_bytes: u64,
    /// Device → host copies.
    pub device_to_host_copies: u64,
    /// Bytes copied device → host.
    pub device_to_host_bytes: u64,
    /// Host ↔ device copies from or to pageable host memory (downloads: the driver stages
    /// them, and a CUDA graph cannot capture them).
    pub pageable_copies: u64,
    /// Host → device copies from page-locked memory (every upload goes through the device's
    /// pinned staging ring, `staging.rs`; one per chunk of at most 4 MiB).
    pub pinned_copies: u64,
    /// Device → device copies.
    pub device_copies: u64,
    /// Buffers asked of the caching allocator.
    pub buffer_requests: u64,
    /// Blocks the caching allocator had to get from the driver (`cuMemAllocAsync`) and
    /// page-locked staging slots (`cuMemHostAlloc`).
    pub driver_allocations: u64,
    /// Bytes of memory referenced: for a kernel, the sizes of the distinct live buffers its
    /// pointer arguments point into; for a product, its operands and output (twice the
    /// output when it accumulates); for a copy or memset, its bytes. An upper bound on the
    /// traffic (a kernel may touch part of a buffer), exact for whole-buffer kernels.
    pub bytes_touched: u64,
    /// NCCL collectives (`NcclComm`'s all-reduce, broadcast, reduce-scatter, all-gather; not
    /// in `launches`).
    pub collectives: u64,
    /// Bytes of the buffers the collectives reduce or fill (the all-reduced or broadcast
    /// buffer, the reduce-scatter's input, the all-gather's output).
    pub collective_bytes: u64,
    /// Replays of captured CUDA graphs (`graph.rs`): each also counts the work it queues,
    /// launch by launch, as the eager step would.
    pub graph_launches: u64,
}

/// [`DeviceCounters`]' scalar fields, listed once: their names (for reports and JSON) and
/// their values, read and written in this order.
macro_rules! scalar_fields {
    ($($field:ident),* $(,)?) => {
        const FIELD_NAMES: [&str; SCALAR_FIELDS] = [$(stringify!($field)),*];

        impl DeviceCounters {
            fn fields(&self) -> [u64; SCALAR_FIELDS] {
                [$(self.$field),*]
            }

            fn fields_mut(&mut self) -> [&mut u64; SCALAR_FIELDS] {
                [$(&mut self.$field),*]
            }
        }
    };
}

/// How many scalar counters [`DeviceCounters`] has.
const SCALAR_FIELDS: usize = 20;

scalar_fields!(
    launches,
    bf16_gemm_calls,
    f32_gemm_calls,
    bf16_tensor_core_gemm_flops,
    f32_simt_gemm_flops,
    memsets,
    syncs,
    host_to_device_copies,
    host_to_device_bytes,
    device_to_host_copies,
    device_to_host_bytes,
    pageable_copies,
    pinned_copies,
    device_copies,
    buffer_requests,
    driver_allocations,
    bytes_touched,
    collectives,
    collective_bytes,
    graph_launches,
);

impl DeviceCounters {
    /// What was counted after `earlier` (a snapshot of the same device): `self - earlier`.
    pub fn since(&self, earlier: &DeviceCounters) -> DeviceCounters {
        let mut delta = self.clone();
        for (name, count) in delta.launches_by_kernel.iter_mut() {
            *count = count.saturating_sub(earlier.launches_by_kernel.get(name).copied().unwrap_or(0));
        }
        delta.launches_by_kernel.retain(|_, count| *count > 0);
        for (name, bytes) in delta.bytes_by_kernel.iter_mut() {
            *bytes = bytes.saturating_sub(earlier.bytes_by_kernel.get(name).copied().unwrap_or(0));
        }
        delta.bytes_by_kernel.retain(|name, _| delta.launches_by_kernel.contains_key(name));
        for (field, before) in delta.fields_mut().into_iter().zip(earlier.fields()) {
            *field = field.saturating_sub(before);
        }
        delta
    }

    /// The scalar counters with their field names, for reports and JSON.
    pub fn totals(&self) -> [(&'static str, u64); SCALAR_FIELDS] {
        let values = self.fields();
        std::array::from_fn(|i| (FIELD_NAMES[i], values[i]))
    }
}

/// The precision of a cuBLAS product, for counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmKind {
    /// bf16 operands on the tensor cores.
    Bf16TensorCore,
    /// f32 on the CUDA cores.
    F32Simt,
}

/// The live counters of one device (everything but the allocator's, read at snapshot time).
#[derive(Default)]
pub(crate) struct Counters {
    state: Mutex<DeviceCounters>,
}

impl Counters {
    fn lock(&self) -> MutexGuard<'_, DeviceCounters> {
        // Every update is a few additions: a poisoned lock still holds consistent counts.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A snapshot, with the allocator's `buffer_requests` and `driver_allocations` filled in.
    pub(crate) fn snapshot(&self, buffer_requests: u64, driver_allocations: u64) -> DeviceCounters {
        DeviceCounters { buffer_requests, driver_allocations, ..self.lock().clone() }
    }

    /// Sets the counts back to `snapshot` (the allocator's two are not kept here).
    pub(crate) fn restore(&self, snapshot: &DeviceCounters) {
        *self.lock() = DeviceCounters { buffer_requests: 0, driver_allocations: 0, ..snapshot.clone() };
    }

    /// One graph replay queueing `work` (a capture's counts, without allocator requests).
    pub(crate) fn replay(&self, work: &DeviceCounters) {
        let mut c = self.lock();
        for (name, count) in &work.launches_by_kernel {
            *c.launches_by_kernel.entry(name).or_default() += count;
        }
        for (name, bytes) in &work.bytes_by_kernel {
            *c.bytes_by_kernel.entry(name).or_default() += bytes;
        }
        for (field, add) in c.fields_mut().into_iter().zip(work.fields()) {
            *field += add;
        }
        c.graph_launches += 1;
    }

    /// One kernel launch of `name` referencing `bytes`.
    pub(crate) fn kernel(&self, name: &'static str, bytes: u64) {
        let mut c = self.lock();
        c.launches += 1;
        *c.launches_by_kernel.entry(name).or_default() += 1;
        *c.bytes_by_kernel.entry(name).or_default() += bytes;
        c.bytes_touched += bytes;
    }

    /// One cuBLAS call `name` of `kind` doing `flops` over `bytes`.
    pub(crate) fn gemm(&self, name: &'static str, kind: GemmKind, flops: u64, bytes: u64) {
        let mut c = self.lock();
        c.launches += 1;
        *c.launches_by_kernel.entry(name).or_default() += 1;
        *c.bytes_by_kernel.entry(name).or_default() += bytes;
        c.bytes_touched += bytes;
        match kind {
            GemmKind::Bf16TensorCore => {
                c.bf16_gemm_calls += 1;
                c.bf16_tensor_core_gemm_flops += flops;
            }
            GemmKind::F32Simt => {
                c.f32_gemm_calls += 1;
                c.f32_simt_gemm_flops += flops;
            }
        }
    }

    /// One memset of `bytes`.
    pub(crate) fn memset(&self, bytes: usize) {
        let mut c = self.lock();
        c.memsets += 1;
        c.bytes_touched += bytes as u64;
    }

    /// One wait of the host for the device.
    pub(crate) fn sync(&self) {
        self.lock().syncs += 1;
    }

    /// One copy of `bytes` from page-locked host memory to the device.
    pub(crate) fn upload(&self, bytes: usize) {
        let mut c = self.lock();
        c.host_to_device_copies += 1;
        c.host_to_device_bytes += bytes as u64;
        c.pinned_copies += 1;
        c.bytes_touched += bytes as u64;
    }

    /// One copy of `bytes` from the device to pageable host memory.
    pub(crate) fn download(&self, bytes: usize) {
        let mut c = self.lock();
        c.device_to_host_copies += 1;
        c.device_to_host_bytes += bytes as u64;
        c.pageable_copies += 1;
        c.bytes_touched += bytes as u64;
    }

    /// One copy of `bytes` from the device to page-locked host memory (a readback).
    pub(crate) fn readback(&self, bytes: usize) {
        let mut c = self.lock();
        c.device_to_host_copies += 1;
        c.device_to_host_bytes += bytes as u64;
        c.pinned_copies += 1;
        c.bytes_touched += bytes as u64;
    }

    /// One device → device copy of `bytes` (read and written: twice the bytes touched).
    pub(crate) fn device_copy(&self, bytes: usize) {
        let mut c = self.lock();
        c.device_copies += 1;
        c.bytes_touched += 2 * bytes as u64;
    }

    /// One NCCL collective over a buffer of `bytes`.
    #[cfg(feature = "nccl")]
    pub(crate) fn collective(&self, bytes: usize) {
        let mut c = self.lock();
        c.collectives += 1;
        c.collective_bytes += bytes as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_subtracts_every_field_and_drops_kernels_not_launched_in_between() {
        let counters = Counters::default();
        counters.kernel("a", 100);
        counters.gemm("cublasSgemm", GemmKind::F32Simt, 2_000, 48);
        let before = counters.snapshot(3, 1);
        counters.kernel("b", 10);
        counters.kernel("b", 10);
        counters.gemm("cublasGemmEx", GemmKind::Bf16TensorCore, 4_000, 24);
        counters.upload(8);
        counters.download(4);
        counters.sync();
        counters.memset(16);
        counters.device_copy(32);
        #[cfg(feature = "nccl")]
        counters.collective(40);
        let delta = counters.snapshot(5, 1).since(&before);
        assert_eq!(delta.launches_by_kernel, BTreeMap::from([("b", 2), ("cublasGemmEx", 1)]));
        assert_eq!(delta.bytes_by_kernel, BTreeMap::from([("b", 20), ("cublasGemmEx", 24)]));
        let totals: BTreeMap<&str, u64> = delta.totals().into_iter().collect();
        let expected = [
            ("launches", 3),
            ("bf16_gemm_calls", 1),
            ("f32_gemm_calls", 0),
            ("bf16_tensor_core_gemm_flops", 4_000),
            ("f32_simt_gemm_flops", 0),
            ("memsets", 1),
            ("syncs", 1),
            ("host_to_device_copies", 1),
            ("host_to_device_bytes", 8),
            ("device_to_host_copies", 1),
            ("device_to_host_bytes", 4),
            ("pageable_copies", 1),
            ("pinned_copies", 1),
            ("device_copies", 1),
            ("buffer_requests", 2),
            ("driver_allocations", 0),
            ("bytes_touched", 20 + 24 + 8 + 4 + 16 + 64),
            ("collectives", u64::from(cfg!(feature = "nccl"))),
            ("collective_bytes", if cfg!(feature = "nccl") { 40 } else { 0 }),
            ("graph_launches", 0),
        ];
        assert_eq!(totals, BTreeMap::from(expected));
    }

    #[test]
    fn a_replay_counts_its_captures_work_once_more_and_one_graph_launch() {
        let counters = Counters::default();
        counters.kernel("a", 8);
        let before = counters.snapshot(0, 0);
        counters.kernel("b", 10);
        counters.memset(4);
        let work = counters.snapshot(0, 0).since(&before);
        counters.restore(&before);
        assert_eq!(counters.snapshot(0, 0), before, "a restore forgets the capture's counts");
        counters.replay(&work);
        counters.replay(&work);
        let after = counters.snapshot(0, 0).since(&before);
        assert_eq!(after.launches_by_kernel, BTreeMap::from([("b", 2)]));
        assert_eq!(after.bytes_by_kernel, BTreeMap::from([("b", 20)]));
        assert_eq!((after.launches, after.memsets, after.bytes_touched, after.graph_launches), (2, 2, 28, 2));
    }
}
