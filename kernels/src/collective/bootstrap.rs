//! The rendezvous, as NCCL's bootstrap does it: rank 0's id names a listening socket; every
//! other rank connects to it and sends `{rank, world size, its ring address}`, where the ring
//! address is a listener of its own on the interface it reached rank 0 through; rank 0 checks
//! the world size and the ranks and answers with the table of addresses (or a refusal that
//! says why); each rank then connects to its right neighbour and accepts its left one.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::ring::Ring;
use super::wire::{put_addr, Reader, ADDR_BYTES, HELLO_BYTES, MAGIC, RING_HELLO_BYTES};
use super::{CollectiveError, UniqueId, UNIQUE_ID_BYTES};

/// The version of the id's layout.
const ID_VERSION: u8 = 1;
/// A nonce: tells this communicator's messages from another's on a reused port.
type Nonce = [u8; 16];

/// Rank 0's listeners, from [`new_id`] until rank 0's `HostComm::init` takes them.
fn listeners() -> &'static Mutex<HashMap<[u8; UNIQUE_ID_BYTES], TcpListener>> {
    static LISTENERS: OnceLock<Mutex<HashMap<[u8; UNIQUE_ID_BYTES], TcpListener>>> = OnceLock::new();
    LISTENERS.get_or_init(Mutex::default)
}

fn io_error(context: String) -> impl FnOnce(io::Error) -> CollectiveError {
    move |error| CollectiveError::Io { context, error }
}

fn bootstrap(why: String) -> CollectiveError {
    CollectiveError::Bootstrap(why)
}

/// Binds rank 0's listener on `bind` and makes the id that names it.
pub(super) fn new_id(bind: IpAddr) -> Result<UniqueId, CollectiveError> {
    if bind.is_unspecified() {
        return Err(CollectiveError::InvalidArgument(format!(
            "UniqueId::new({bind}): bind the address the other ranks reach rank 0 at (it goes into the id), \
             not the unspecified address"
        )));
    }
    let listener =
        TcpListener::bind((bind, 0)).map_err(io_error(format!("binding the rendezvous listener on {bind}")))?;
    let addr = listener.local_addr().map_err(io_error("reading the rendezvous listener's address".into()))?;
    let mut bytes = Vec::with_capacity(UNIQUE_ID_BYTES);
    bytes.extend_from_slice(&MAGIC.to_le_bytes());
    bytes.push(ID_VERSION);
    put_addr(&mut bytes, addr);
    bytes.extend_from_slice(&random_nonce());
    let mut id = [0u8; UNIQUE_ID_BYTES];
    id[..bytes.len()].copy_from_slice(&bytes);
    listeners().lock().unwrap_or_else(|p| p.into_inner()).insert(id, listener);
    Ok(UniqueId(id))
}

/// 128 bits from the standard library's randomly keyed hasher, the clock and the process id.
fn random_nonce() -> Nonce {
    let mut nonce = [0u8; 16];
    for (i, half) in nonce.chunks_exact_mut(8).enumerate() {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        hasher.write_u32(std::process::id());
        hasher.write_usize(i);
        half.copy_from_slice(&hasher.finish().to_le_bytes());
    }
    nonce
}

/// Rank 0's address and the nonce of `id`.
fn parse_id(id: &UniqueId) -> Result<(SocketAddr, Nonce), CollectiveError> {
    let mut r = Reader::new(&id.0);
    let parsed = (|| {
        if r.u32()? != MAGIC || r.u8()? != ID_VERSION {
            return Err("not made by UniqueId::new (an id of the real NCCL only works with the real NCCL)".to_string());
        }
        Ok((r.addr()?, r.array::<16>()?))
    })();
    parsed.map_err(|why| bootstrap(format!("bad unique id: {why}")))
}

/// Joins the communicator: the rendezvous, then the ring's two connections (none for one rank).
pub(super) fn join(
    id: &UniqueId,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Option<Ring>, CollectiveError> {
    let (root, nonce) = parse_id(id)?;
    let deadline = Instant::now() + timeout;
    let (table, ring_listener) = if rank == 0 {
        let listener = listeners().lock().unwrap_or_else(|p| p.into_inner()).remove(&id.0).ok_or_else(|| {
            bootstrap(format!(
                "rank 0 must join in the process that made the id with UniqueId::new, once \
                 (no listener for {root} here)"
            ))
        })?;
        if world_size == 1 {
            return Ok(None);
        }
        let ring_listener = bind_ring_listener(root.ip())?;
        let own = ring_listener.local_addr().map_err(io_error("reading the ring listener's address".into()))?;
        (gather(&listener, nonce, world_size, own, deadline, timeout)?, ring_listener)
    } else {
        let mut stream = connect(root, deadline, || format!("rank {rank} connecting to rank 0 at {root}"))?;
        stream.set_read_timeout(Some(timeout)).map_err(io_error("setting a read timeout".into()))?;
        let local = stream.local_addr().map_err(io_error("reading the local address".into()))?;
        let ring_listener = bind_ring_listener(local.ip())?;
        let own = ring_listener.local_addr().map_err(io_error("reading the ring listener's address".into()))?;
        let mut hello = Vec::with_capacity(HELLO_BYTES);
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        hello.extend_from_slice(&nonce);
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world_size as u32).to_le_bytes());
        put_addr(&mut hello, own);
        stream.write_all(&hello).map_err(io_error(format!("rank {rank} sending its hello to rank 0")))?;
        (receive_table(&mut stream, rank, world_size)?, ring_listener)
    };
    // A fresh deadline: a rank that joined early may have waited most of the first for the others.
    connect_ring(rank, world_size, nonce, &table, &ring_listener, Instant::now() + timeout, timeout).map(Some)
}

fn bind_ring_listener(ip: IpAddr) -> Result<TcpListener, CollectiveError> {
    TcpListener::bind((ip, 0)).map_err(io_error(format!("binding the ring listener on {ip}")))
}

/// Connects to `addr`, retrying a refused connection until `deadline`.
fn connect(addr: SocketAddr, deadline: Instant, what: impl Fn() -> String) -> Result<TcpStream, CollectiveError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(bootstrap(format!("{}: nobody accepted before the timeout", what())));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(stream) => return Ok(stream),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(CollectiveError::Io { context: what(), error: e }),
        }
    }
}

/// The next connection on `listener` before `deadline` (`None` after it).
fn accept(listener: &TcpListener, deadline: Instant) -> io::Result<Option<TcpStream>> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(Some(stream));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Rank 0: collects every other rank's hello, checks them and answers with the table of ring
/// addresses, or sends every rank that joined the reason for refusing and returns it.
fn gather(
    listener: &TcpListener,
    nonce: Nonce,
    world_size: usize,
    own: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<SocketAddr>, CollectiveError> {
    let mut table: Vec<Option<SocketAddr>> = vec![None; world_size];
    table[0] = Some(own);
    let mut joined: Vec<TcpStream> = Vec::new();
    let refuse = |joined: &mut Vec<TcpStream>, why: String| {
        let mut message = vec![1u8];
        message.extend_from_slice(&(why.len() as u32).to_le_bytes());
        message.extend_from_slice(why.as_bytes());
        for stream in joined.iter_mut() {
            // The refusal is a courtesy; the refused rank also fails if it cannot read it.
            let _ = stream.write_all(&message);
        }
        bootstrap(why)
    };
    while joined.len() + 1 < world_size {
        let Some(mut stream) = accept(listener, deadline).map_err(io_error("rank 0 accepting a rank".into()))? else {
            let missing: Vec<usize> = (1..world_size).filter(|&r| table[r].is_none()).collect();
            return Err(refuse(&mut joined, format!("rank 0 waited {timeout:?} for ranks {missing:?} to join")));
        };
        stream.set_read_timeout(Some(timeout)).map_err(io_error("setting a read timeout".into()))?;
        let mut hello = [0u8; HELLO_BYTES];
        stream.read_exact(&mut hello).map_err(io_error("rank 0 reading a rank's hello".into()))?;
        let mut r = Reader::new(&hello);
        let (magic, their_nonce) = (r.u32().map_err(bootstrap)?, r.array::<16>().map_err(bootstrap)?);
        let (rank, size) = (r.u32().map_err(bootstrap)? as usize, r.u32().map_err(bootstrap)? as usize);
        let addr = r.addr().map_err(bootstrap)?;
        joined.push(stream);
        if magic != MAGIC || their_nonce != nonce {
            let why = format!("a rank joined with another communicator's id (rank {rank} of {size})");
            return Err(refuse(&mut joined, why));
        }
        if size != world_size {
            let why = format!("rank {rank} joined with world size {size}, rank 0 with world size {world_size}");
            return Err(refuse(&mut joined, why));
        }
        if rank == 0 || rank >= world_size {
            return Err(refuse(&mut joined, format!("a rank joined as rank {rank} of {world_size}: rank 0 is taken")));
        }
        if let Some(first) = table[rank] {
            return Err(refuse(&mut joined, format!("rank {rank} joined twice (from {first} and from {addr})")));
        }
        table[rank] = Some(addr);
    }
    let table: Vec<SocketAddr> = table.into_iter().flatten().collect();
    let mut message = vec![0u8];
    for &addr in &table {
        put_addr(&mut message, addr);
    }
    for stream in &mut joined {
        stream.write_all(&message).map_err(io_error("rank 0 sending the table".into()))?;
    }
    Ok(table)
}

/// A rank other than 0: reads rank 0's answer to its hello.
fn receive_table(stream: &mut TcpStream, rank: usize, world_size: usize) -> Result<Vec<SocketAddr>, CollectiveError> {
    let context = || format!("rank {rank} waiting for rank 0's answer");
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(|e| CollectiveError::Io { context: context(), error: e })?;
    if status[0] != 0 {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(|e| CollectiveError::Io { context: context(), error: e })?;
        let mut why = vec![0u8; u32::from_le_bytes(len).min(1 << 16) as usize];
        stream.read_exact(&mut why).map_err(|e| CollectiveError::Io { context: context(), error: e })?;
        return Err(bootstrap(format!("rank 0 refused rank {rank}: {}", String::from_utf8_lossy(&why))));
    }
    let mut bytes = vec![0u8; world_size * ADDR_BYTES];
    stream.read_exact(&mut bytes).map_err(|e| CollectiveError::Io { context: context(), error: e })?;
    let mut r = Reader::new(&bytes);
    (0..world_size).map(|_| r.addr().map_err(bootstrap)).collect()
}

/// Connects to the right neighbour, introduces itself, and accepts the left one.
fn connect_ring(
    rank: usize,
    world_size: usize,
    nonce: Nonce,
    table: &[SocketAddr],
    listener: &TcpListener,
    deadline: Instant,
    timeout: Duration,
) -> Result<Ring, CollectiveError> {
    let (left, right) = ((rank + world_size - 1) % world_size, (rank + 1) % world_size);
    let mut right_stream = connect(table[right], deadline, || format!("rank {rank} connecting to rank {right}"))?;
    let mut hello = Vec::with_capacity(RING_HELLO_BYTES);
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.extend_from_slice(&nonce);
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    right_stream.write_all(&hello).map_err(io_error(format!("rank {rank} introducing itself to rank {right}")))?;
    let left_stream = accept(listener, deadline)
        .map_err(io_error(format!("rank {rank} accepting rank {left}")))?
        .ok_or_else(|| bootstrap(format!("rank {rank} waited {timeout:?} for rank {left} to connect")))?;
    left_stream.set_read_timeout(Some(timeout)).map_err(io_error("setting a read timeout".into()))?;
    let mut hello = [0u8; RING_HELLO_BYTES];
    (&left_stream).read_exact(&mut hello).map_err(io_error(format!("rank {rank} reading rank {left}'s hello")))?;
    let mut r = Reader::new(&hello);
    let (magic, their_nonce, from) =
        (r.u32().map_err(bootstrap)?, r.array::<16>().map_err(bootstrap)?, r.u32().map_err(bootstrap)? as usize);
    if magic != MAGIC || their_nonce != nonce || from != left {
        return Err(bootstrap(format!("rank {rank} expected rank {left} to connect, got another connection")));
    }
    Ring::new(left_stream, right_stream, left, right, timeout)
}
