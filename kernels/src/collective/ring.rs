//! The ring algorithms. Rank r sends to its right neighbour r+1 and receives from its left
//! neighbour r-1 (modulo the world size W); a buffer of n elements is cut into W chunks,
//! chunk i = `[i·n/W, (i+1)·n/W)` (some empty when n < W).
//!
//! - reduce-scatter: in W-1 steps each chunk travels once around the ring, each rank adding
//!   its own values to the partial result it receives (`received ⊕ local`);
//! - all-gather: in W-1 more steps each finished chunk is copied around the ring unchanged;
//! - all-reduce = reduce-scatter, then all-gather (NCCL's ring), so every rank ends with the
//!   same bits, in an order fixed by W;
//! - broadcast: a chain root → root+1 → … → root-1;
//! - barrier: W-1 steps of headers, after which every rank has heard from every other.
//!
//! Every step sends one message (header and chunk in one write) while receiving one: the
//! send runs on a scoped thread when it is large, so two neighbours that send to each
//! other at once cannot block on full socket buffers.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::ops::Range;
use std::time::Duration;

use super::wire::{Call, Header, HEADER_BYTES};
use super::{CollectiveError, Element, ReduceOp};

/// A message this small is written before reading (the socket buffers take it whole).
const INLINE_SEND_BYTES: usize = 4096;

/// The two connections of one rank.
pub(crate) struct Ring {
    /// From the left neighbour.
    left: TcpStream,
    /// To the right neighbour.
    right: TcpStream,
    left_rank: usize,
    right_rank: usize,
}

/// The call being run, as every step of it needs it.
pub(crate) struct Step {
    pub rank: usize,
    pub world_size: usize,
    pub call: Call,
    pub timeout: Duration,
}

/// Chunk `i` of `n` elements cut into `w` chunks.
fn chunk(n: usize, w: usize, i: usize) -> Range<usize> {
    let at = |i: usize| ((i as u128 * n as u128) / w as u128) as usize;
    at(i)..at(i + 1)
}

impl Ring {
    /// The ring over two connected sockets, with `TCP_NODELAY` and `timeout` on both.
    pub(crate) fn new(
        left: TcpStream,
        right: TcpStream,
        left_rank: usize,
        right_rank: usize,
        timeout: Duration,
    ) -> Result<Ring, CollectiveError> {
        let ring = Ring { left, right, left_rank, right_rank };
        let setup = || -> io::Result<()> {
            ring.left.set_nodelay(true)?;
            ring.right.set_nodelay(true)?;
            ring.set_timeout(timeout)
        };
        setup().map_err(|error| CollectiveError::Io { context: "configuring the ring's sockets".into(), error })?;
        Ok(ring)
    }

    /// How long a read or write waits for a neighbour.
    pub(crate) fn set_timeout(&self, timeout: Duration) -> io::Result<()> {
        for socket in [&self.left, &self.right] {
            socket.set_read_timeout(Some(timeout))?;
            socket.set_write_timeout(Some(timeout))?;
        }
        Ok(())
    }

    /// Handles on the two sockets (for an abort from another thread).
    pub(crate) fn clone_sockets(&self) -> Result<Vec<TcpStream>, CollectiveError> {
        [&self.left, &self.right]
            .into_iter()
            .map(|s| s.try_clone())
            .collect::<io::Result<_>>()
            .map_err(|error| CollectiveError::Io { context: "cloning the ring's sockets".into(), error })
    }

    /// Closes both connections, so the neighbours' reads and writes fail at once.
    pub(crate) fn close(&self) {
        // Either may be closed already (by an abort, or by the peer).
        let _ = self.left.shutdown(Shutdown::Both);
        let _ = self.right.shutdown(Shutdown::Both);
    }

    /// The error for a failed read from or write to `peer`.
    fn error(step: &Step, peer: usize, error: io::Error) -> CollectiveError {
        let (rank, call) = (step.rank, step.call.to_string());
        match error.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                CollectiveError::Timeout { rank, peer, call, waited: step.timeout }
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected => CollectiveError::PeerClosed { rank, peer, call },
            _ => CollectiveError::Io { context: format!("rank {rank} talking to rank {peer} in {call}"), error },
        }
    }

    /// Writes one message (already encoded) to the right neighbour.
    fn send(&self, step: &Step, message: &[u8]) -> Result<(), CollectiveError> {
        (&self.right).write_all(message).map_err(|e| Ring::error(step, self.right_rank, e))
    }

    /// Reads the left neighbour's message of `len` elements into `out` (replacing its
    /// contents), checking that it belongs to the same call.
    fn receive<T: Element>(&self, step: &Step, len: usize, out: &mut Vec<T>) -> Result<(), CollectiveError> {
        let peer = self.left_rank;
        let mut header = [0u8; HEADER_BYTES];
        (&self.left).read_exact(&mut header).map_err(|e| Ring::error(step, peer, e))?;
        let header = Header::decode(&header).map_err(|why| CollectiveError::Io {
            context: format!("rank {} reading from rank {peer} in {}", step.rank, step.call),
            error: io::Error::new(io::ErrorKind::InvalidData, why),
        })?;
        if header.call != step.call || header.from != peer {
            return Err(CollectiveError::Mismatch {
                rank: step.rank,
                call: step.call.to_string(),
                peer: header.from,
                peer_call: header.call.to_string(),
            });
        }
        let bytes = len * T::BYTES;
        if header.payload != bytes as u64 {
            return Err(CollectiveError::Io {
                context: format!("rank {} reading from rank {peer} in {}", step.rank, step.call),
                error: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} bytes of payload, expected {bytes}", header.payload),
                ),
            });
        }
        let mut payload = vec![0u8; bytes];
        (&self.left).read_exact(&mut payload).map_err(|e| Ring::error(step, peer, e))?;
        out.clear();
        T::decode(&payload, out);
        Ok(())
    }

    /// One ring step: sends `send` to the right while receiving `len` elements from the left.
    fn exchange<T: Element>(
        &self,
        step: &Step,
        send: &[T],
        len: usize,
        out: &mut Vec<T>,
    ) -> Result<(), CollectiveError> {
        let message = encode(step, send);
        if message.len() <= INLINE_SEND_BYTES {
            self.send(step, &message)?;
            return self.receive(step, len, out);
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| self.send(step, &message));
            let received = self.receive(step, len, out);
            if received.is_err() {
                // Unblocks the sender, which may wait for a neighbour that stopped reading.
                self.close();
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CollectiveError::Io {
                    context: format!("rank {} sending in {}", step.rank, step.call),
                    error: io::Error::other("the sending thread panicked"),
                })
            });
            received.and(sent)
        })
    }

    /// The W-1 steps in which chunk `(r + offset - s) mod W` goes right at step s and chunk
    /// `(r + offset - s - 1) mod W` comes from the left and is reduced into `data` with `op`
    /// (`Some`) or copied (`None`). Reducing, rank r ends up owning the finished chunk
    /// `(r + offset + 1) mod W`; copying, it ends with every chunk if rank r owned chunk
    /// `(r + offset) mod W` at the start.
    fn circulate<T: Element>(
        &self,
        step: &Step,
        data: &mut [T],
        bounds: impl Fn(usize) -> Range<usize>,
        offset: usize,
        op: Option<ReduceOp>,
    ) -> Result<(), CollectiveError> {
        let (r, w) = (step.rank, step.world_size);
        let mut received = Vec::new();
        for s in 0..w - 1 {
            let send = bounds((r + offset + 2 * w - s) % w);
            let recv = bounds((r + offset + 2 * w - s - 1) % w);
            self.exchange(step, &data[send], recv.len(), &mut received)?;
            let target = &mut data[recv];
            match op {
                Some(op) => target.iter_mut().zip(&received).for_each(|(d, &x)| *d = x.reduce(*d, op)),
                None => target.copy_from_slice(&received),
            }
        }
        Ok(())
    }

    /// Ring all-reduce of `data` in place.
    pub(crate) fn all_reduce<T: Element>(
        &self,
        step: &Step,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let (n, w) = (data.len(), step.world_size);
        self.circulate(step, data, |i| chunk(n, w, i), 0, Some(op))?;
        self.circulate(step, data, |i| chunk(n, w, i), 1, None)
    }

    /// Ring reduce-scatter: rank r gets chunk r (of `recv.len()` elements) of the reduction.
    pub(crate) fn reduce_scatter<T: Element>(
        &self,
        step: &Step,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let (c, w) = (recv.len(), step.world_size);
        let mut data = send.to_vec();
        self.circulate(step, &mut data, |i| i * c..(i + 1) * c, w - 1, Some(op))?;
        recv.copy_from_slice(&data[step.rank * c..(step.rank + 1) * c]);
        Ok(())
    }

    /// Ring all-gather: chunk r of `recv` is rank r's `send`.
    pub(crate) fn all_gather<T: Element>(
        &self,
        step: &Step,
        send: &[T],
        recv: &mut [T],
    ) -> Result<(), CollectiveError> {
        let c = send.len();
        recv[step.rank * c..(step.rank + 1) * c].copy_from_slice(send);
        self.circulate(step, recv, |i| i * c..(i + 1) * c, 0, None)
    }

    /// Chain broadcast from `root`: each rank receives from its left, then forwards to its
    /// right unless the right is the root.
    pub(crate) fn broadcast<T: Element>(
        &self,
        step: &Step,
        data: &mut [T],
        root: usize,
    ) -> Result<(), CollectiveError> {
        let position = (step.rank + step.world_size - root) % step.world_size;
        if position > 0 {
            let mut received = Vec::new();
            self.receive(step, data.len(), &mut received)?;
            data.copy_from_slice(&received);
        }
        if position + 1 < step.world_size {
            self.send(step, &encode(step, data))?;
        }
        Ok(())
    }

    /// W-1 steps of empty messages: after them every rank has heard (through its left
    /// neighbour) from every other.
    pub(crate) fn barrier(&self, step: &Step) -> Result<(), CollectiveError> {
        let mut received = Vec::<u64>::new();
        for _ in 0..step.world_size - 1 {
            self.exchange::<u64>(step, &[], 0, &mut received)?;
        }
        Ok(())
    }
}

/// One message: the step's header and `values`.
fn encode<T: Element>(step: &Step, values: &[T]) -> Vec<u8> {
    let payload = values.len() * T::BYTES;
    let mut message = Vec::with_capacity(HEADER_BYTES + payload);
    Header { from: step.rank, call: step.call, payload: payload as u64 }.encode(&mut message);
    T::encode(values, &mut message);
    message
}

#[cfg(test)]
mod tests {
    use super::chunk;

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for (n, w) in [(0, 3), (1, 4), (2, 3), (7, 3), (100_003, 4)] {
            let chunks: Vec<_> = (0..w).map(|i| chunk(n, w, i)).collect();
            assert_eq!(chunks[0].start, 0);
            assert_eq!(chunks[w - 1].end, n);
            assert!(chunks.windows(2).all(|p| p[0].end == p[1].start));
            assert!(chunks.iter().all(|c| c.len() <= n.div_ceil(w)));
        }
    }
}
