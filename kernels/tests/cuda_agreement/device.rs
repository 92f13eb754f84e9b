//! The device itself: every kernel family compiles, the caching allocator reuses its blocks,
//! and copies (host ↔ device, within the device, f32 ↔ bf16) round-trip.

use half::bf16;
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer};

use super::{down, up, Rng};

#[test]
fn every_kernel_family_compiles() {
    let dev = device_or_skip!();
    println!("{dev:?}");
    dev.compile_all().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn caching_allocator_reuses_blocks_across_steps() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => return println!("skipping: no CUDA device ({e})"),
    };
    let sizes = [1000usize, 4096, 123_457, 1 << 20];
    let step = |dev: &CudaDevice| {
        let buffers: Vec<DeviceBuffer<f32>> = sizes.iter().map(|&n| dev.alloc(n).expect("alloc")).collect();
        let tail: DeviceBuffer<bf16> = dev.alloc(777).expect("alloc");
        drop(tail);
        buffers
    };
    drop(step(&dev));
    let first = dev.allocator_stats();
    // The small buffers share one 2 MiB segment, the 4 MiB one has a 20 MiB segment.
    assert_eq!(first.allocations, 2, "{first:?}");
    assert_eq!(first.reserved_bytes, 22 << 20, "{first:?}");
    for _ in 0..3 {
        drop(step(&dev));
    }
    let after = dev.allocator_stats();
    assert_eq!(after.allocations, first.allocations, "a repeated step allocated again: {after:?}");
    assert_eq!(after.reuses, first.reuses + 3 * (sizes.len() as u64 + 1), "{after:?}");
    assert_eq!(after.cached_bytes, after.reserved_bytes, "everything is back in the cache");
    assert_eq!(after.in_use_bytes, 0, "{after:?}");
    // Sizes the step never asked for are served from what it gave back.
    let again: Vec<DeviceBuffer<f32>> =
        [1001, 300_000, 3 << 20].iter().map(|&n| dev.alloc(n).expect("alloc")).collect();
    assert_eq!(dev.allocator_stats().allocations, first.allocations);
    drop(again);
    dev.release_cached_memory();
    let released = dev.allocator_stats();
    assert_eq!((released.reserved_bytes, released.cached_bytes), (0, 0), "{released:?}");
    assert_eq!(released.peak_reserved_bytes, 22 << 20, "the peak outlives the release");
}

/// The bytes a large buffer gave back hold two smaller ones (split), and merge again into
/// one block that holds the large size.
#[test]
fn caching_allocator_splits_and_merges_its_segments() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => return println!("skipping: no CUDA device ({e})"),
    };
    dev.release_cached_memory();
    let base = dev.allocator_stats();
    let large: DeviceBuffer<f32> = dev.alloc(6 << 20).expect("alloc");
    let held = dev.allocator_stats();
    assert_eq!((held.allocations - base.allocations, held.reserved_bytes), (1, 24 << 20), "{held:?}");
    drop(large);
    let halves: Vec<DeviceBuffer<f32>> = (0..2).map(|_| dev.alloc(3 << 20).expect("alloc")).collect();
    assert_eq!(dev.allocator_stats().allocations, held.allocations, "the halves fit the freed bytes");
    drop(halves);
    let again: DeviceBuffer<f32> = dev.alloc(6 << 20).expect("alloc");
    let merged = dev.allocator_stats();
    assert_eq!(merged.allocations, held.allocations, "the halves merged back: {merged:?}");
    assert_eq!(merged.reserved_bytes, 24 << 20);
    drop(again);
}

#[test]
fn copies_round_trip_and_zero() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(1);
    let host = rng.vec(1003, -3.0, 3.0);
    let buffer = up(dev, &host);
    assert_eq!(down(dev, &buffer), host);
    let halves: Vec<bf16> = host.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(dev.download(&dev.upload(&halves).unwrap()).unwrap(), halves);
    let ids: Vec<u32> = (0..77).map(|i| i * 3).collect();
    assert_eq!(dev.download(&dev.upload(&ids).unwrap()).unwrap(), ids);
    let mut target = dev.zeros::<f32>(10).unwrap();
    assert_eq!(down(dev, &target), vec![0.0; 10]);
    dev.copy_within_device(&buffer, 5, &mut target, 2, 8).unwrap();
    assert_eq!(&down(dev, &target)[2..], &host[5..13]);
    // f32 → bf16 on the device rounds like half::bf16::from_f32, and back is exact.
    let mut converted = dev.alloc::<bf16>(host.len()).unwrap();
    cuda::elementwise::to_bf16(dev, &buffer, &mut converted).unwrap();
    let got = dev.download(&converted).unwrap();
    assert!(got.iter().zip(&halves).all(|(a, b)| a.to_bits() == b.to_bits()), "bf16 rounding differs");
    let mut widened = dev.alloc::<f32>(host.len()).unwrap();
    cuda::elementwise::to_f32(dev, &converted, &mut widened).unwrap();
    assert_eq!(down(dev, &widened), halves.iter().map(|h| h.to_f32()).collect::<Vec<f32>>());
    // Mismatched lengths are errors, not panics.
    assert!(matches!(dev.copy_to_device(&host[..5], &mut target), Err(CudaError::Shape { .. })));
}

/// A readback gives the values its buffer held when it was queued, though work queued after it
/// overwrites them (it waits for its own copy, not for that work); it takes small buffers only.
#[test]
fn a_readback_holds_the_values_queued_before_it() {
    let dev = device_or_skip!();
    let mut buffer = up(dev, &[1.0f32, 2.0, 3.0, 4.0]);
    let first = dev.read_later(&buffer).unwrap();
    dev.copy_to_device(&[5.0f32, 6.0, 7.0, 8.0], &mut buffer).unwrap();
    let second = dev.read_later(&buffer).unwrap();
    assert_eq!(second.wait().unwrap(), [5.0, 6.0, 7.0, 8.0]);
    assert_eq!(first.wait().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    // The slots go back to the device and serve the next readbacks.
    for round in 0..3 {
        let value = round as f32;
        dev.copy_to_device(&[value; 4], &mut buffer).unwrap();
        assert_eq!(dev.read_later(&buffer).unwrap().wait().unwrap(), [value; 4]);
    }
    let large = up(dev, &[0.0f32; cuda::readback::READBACK_BYTES / 4 + 1]);
    let refused = dev.read_later(&large).map(|_| ()).unwrap_err();
    assert!(refused.to_string().contains("at most"), "{refused}");
}
