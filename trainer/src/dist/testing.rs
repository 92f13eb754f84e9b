//! Helpers for the dist tests: ranks as threads of the test process over loopback, each with
//! a free port and an observable stop action.

use std::net::TcpListener;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use super::control::StopAction;
use super::rendezvous::connect;
use super::{ControlChannel, World};

/// A port free a moment ago (tests running in parallel each get their own).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `rank` of `world_size` with rank 0 on loopback `port`.
pub fn world(rank: usize, world_size: usize, port: u16) -> World {
    World {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// The id rank 0 makes in tests: 0, 1, 2, ...
pub fn test_id() -> [u8; 128] {
    std::array::from_fn(|i| i as u8)
}

/// One rank's rendezvous result.
pub type Met = Result<([u8; 128], ControlChannel)>;

/// The lines ranks stopped with, as (rank, line).
pub struct Stops(Receiver<(usize, String)>);

impl Stops {
    /// The next stop line, or `None` after `wait`.
    pub fn next(&self, wait: Duration) -> Option<(usize, String)> {
        self.0.recv_timeout(wait).ok()
    }

    /// The stop lines of `count` ranks, sorted by rank.
    pub fn take(&self, count: usize) -> Vec<(usize, String)> {
        let mut lines: Vec<_> = (0..count).map(|_| self.next(Duration::from_secs(10)).expect("a stop line")).collect();
        lines.sort();
        lines
    }
}

/// Runs the rendezvous of each (world, fingerprint) in its own thread; the results in the
/// same order, and the stop lines.
pub fn rendezvous_all(ranks: Vec<(World, u64)>, timeout: Duration) -> (Vec<Met>, Stops) {
    let (sender, receiver) = channel();
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|(world, fingerprint)| {
            let sender = sender.clone();
            let rank = world.rank;
            let on_stop: StopAction = Arc::new(move |line: String| sender.send((rank, line)).unwrap());
            std::thread::spawn(move || connect(&world, fingerprint, timeout, || Ok(test_id()), on_stop))
        })
        .collect();
    (threads.into_iter().map(|thread| thread.join().unwrap()).collect(), Stops(receiver))
}

/// The channels of `world_size` ranks that met on a free port.
pub fn channels(world_size: usize) -> (Vec<ControlChannel>, Stops) {
    let port = free_port();
    let (results, stops) = rendezvous_all(
        (0..world_size).map(|rank| (world(rank, world_size, port), 7)).collect(),
        Duration::from_secs(10),
    );
    (results.into_iter().map(|result| result.unwrap().1).collect(), stops)
}
