//! The host collective (`kernels::collective`) with ranks as threads over loopback: results
//! bit-identical on every rank and close to an f64 reference, every collective for world
//! sizes 1-4 and awkward sizes, and the failures NCCL would hang on (mismatched calls, a
//! closed peer, a silent peer, a bad rendezvous) as errors that name the ranks.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kernels::collective::{CollectiveError, HostComm, ReduceOp, UniqueId};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `body(rank, comm)` on `world` threads joined into one communicator; the results by rank.
fn with_ranks<R: Send>(world: usize, body: impl Fn(usize, HostComm) -> R + Sync) -> Vec<R> {
    let id = UniqueId::new(LOOPBACK).expect("rank 0 binds on loopback");
    let id = UniqueId::from_bytes(id.to_bytes());
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                scope.spawn(move || body(rank, HostComm::init(&id, rank, world, TIMEOUT).expect("init")))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// A deterministic value in [-1, 1) for element `i` of rank `rank` (seed `seed`).
fn value(seed: u64, rank: usize, i: usize) -> f64 {
    let mut x =
        seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

fn sizes(world: usize) -> Vec<usize> {
    vec![0, 1, world - 1, world + 1, 7, 1001, 100_003]
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn all_reduce_is_identical_on_every_rank_and_close_to_the_reference() {
    for world in 1..=4 {
        let results = with_ranks(world, |rank, mut comm| {
            let mut out = Vec::new();
            for (case, &n) in sizes(world).iter().enumerate() {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                    let mut data: Vec<f32> = (0..n).map(|i| value(case as u64, rank, i) as f32).collect();
                    comm.all_reduce(&mut data, op).expect("all_reduce");
                    out.push(data);
                }
                let mut wide: Vec<f64> = (0..n).map(|i| value(case as u64, rank, i)).collect();
                comm.all_reduce(&mut wide, ReduceOp::Sum).expect("f64 all_reduce");
                let mut ints: Vec<u64> = (0..n).map(|i| (rank * 1_000_003 + i) as u64).collect();
                comm.all_reduce(&mut ints, ReduceOp::Sum).expect("u64 all_reduce");
                out.push(wide.iter().map(|&v| v as f32).collect());
                assert!(ints
                    .iter()
                    .enumerate()
                    .all(|(i, &v)| v == (0..world).map(|r| (r * 1_000_003 + i) as u64).sum()));
            }
            out
        });
        for rank in 1..world {
            let same = results[rank].iter().zip(&results[0]).all(|(a, b)| bits(a) == bits(b));
            assert!(same, "world {world}: rank {rank} differs from rank 0");
        }
        for case in 0..sizes(world).len() {
            let got = &results[0][4 * case..4 * case + 4];
            for (i, &sum_got) in got[0].iter().enumerate() {
                let terms: Vec<f64> = (0..world).map(|r| value(case as u64, r, i) as f32 as f64).collect();
                let sum: f64 = terms.iter().sum();
                let scale: f64 = terms.iter().map(|t| t.abs()).sum();
                assert!((sum_got as f64 - sum).abs() <= 1e-6 * world as f64 * scale + 1e-30, "sum {i}");
                assert!((got[3][i] as f64 - sum).abs() <= 1e-6 * scale + 1e-30, "f64 sum {i}");
                let max = terms.iter().cloned().fold(f64::MIN, f64::max);
                let min = terms.iter().cloned().fold(f64::MAX, f64::min);
                assert_eq!((got[1][i] as f64, got[2][i] as f64), (max, min), "max/min {i} exact");
            }
        }
    }
}

#[test]
fn broadcast_copies_the_root_to_every_rank() {
    for world in 1..=4 {
        let results = with_ranks(world, |rank, mut comm| {
            let mut out = Vec::new();
            for root in 0..world {
                for &n in &[0, 1, 5, 100_003] {
                    let mut data: Vec<f32> = (0..n).map(|i| value(root as u64, rank, i) as f32).collect();
                    comm.broadcast(&mut data, root).expect("broadcast");
                    out.push((root, data));
                }
            }
            out
        });
        for result in &results {
            for (root, data) in result {
                let want: Vec<f32> = (0..data.len()).map(|i| value(*root as u64, *root, i) as f32).collect();
                assert_eq!(bits(data), bits(&want), "world {world}, root {root}");
            }
        }
    }
}

#[test]
fn reduce_scatter_then_all_gather_is_an_all_reduce() {
    for world in 1..=4 {
        let results = with_ranks(world, |rank, mut comm| {
            let mut out = Vec::new();
            for chunk in [0, 1, 3, 25_001] {
                let send: Vec<f32> = (0..chunk * world).map(|i| value(9, rank, i) as f32).collect();
                let mut mine = vec![f32::NAN; chunk];
                comm.reduce_scatter(&send, &mut mine, ReduceOp::Sum).expect("reduce_scatter");
                let mut whole = vec![f32::NAN; chunk * world];
                comm.all_gather(&mine, &mut whole).expect("all_gather");
                let ints: Vec<u64> = (0..chunk).map(|i| (rank * 100 + i) as u64).collect();
                let mut gathered = vec![0u64; chunk * world];
                comm.all_gather(&ints, &mut gathered).expect("u64 all_gather");
                let expected: Vec<u64> =
                    (0..world).flat_map(|r| (0..chunk).map(move |i| (r * 100 + i) as u64)).collect();
                assert_eq!(gathered, expected, "chunk r of all_gather comes from rank r");
                out.push(whole);
            }
            out
        });
        for rank in 1..world {
            assert!(results[rank].iter().zip(&results[0]).all(|(a, b)| bits(a) == bits(b)), "rank {rank} differs");
        }
        for whole in &results[0] {
            for (i, &got) in whole.iter().enumerate() {
                let terms: Vec<f64> = (0..world).map(|r| value(9, r, i) as f32 as f64).collect();
                let sum: f64 = terms.iter().sum();
                let scale: f64 = terms.iter().map(|t| t.abs()).sum();
                assert!((got as f64 - sum).abs() <= 1e-6 * world as f64 * scale + 1e-30, "element {i}");
            }
        }
    }
}

#[test]
fn barriers_and_bad_arguments() {
    let results = with_ranks(3, |rank, mut comm| {
        comm.barrier().expect("barrier");
        let wrong = comm.reduce_scatter(&[1.0f32; 5], &mut [0.0f32; 2], ReduceOp::Sum);
        assert!(matches!(wrong, Err(CollectiveError::InvalidArgument(_))), "{wrong:?}");
        let wrong = comm.all_gather(&[1.0f32; 2], &mut [0.0f32; 5]);
        assert!(matches!(wrong, Err(CollectiveError::InvalidArgument(_))), "{wrong:?}");
        let wrong = comm.broadcast(&mut [1.0f32], 3);
        assert!(matches!(wrong, Err(CollectiveError::InvalidArgument(_))), "{wrong:?}");
        comm.barrier().expect("bad arguments send nothing, so the ranks stay in step");
        (rank, comm.rank(), comm.world_size())
    });
    assert_eq!(results, vec![(0, 0, 3), (1, 1, 3), (2, 2, 3)]);
    let bad = HostComm::init(&UniqueId::new(LOOPBACK).unwrap(), 2, 2, TIMEOUT);
    assert!(matches!(bad, Err(CollectiveError::InvalidArgument(_))), "rank 2 of 2");
    let bad = UniqueId::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    assert!(matches!(bad, Err(CollectiveError::InvalidArgument(_))), "0.0.0.0 cannot be reached");
    let foreign = HostComm::init(&UniqueId::from_bytes([7; 128]), 1, 2, TIMEOUT);
    assert!(matches!(foreign, Err(CollectiveError::Bootstrap(_))), "{foreign:?}");
}

#[test]
fn mismatched_calls_fail_fast_naming_both_ranks() {
    let start = Instant::now();
    let errors = with_ranks(2, |rank, mut comm| {
        let mut data = vec![1.0f32; 10 + rank];
        let first = comm.all_reduce(&mut data, ReduceOp::Sum).expect_err("counts 10 and 11 differ");
        let later = comm.all_reduce(&mut [1.0f32; 10], ReduceOp::Sum).expect_err("a failed communicator refuses");
        (first.to_string(), matches!(first, CollectiveError::Mismatch { .. }), later)
    });
    for (rank, (message, mismatch, later)) in errors.iter().enumerate() {
        assert!(mismatch, "rank {rank}: {message}");
        let peer = 1 - rank;
        for text in [format!("rank {rank} is in all_reduce #0 (Sum, {} × f32)", 10 + rank), format!("rank {peer}")] {
            assert!(message.contains(&text), "rank {rank}: {message:?} lacks {text:?}");
        }
        assert!(matches!(later, CollectiveError::Failed { .. }), "{later:?}");
    }

    let errors = with_ranks(3, |rank, mut comm| {
        comm.barrier().expect("barrier");
        let result = match rank {
            1 => comm.all_reduce(&mut [0.0f64; 4], ReduceOp::Max),
            _ => comm.all_reduce(&mut [0.0f32; 4], ReduceOp::Sum),
        };
        result.expect_err("f64 Max against f32 Sum").to_string()
    });
    let named =
        errors.iter().any(|e| e.contains("all_reduce #1 (Max, 4 × f64)") && e.contains("all_reduce #1 (Sum, 4 × f32)"));
    assert!(named, "no rank named both calls: {errors:#?}");
    assert!(start.elapsed() < Duration::from_secs(5), "a mismatch must not wait for the timeout");
}

#[test]
fn a_peer_that_closes_is_named_at_once() {
    let start = Instant::now();
    let errors = with_ranks(3, |rank, mut comm| {
        if rank == 2 {
            drop(comm);
            return None;
        }
        Some(comm.all_reduce(&mut vec![1.0f32; 50_000], ReduceOp::Sum).expect_err("rank 2 left"))
    });
    let message = errors[0].as_ref().map(ToString::to_string).unwrap_or_default();
    assert!(matches!(errors[0], Some(CollectiveError::PeerClosed { peer: 2, .. })), "{message}");
    assert!(message.contains("rank 2 closed its connection during all_reduce #0"), "{message}");
    assert!(errors[1].is_some(), "rank 1 fails too");
    assert!(start.elapsed() < TIMEOUT / 2, "closing is noticed at once, not after the timeout");
}

#[test]
fn a_silent_peer_times_out_naming_it_and_the_call() {
    let timeout = Duration::from_millis(300);
    let (done, wait) = mpsc::channel::<()>();
    let wait = std::sync::Mutex::new(wait);
    let done = std::sync::Mutex::new(done);
    let results = with_ranks(2, |rank, mut comm| {
        comm.set_timeout(timeout);
        if rank == 1 {
            let _ = wait.lock().unwrap().recv();
            return None;
        }
        let start = Instant::now();
        let error = comm.all_reduce(&mut [1.0f32; 3], ReduceOp::Sum).expect_err("rank 1 is silent");
        let _ = done.lock().unwrap().send(());
        Some((error, start.elapsed()))
    });
    let (error, elapsed) = results[0].as_ref().expect("rank 0's error");
    let message = error.to_string();
    assert!(matches!(error, CollectiveError::Timeout { peer: 1, .. }), "{message}");
    assert!(message.contains("waiting for rank 1 in all_reduce #0 (Sum, 3 × f32)"), "{message}");
    assert!(*elapsed >= timeout && *elapsed < timeout + Duration::from_secs(2), "{elapsed:?}");
}

#[test]
fn the_rendezvous_refuses_a_wrong_world_size_and_a_duplicate_rank() {
    let id = UniqueId::new(LOOPBACK).unwrap();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = [(0, 2), (1, 3)]
            .into_iter()
            .map(|(rank, world)| {
                scope.spawn(move || HostComm::init(&id, rank, world, TIMEOUT).err().map(|e| e.to_string()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap().expect("refused")).collect()
    });
    for error in &errors {
        assert!(error.contains("rank 1 joined with world size 3, rank 0 with world size 2"), "{error}");
    }

    let id = UniqueId::new(LOOPBACK).unwrap();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = [0, 1, 1]
            .into_iter()
            .map(|rank| scope.spawn(move || HostComm::init(&id, rank, 3, TIMEOUT).err().map(|e| e.to_string())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap().expect("refused")).collect()
    });
    for error in &errors {
        assert!(error.contains("rank 1 joined twice"), "{error}");
    }
}

#[test]
fn an_aborted_communicator_unblocks_and_refuses() {
    let results = with_ranks(2, |rank, mut comm| {
        if rank == 1 {
            // Never calls: rank 0's read would wait for the full timeout.
            std::thread::sleep(Duration::from_millis(400));
            return None;
        }
        let abort = comm.abort_handle().expect("handle");
        let start = Instant::now();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                abort.abort();
            });
            let error = comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).expect_err("aborted");
            Some((error, start.elapsed(), abort.is_aborted()))
        })
    });
    let (error, elapsed, aborted) = results[0].as_ref().expect("rank 0");
    assert!(matches!(error, CollectiveError::Aborted { rank: 0 }), "{error}");
    assert!(*aborted && *elapsed < Duration::from_secs(2), "{elapsed:?}");
}
