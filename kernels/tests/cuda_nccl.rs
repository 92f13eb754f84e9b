//! NCCL on device buffers (`kernels::cuda::nccl`).
//!
//! On the emulated device (feature `cuda-emu`): 1-3 ranks as threads, each with its own
//! emulated `CudaDevice`, rank 0's id shipped to the others as bytes (as a rendezvous
//! would); every collective's result is identical on every rank and bit-identical to the host
//! collective on the same host data (the emulated NCCL *is* the host collective on the
//! buffers' pages). On a GPU (`TRANSPONDER_CUDA` unset or `driver`): real NCCL at world
//! size 1, where every collective is a copy; skipped with the reason when there is no GPU or
//! no libnccl (`TRANSPONDER_REQUIRE_NCCL=1` turns that skip into a failure).
#![cfg(feature = "nccl")]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use kernels::cuda::nccl::{unique_id, NcclComm, ReduceOp};
use kernels::cuda::CudaDevice;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const TIMEOUT: Duration = Duration::from_secs(10);

/// A deterministic value in [-1, 1) for element `i` of rank `rank`.
fn value(rank: usize, i: usize) -> f32 {
    let x = (rank as u64 * 7919 + i as u64 * 104_729).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    x as f32 / (1u64 << 23) as f32 - 1.0
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[cfg(feature = "cuda-emu")]
mod emulated {
    use std::sync::mpsc;

    use kernels::collective::HostComm;
    use kernels::cuda::nccl::UniqueId;
    use kernels::cuda::CudaError;

    use super::*;

    /// Every result of one rank: the device's, the host collective's on the same data, and
    /// whether every rank gets the same (not so for reduce-scatter's chunks).
    type Results = Vec<(Vec<u32>, Vec<u32>, bool)>;

    /// One rank: its emulated device, the communicator from rank 0's shipped id, and the same
    /// calls on the device and on the host collective.
    fn rank_body(
        rank: usize,
        world: usize,
        ids: &[mpsc::Sender<[u8; 128]>],
        id: Option<&mpsc::Receiver<[u8; 128]>>,
        host_id: UniqueId,
    ) -> Results {
        let device = Arc::new(CudaDevice::emulated().expect("the emulated device opens"));
        let id = match id {
            None => {
                let id = unique_id(&device, LOOPBACK).expect("rank 0 makes the id");
                ids.iter().for_each(|tx| tx.send(id.to_bytes()).expect("ship the id"));
                id
            }
            Some(rx) => UniqueId::from_bytes(rx.recv().expect("the id from rank 0")),
        };
        let mut comm = NcclComm::init(&device, &id, rank, world, TIMEOUT).expect("init");
        let mut host = HostComm::init(&host_id, rank, world, TIMEOUT).expect("host init");
        assert_eq!((comm.rank(), comm.world_size()), (rank, world));
        assert_eq!(comm.describe(), "emulated NCCL (host collective)");
        let mut results = Results::new();
        let before = device.counters();
        let sizes = [0, 1, world + 1, 10_007];
        for n in sizes {
            let data: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let mut buffer = device.upload(&data).unwrap();
                comm.all_reduce(&mut buffer, op).expect("all_reduce");
                let mut reference = data.clone();
                host.all_reduce(&mut reference, op).expect("host all_reduce");
                results.push((bits(&device.download(&buffer).unwrap()), bits(&reference), true));
            }
            for root in 0..world {
                let mut buffer = device.upload(&data).unwrap();
                comm.broadcast(&mut buffer, root).expect("broadcast");
                let want: Vec<f32> = (0..n).map(|i| value(root, i)).collect();
                results.push((bits(&device.download(&buffer).unwrap()), bits(&want), true));
            }
            let whole: Vec<f32> = (0..n * world).map(|i| value(rank, i)).collect();
            let send = device.upload(&whole).unwrap();
            let mut chunk = device.alloc::<f32>(n).unwrap();
            comm.reduce_scatter(&send, &mut chunk, ReduceOp::Sum).expect("reduce_scatter");
            let mut host_chunk = vec![0.0f32; n];
            host.reduce_scatter(&whole, &mut host_chunk, ReduceOp::Sum).expect("host reduce_scatter");
            results.push((bits(&device.download(&chunk).unwrap()), bits(&host_chunk), false));
            let mut gathered = device.alloc::<f32>(n * world).unwrap();
            comm.all_gather(&chunk, &mut gathered).expect("all_gather");
            let mut host_gathered = vec![0.0f32; n * world];
            host.all_gather(&host_chunk, &mut host_gathered).expect("host all_gather");
            results.push((bits(&device.download(&gathered).unwrap()), bits(&host_gathered), true));
        }

        let counted = device.counters().since(&before);
        assert_eq!(counted.collectives, (sizes.len() * (3 + world + 2)) as u64, "every collective is counted");
        let bytes: usize = sizes.iter().map(|n| 4 * n * (3 + world + world + world)).sum();
        assert_eq!(
            counted.collective_bytes, bytes as u64,
            "all_reduce, broadcast: n; reduce_scatter, all_gather: n × W"
        );
        let send = device.upload(&[1.0f32; 5]).unwrap();
        let mut recv = device.alloc::<f32>(2).unwrap();
        let wrong = comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum);
        assert!(matches!(wrong, Err(CudaError::Shape { .. })), "5 is not 2 × {world}: {wrong:?}");
        let other = CudaDevice::emulated().unwrap();
        let mut foreign = other.upload(&[1.0f32]).unwrap();
        assert!(
            matches!(comm.all_reduce(&mut foreign, ReduceOp::Sum), Err(CudaError::Shape { .. })),
            "another device's buffer"
        );
        assert!(matches!(comm.broadcast(&mut recv, world), Err(CudaError::Shape { .. })), "root out of range");
        assert_eq!(device.counters().since(&before).collectives, counted.collectives, "refused calls are not counted");

        let watchdog = comm.watchdog_handle();
        watchdog.async_error().expect("no asynchronous error");
        comm.async_error().expect("no asynchronous error");
        watchdog.abort().expect("abort");
        assert!(watchdog.async_error().is_err(), "an aborted communicator reports it");
        let after = comm.all_reduce(&mut recv, ReduceOp::Sum).expect_err("aborted");
        assert!(after.to_string().contains("aborted"), "{after}");
        results
    }

    #[test]
    fn ranks_on_emulated_devices_agree_with_each_other_and_the_host_collective() {
        for world in 1..=3 {
            let host_id = UniqueId::new(LOOPBACK).expect("host collective id");
            let (senders, receivers): (Vec<_>, Vec<_>) = (1..world).map(|_| mpsc::channel()).unzip();
            let results: Vec<Results> = std::thread::scope(|scope| {
                let senders = &senders;
                let mut handles = vec![scope.spawn(move || rank_body(0, world, senders, None, host_id))];
                for (i, rx) in receivers.into_iter().enumerate() {
                    handles.push(scope.spawn(move || rank_body(i + 1, world, &[], Some(&rx), host_id)));
                }
                handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
            });
            for (rank, result) in results.iter().enumerate() {
                for (case, (device, reference, same_everywhere)) in result.iter().enumerate() {
                    assert_eq!(device, reference, "world {world}, rank {rank}, case {case}: device vs host collective");
                    if *same_everywhere {
                        assert_eq!(device, &results[0][case].0, "world {world}, rank {rank}, case {case}: vs rank 0");
                    }
                }
            }
        }
    }
}

/// On a GPU with libnccl: a one-rank communicator, where every collective is a copy.
#[test]
fn one_rank_on_a_gpu_is_the_identity() {
    let device = match CudaDevice::new(0) {
        Ok(device) if !device.is_emulated() => Arc::new(device),
        Ok(_) => return println!("skipping: no GPU (the emulated device is covered above)"),
        Err(e) => {
            assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: {e}");
            return println!("skipping: no CUDA device ({e})");
        }
    };
    let id = match unique_id(&device, LOOPBACK) {
        Ok(id) => id,
        Err(e) => {
            assert!(std::env::var_os("TRANSPONDER_REQUIRE_NCCL").is_none(), "TRANSPONDER_REQUIRE_NCCL is set: {e}");
            return println!("skipping: no NCCL ({e})");
        }
    };
    let mut comm = NcclComm::init(&device, &id, 0, 1, TIMEOUT).expect("ncclCommInitRank, one rank");
    println!("{} on {}", comm.describe(), device.name());
    assert!(comm.describe().starts_with("NCCL 2."), "{}", comm.describe());
    let data: Vec<f32> = (0..100_003).map(|i| value(0, i)).collect();
    let mut buffer = device.upload(&data).unwrap();
    comm.all_reduce(&mut buffer, ReduceOp::Sum).expect("all_reduce");
    comm.broadcast(&mut buffer, 0).expect("broadcast");
    assert_eq!(bits(&device.download(&buffer).unwrap()), bits(&data), "one rank: all_reduce and broadcast copy");
    let mut chunk = device.alloc::<f32>(data.len()).unwrap();
    comm.reduce_scatter(&buffer, &mut chunk, ReduceOp::Max).expect("reduce_scatter");
    let mut gathered = device.alloc::<f32>(data.len()).unwrap();
    comm.all_gather(&chunk, &mut gathered).expect("all_gather");
    assert_eq!(bits(&device.download(&gathered).unwrap()), bits(&data), "one rank: reduce_scatter and all_gather copy");
    let mut empty = device.alloc::<f32>(0).unwrap();
    comm.all_reduce(&mut empty, ReduceOp::Sum).expect("an empty all_reduce");
    device.synchronize().expect("the stream finishes");
    comm.async_error().expect("no asynchronous error");
    let watchdog = comm.watchdog_handle();
    drop(comm);
    assert!(watchdog.async_error().is_err(), "a destroyed communicator is closed for its watchdog too");
    watchdog.abort().expect("aborting a closed communicator does nothing");
}

#[test]
fn communicators_and_watchdog_handles_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<NcclComm>();
    send_sync::<kernels::cuda::nccl::NcclWatchdogHandle>();
}
