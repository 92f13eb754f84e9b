//! The host collective: NCCL's collectives (all-reduce, broadcast, reduce-scatter,
//! all-gather, barrier) over TCP between processes or threads, on host slices.
//!
//! This is test machinery and a CPU convenience, not a production engine: it runs
//! `--device cpu` data parallelism and is the engine of the emulated NCCL
//! (`cuda::emu::nccl`), so CI can run several ranks without GPUs. On GPUs the real NCCL
//! (`cuda::nccl`) moves the data. It keeps NCCL's contract (`shared/DISTRIBUTED.md` §2):
//!
//! - **Identical bits on every rank.** An all-reduce is a ring reduce-scatter followed by a
//!   ring all-gather, as NCCL's ring algorithm does: each chunk is reduced once, along the
//!   ring, and the result is copied unchanged to everyone. The summation order is therefore
//!   not rank order (no test may rely on it), but it is fixed for a given world size, so the
//!   result is deterministic. One rank: a copy.
//! - **Rendezvous like NCCL's bootstrap.** Rank 0 makes a [`UniqueId`] (a listening socket's
//!   address and a random nonce, 128 bytes like `ncclUniqueId`), ships it to the other ranks
//!   by any means, and every rank calls [`HostComm::init`] with it. Each rank tells rank 0 its
//!   own listening address; rank 0 checks the world size and the ranks and sends back the
//!   table; each rank then connects to its right neighbour and accepts its left one.
//! - **Stricter than NCCL where NCCL hangs.** Every message carries a header naming its call
//!   (sequence number, kind, element type, count, root): ranks that disagree about the call
//!   fail at once with [`CollectiveError::Mismatch`] naming both ranks and both calls (NCCL
//!   would hang or compute garbage). A neighbour that closes its sockets (its process died,
//!   or its communicator failed or was dropped) gives [`CollectiveError::PeerClosed`] at once;
//!   one that never answers gives [`CollectiveError::Timeout`] after the timeout. A failed
//!   communicator closes its sockets, so the failure travels around the ring instead of
//!   leaving the others to time out, and refuses further calls.
//!
//! ```text
//! mod.rs        the types: UniqueId, ReduceOp, Element, HostComm, CollectiveError
//! bootstrap.rs  ids, the rendezvous with rank 0, the ring's connections
//! ring.rs       the algorithms: one ring step, all-reduce, broadcast, reduce-scatter, all-gather
//! wire.rs       the messages' bytes and the call each one names
//! ```

mod bootstrap;
mod ring;
mod wire;

use std::fmt;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wire::{Call, ElemType, Kind};

/// Bytes of a [`UniqueId`] (as `NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The identity of one communicator, made by rank 0 and sent to every other rank before
/// [`HostComm::init`] (128 bytes, like `ncclUniqueId`). For the host collective it holds
/// rank 0's listening address and a random nonce.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Rank 0 only: binds a listener on `bind` (the address the other ranks reach rank 0
    /// at, not `0.0.0.0`; port 0 picks a free port), as `ncclGetUniqueId` starts NCCL's
    /// bootstrap root. The id encodes the address and a random nonce. The listener waits in
    /// a process-wide registry until [`HostComm::init`] with rank 0 and this id takes it.
    pub fn new(bind: IpAddr) -> Result<UniqueId, CollectiveError> {
        bootstrap::new_id(bind)
    }

    /// The id from its bytes (as received from rank 0).
    pub fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(bytes)
    }

    /// The id's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.0
    }
}

/// How an all-reduce or reduce-scatter combines the ranks' values (NCCL's `ncclSum`,
/// `ncclMax`, `ncclMin`). Max and Min of floats follow `fmax`/`fmin` (a NaN loses to a
/// number); Sum of `u64` wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
}

/// Element types the host collective moves (sealed): `f32`, `f64`, `u64`.
pub trait Element: Copy + Send + 'static + private::Sealed {
    /// Its tag in message headers.
    #[doc(hidden)]
    const TYPE: ElemType;
    /// Bytes per element on the wire.
    #[doc(hidden)]
    const BYTES: usize;
    /// Appends the elements' little-endian bytes.
    #[doc(hidden)]
    fn encode(values: &[Self], out: &mut Vec<u8>);
    /// Appends the elements of little-endian `bytes` to `out`.
    #[doc(hidden)]
    fn decode(bytes: &[u8], out: &mut Vec<Self>);
    /// `op` of two values.
    #[doc(hidden)]
    fn reduce(self, other: Self, op: ReduceOp) -> Self;
}

mod private {
    /// Only the types of [`super::Element`].
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for u64 {}
}

macro_rules! element {
    ($t:ty, $tag:ident, $sum:expr) => {
        impl Element for $t {
            const TYPE: ElemType = ElemType::$tag;
            const BYTES: usize = std::mem::size_of::<$t>();

            fn encode(values: &[$t], out: &mut Vec<u8>) {
                out.reserve(values.len() * Self::BYTES);
                for v in values {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }

            fn decode(bytes: &[u8], out: &mut Vec<$t>) {
                out.extend(bytes.chunks_exact(Self::BYTES).map(|b| {
                    let mut le = [0u8; std::mem::size_of::<$t>()];
                    le.copy_from_slice(b);
                    <$t>::from_le_bytes(le)
                }));
            }

            fn reduce(self, other: $t, op: ReduceOp) -> $t {
                match op {
                    ReduceOp::Sum => $sum(self, other),
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }
        }
    };
}

element!(f32, F32, |a: f32, b: f32| a + b);
element!(f64, F64, |a: f64, b: f64| a + b);
element!(u64, U64, u64::wrapping_add);

/// What went wrong in the host collective. Every variant names the rank that reports it;
/// those about a collective name the call (`all_reduce #3 (Sum, 100 × f32)`).
#[derive(Debug)]
pub enum CollectiveError {
    /// The arguments are inconsistent (lengths, root, rank, world size); nothing was sent.
    InvalidArgument(String),
    /// The rendezvous failed: a wrong world size, a duplicate rank, a foreign id, an
    /// unreachable rank 0, ...
    Bootstrap(String),
    /// Two neighbours are in different calls (stricter than NCCL, which hangs).
    Mismatch {
        /// The rank that noticed.
        rank: usize,
        /// Its call.
        call: String,
        /// The neighbour it heard from.
        peer: usize,
        /// The neighbour's call.
        peer_call: String,
    },
    /// A neighbour closed its connection (its process died, or its communicator failed or
    /// was dropped).
    PeerClosed {
        /// The rank that noticed.
        rank: usize,
        /// The neighbour.
        peer: usize,
        /// The call in flight.
        call: String,
    },
    /// A neighbour did not answer within the timeout.
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// The neighbour it waited for.
        peer: usize,
        /// The call in flight.
        call: String,
        /// How long it waited.
        waited: Duration,
    },
    /// A socket failed otherwise.
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// The communicator was aborted ([`HostCommAbort::abort`]).
    Aborted {
        /// The rank of the aborted communicator.
        rank: usize,
    },
    /// An earlier call failed; a communicator cannot be used after an error.
    Failed {
        /// The rank.
        rank: usize,
        /// The first error.
        first: String,
    },
}

impl fmt::Display for CollectiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveError::InvalidArgument(why) => write!(f, "host collective: {why}"),
            CollectiveError::Bootstrap(why) => write!(f, "host collective rendezvous: {why}"),
            CollectiveError::Mismatch { rank, call, peer, peer_call } => write!(
                f,
                "rank {rank} is in {call} but rank {peer} sent a message of {peer_call}: \
                 the ranks must make the same collective calls in the same order"
            ),
            CollectiveError::PeerClosed { rank, peer, call } => {
                write!(f, "rank {rank}: rank {peer} closed its connection during {call} (it exited or failed)")
            }
            CollectiveError::Timeout { rank, peer, call, waited } => {
                write!(f, "rank {rank}: timed out after {waited:?} waiting for rank {peer} in {call}")
            }
            CollectiveError::Io { context, error } => write!(f, "host collective: {context}: {error}"),
            CollectiveError::Aborted { rank } => write!(f, "rank {rank}: the communicator was aborted"),
            CollectiveError::Failed { rank, first } => {
                write!(f, "rank {rank}: the communicator failed earlier and cannot be used: {first}")
            }
        }
    }
}

impl std::error::Error for CollectiveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CollectiveError::Io { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// One rank's membership in a communicator of `world_size` ranks (see the module
/// documentation). Calls are collective: every rank makes the same calls in the same order.
pub struct HostComm {
    rank: usize,
    world_size: usize,
    /// The sockets to the neighbours (none for one rank).
    ring: Option<ring::Ring>,
    /// Calls made so far (the next call's sequence number).
    seq: u64,
    timeout: Duration,
    /// The first error, after which every call fails.
    failed: Option<String>,
    aborted: Arc<AtomicBool>,
}

impl fmt::Debug for HostComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostComm(rank {} of {}, {} calls", self.rank, self.world_size, self.seq)?;
        match &self.failed {
            Some(first) => write!(f, ", failed: {first})"),
            None => write!(f, ")"),
        }
    }
}

/// A handle that aborts a [`HostComm`] from another thread (a watchdog): it closes the
/// communicator's sockets, so a call blocked in it returns [`CollectiveError::Aborted`] and
/// the neighbours see the connection close.
#[derive(Debug)]
pub struct HostCommAbort {
    sockets: Vec<TcpStream>,
    aborted: Arc<AtomicBool>,
}

impl HostCommAbort {
    /// Closes the communicator's sockets (idempotent).
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for socket in &self.sockets {
            // Already closed is fine: the point is that it is closed.
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// Whether [`HostCommAbort::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl HostComm {
    /// Joins the communicator of `id` as `rank` of `world_size`. Rank 0 must call it in the
    /// process that made `id`. Every connect and read waits at most `timeout` (then a
    /// [`CollectiveError::Timeout`] naming the peer and the collective).
    pub fn init(id: &UniqueId, rank: usize, world_size: usize, timeout: Duration) -> Result<HostComm, CollectiveError> {
        if world_size == 0 || rank >= world_size {
            return Err(CollectiveError::InvalidArgument(format!("rank {rank} of world size {world_size}")));
        }
        let timeout = timeout.max(MIN_TIMEOUT);
        let ring = bootstrap::join(id, rank, world_size, timeout)?;
        Ok(HostComm { rank, world_size, ring, seq: 0, timeout, failed: None, aborted: Arc::default() })
    }

    /// This rank (0 ≤ rank < world size).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Sets how long a later connect or read waits for a neighbour (at least 1 ms).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout.max(MIN_TIMEOUT);
        if let Some(ring) = &self.ring {
            if let Err(error) = ring.set_timeout(self.timeout) {
                // The sockets are unusable; the next call reports it.
                self.failed.get_or_insert_with(|| format!("setting the sockets' timeout: {error}"));
            }
        }
    }

    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> Result<HostCommAbort, CollectiveError> {
        let sockets = match &self.ring {
            Some(ring) => ring.clone_sockets()?,
            None => Vec::new(),
        };
        Ok(HostCommAbort { sockets, aborted: Arc::clone(&self.aborted) })
    }

    /// Reduces `data` over all ranks with `op`, in place: afterwards every rank holds the
    /// same bits.
    pub fn all_reduce<T: Element>(&mut self, data: &mut [T], op: ReduceOp) -> Result<(), CollectiveError> {
        let call = self.next_call::<T>(Kind::AllReduce(op), data.len());
        self.run(call, |ring, call| ring.all_reduce(call, data, op))
    }

    /// Copies `root`'s `data` to every rank.
    pub fn broadcast<T: Element>(&mut self, data: &mut [T], root: usize) -> Result<(), CollectiveError> {
        if root >= self.world_size {
            return Err(CollectiveError::InvalidArgument(format!(
                "broadcast from root {root} in a world of {}",
                self.world_size
            )));
        }
        let call = self.next_call::<T>(Kind::Broadcast { root }, data.len());
        self.run(call, |ring, call| ring.broadcast(call, data, root))
    }

    /// Reduces `send` over all ranks with `op` and gives rank r chunk r of the result:
    /// `send.len() == recv.len() * world_size`.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check_chunks("reduce_scatter", send.len(), recv.len())?;
        let call = self.next_call::<T>(Kind::ReduceScatter(op), recv.len());
        if self.world_size == 1 {
            recv.copy_from_slice(send);
        }
        self.run(call, |ring, call| ring.reduce_scatter(call, send, recv, op))
    }

    /// Gathers every rank's `send` into `recv` in rank order:
    /// `recv.len() == send.len() * world_size`, chunk r comes from rank r.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CollectiveError> {
        self.check_chunks("all_gather", recv.len(), send.len())?;
        let call = self.next_call::<T>(Kind::AllGather, send.len());
        if self.world_size == 1 {
            recv.copy_from_slice(send);
        }
        self.run(call, |ring, call| ring.all_gather(call, send, recv))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), CollectiveError> {
        let call = self.next_call::<u64>(Kind::Barrier, 0);
        self.run(call, |ring, call| ring.barrier(call))
    }

    /// Checks `whole == chunk * world_size`.
    fn check_chunks(&self, op: &str, whole: usize, chunk: usize) -> Result<(), CollectiveError> {
        if chunk.checked_mul(self.world_size) == Some(whole) {
            return Ok(());
        }
        Err(CollectiveError::InvalidArgument(format!(
            "{op}: the whole buffer has {whole} elements, expected the chunk's {chunk} × {} ranks",
            self.world_size
        )))
    }

    /// The description of the next call (numbered from 0).
    fn next_call<T: Element>(&mut self, kind: Kind, count: usize) -> Call {
        let call = Call { seq: self.seq, kind, elem: T::TYPE, count: count as u64 };
        self.seq += 1;
        call
    }

    /// Runs `collective` on the ring (nothing to do for one rank); after an error,
    /// closes the sockets and refuses later calls.
    fn run(
        &mut self,
        call: Call,
        collective: impl FnOnce(&ring::Ring, &ring::Step) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let rank = self.rank;
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CollectiveError::Aborted { rank });
        }
        if let Some(first) = &self.failed {
            return Err(CollectiveError::Failed { rank, first: first.clone() });
        }
        let Some(ring) = &self.ring else { return Ok(()) };
        let step = ring::Step { rank, world_size: self.world_size, call, timeout: self.timeout };
        let result = collective(ring, &step);
        if let Err(error) = &result {
            ring.close();
            self.failed = Some(error.to_string());
            if self.aborted.load(Ordering::SeqCst) {
                return Err(CollectiveError::Aborted { rank });
            }
        }
        result
    }
}

/// The shortest timeout (a socket refuses a zero timeout).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
