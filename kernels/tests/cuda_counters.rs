//! The device counters and the kernel timer count what each entry point queues: launches by
//! kernel, cuBLAS calls and FLOPs by precision, copies, memsets, waits, allocations and the
//! bytes of the buffers a launch references. Exact counts, on a fresh emulated device (the
//! counting code runs before the backend is chosen, so a GPU counts the same).
#![cfg(feature = "cuda-emu")]

use kernels::cpu::matmul::{GemmDims, Store};
use kernels::cuda::blas::{matmul, matmul_bf16, DeviceMat};
use kernels::cuda::elementwise::{axpy, to_bf16};
use kernels::cuda::{CudaDevice, DeviceBuffer, DeviceCounters};

fn device() -> CudaDevice {
    CudaDevice::emulated().expect("the emulated device opens")
}

fn mat<T: kernels::cuda::DeviceScalar>(buffer: &DeviceBuffer<T>, cols: usize) -> DeviceMat<'_, T> {
    DeviceMat { buffer, offset: 0, row_stride: cols, col_stride: 1 }
}

#[test]
fn each_entry_point_counts_what_it_queues() {
    let dev = device();
    let x = dev.upload(&[1.0f32; 64]).unwrap();
    let mut y = dev.zeros::<f32>(64).unwrap();
    let start = dev.counters();

    axpy(&dev, 2.0, &x, &mut y).unwrap();
    let delta = dev.counters().since(&start);
    assert_eq!(delta.launches, 1);
    assert_eq!(delta.launches_by_kernel.get("axpy"), Some(&1));
    assert_eq!(delta.bytes_touched, 2 * 64 * 4, "axpy references x and y");
    assert_eq!((delta.syncs, delta.pageable_copies, delta.buffer_requests), (0, 0, 0));

    let before = dev.counters();
    let host = dev.download(&y).unwrap();
    assert_eq!(host[0], 2.0);
    let delta = dev.counters().since(&before);
    assert_eq!((delta.syncs, delta.device_to_host_copies, delta.device_to_host_bytes), (1, 1, 256));
    assert_eq!((delta.pageable_copies, delta.launches), (1, 0));

    let before = dev.counters();
    let (m, n, k) = (4, 8, 2);
    let a = dev.upload(&vec![1.0f32; m * k]).unwrap();
    let b = dev.upload(&vec![1.0f32; k * n]).unwrap();
    let mut c = dev.alloc::<f32>(m * n).unwrap();
    matmul(&dev, &mut c, 0, mat(&a, k), mat(&b, n), GemmDims { m, n, k }, Store::Overwrite).unwrap();
    let (mut a16, mut b16) = (dev.alloc(m * k).unwrap(), dev.alloc(k * n).unwrap());
    to_bf16(&dev, &a, &mut a16).unwrap();
    to_bf16(&dev, &b, &mut b16).unwrap();
    matmul_bf16(&dev, &mut c, 0, mat(&a16, k), mat(&b16, n), GemmDims { m, n, k }, Store::Accumulate).unwrap();
    let delta = dev.counters().since(&before);
    assert_eq!(delta.f32_gemm_calls, 1);
    assert_eq!(delta.f32_simt_gemm_flops, (2 * m * n * k) as u64);
    assert_eq!(delta.bf16_gemm_calls, 1);
    assert_eq!(delta.bf16_tensor_core_gemm_flops, (2 * m * n * k) as u64);
    assert_eq!(delta.launches, 4, "two products and two conversions");
    assert_eq!(delta.launches_by_kernel.get("cublasSgemm"), Some(&1));
    assert_eq!(delta.launches_by_kernel.get("cublasGemmEx"), Some(&1));
    assert_eq!((delta.host_to_device_copies, delta.host_to_device_bytes), (2, ((m * k + k * n) * 4) as u64));
    assert_eq!(delta.buffer_requests, 5, "a, b, c, a16, b16");
    assert_eq!(delta.driver_allocations, 0, "they fit in the 2 MiB segment that x and y were placed in");
}

#[test]
fn a_repeated_step_reuses_every_block_and_counts_no_driver_allocation() {
    let dev = device();
    let step = |dev: &CudaDevice| {
        let x = dev.upload(&[0.5f32; 1000]).unwrap();
        let mut y = dev.zeros::<f32>(1000).unwrap();
        axpy(dev, 1.0, &x, &mut y).unwrap();
    };
    step(&dev);
    let before = dev.counters();
    step(&dev);
    let delta: DeviceCounters = dev.counters().since(&before);
    assert_eq!((delta.buffer_requests, delta.driver_allocations), (2, 0));
    assert_eq!((delta.memsets, delta.launches, delta.pageable_copies, delta.pinned_copies), (1, 1, 0, 1));
}

#[test]
fn uploads_go_through_the_pinned_staging_ring_which_a_warm_step_reuses_without_allocating() {
    let dev = device();
    // Three per-step uploads of different sizes (token ids, targets, an index table) and one
    // longer than a staging chunk (4 MiB), which goes in two chunks.
    let long: Vec<f32> = (0..(1 << 20) + 3).map(|i| i as f32).collect();
    let ids: Vec<u32> = (0..16).collect();
    let table: Vec<u32> = (0..2000).rev().collect();
    let step = |dev: &CudaDevice| {
        let buffers = (dev.upload(&ids).unwrap(), dev.upload(&table).unwrap(), dev.upload(&long).unwrap());
        assert_eq!(dev.download(&buffers.0).unwrap(), ids);
        assert_eq!(dev.download(&buffers.1).unwrap(), table);
        assert_eq!(dev.download(&buffers.2).unwrap(), long);
    };
    let fresh = dev.counters();
    step(&dev);
    let warm_up = dev.counters().since(&fresh);
    assert!(warm_up.driver_allocations > 3, "the device blocks and at least one staging slot");
    let before = dev.counters();
    step(&dev);
    let delta = dev.counters().since(&before);
    assert_eq!(delta.driver_allocations, 0, "a warm ring has a free slot for every upload");
    assert_eq!((delta.host_to_device_copies, delta.pinned_copies), (4, 4), "the long upload is two chunks");
    assert_eq!(delta.host_to_device_bytes, ((ids.len() + table.len() + long.len()) * 4) as u64);
    assert_eq!(delta.pageable_copies, 3, "only the downloads are pageable");
}

#[test]
fn the_kernel_timer_times_every_launch_while_it_runs_and_nothing_after() {
    let dev = device();
    let x = dev.upload(&[1.0f32; 256]).unwrap();
    let mut y = dev.zeros::<f32>(256).unwrap();
    axpy(&dev, 1.0, &x, &mut y).unwrap();
    assert!(dev.stop_kernel_timer().unwrap().is_empty(), "nothing is timed before the timer starts");

    dev.start_kernel_timer();
    for _ in 0..3 {
        axpy(&dev, 1.0, &x, &mut y).unwrap();
    }
    let mut y16 = dev.alloc(256).unwrap();
    to_bf16(&dev, &y, &mut y16).unwrap();
    let times = dev.stop_kernel_timer().unwrap();
    let calls: Vec<(&str, &str, u64)> = times.iter().map(|t| (t.name, t.family, t.calls)).collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.contains(&("axpy", "elementwise", 3)), "{calls:?}");
    assert!(calls.contains(&("f32_to_bf16_kernel", "elementwise", 1)), "{calls:?}");
    assert!(times.iter().all(|t| t.ms >= 0.0 && t.ms.is_finite()));
    assert!(times.windows(2).all(|w| w[0].ms >= w[1].ms), "slowest first");
    let families = kernels::cuda::timer::by_family(&times);
    assert_eq!(families.len(), 1);
    assert_eq!((families[0].0, families[0].1), ("elementwise", 4));

    axpy(&dev, 1.0, &x, &mut y).unwrap();
    assert!(dev.stop_kernel_timer().unwrap().is_empty(), "a stopped timer collects nothing");
}
