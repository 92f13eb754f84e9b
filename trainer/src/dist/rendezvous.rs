//! The rendezvous: rank 0 listens on MASTER_ADDR:MASTER_PORT, every other rank connects and
//! says who it is ([`super::wire::Hello`]); rank 0 checks the world size, the ranks and the
//! training config's fingerprint, creates the communicator id (NCCL's unique id) and sends it
//! to everyone. The sockets stay open as the [`ControlChannel`].

use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::control::{exit_on_stop, StopAction};
use super::wire::{Hello, Reply, MAGIC, PROTOCOL_VERSION};
use super::{ControlChannel, World, LAUNCHER_PIPE_ENV};

/// Rank 0 binds MASTER_ADDR:MASTER_PORT (a busy port is an error naming it) and accepts
/// `world_size - 1` ranks until `timeout`; each other rank connects with back-off until
/// `timeout` and sends {magic, protocol version, rank, world size, fingerprint}. Rank 0
/// refuses a wrong world size, a duplicate or out-of-range rank and a different fingerprint
/// (the training config's): the refused rank and rank 0 both fail, naming the problem, and
/// so do the ranks already accepted. Then rank 0 calls `make_id` and sends the id to everyone.
/// Under `transponder launch` the channel also stops this rank when the launcher dies.
pub fn rendezvous(
    world: &World,
    fingerprint: u64,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; 128]>,
) -> Result<([u8; 128], ControlChannel)> {
    let (id, channel) = connect(world, fingerprint, timeout, make_id, exit_on_stop())?;
    if std::env::var_os(LAUNCHER_PIPE_ENV).is_some() {
        channel.watch_launcher(std::io::stdin());
    }
    Ok((id, channel))
}

/// [`rendezvous`] with the channel's action on a peer's loss given (tests observe it).
pub(crate) fn connect(
    world: &World,
    fingerprint: u64,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; 128]>,
    on_stop: StopAction,
) -> Result<([u8; 128], ControlChannel)> {
    let deadline = Instant::now() + timeout;
    if world.world_size == 1 {
        return Ok((make_id()?, ControlChannel::start(0, Vec::new(), on_stop)?));
    }
    let (id, peers) = if world.is_leader() {
        host(world, fingerprint, timeout, deadline, make_id)?
    } else {
        join(world, fingerprint, timeout, deadline)?
    };
    for (_, stream) in &peers {
        stream.set_read_timeout(None).context("clearing the rendezvous socket's timeout")?;
    }
    Ok((id, ControlChannel::start(world.rank, peers, on_stop)?))
}

/// Each peer's rank and control socket.
type Peers = Vec<(usize, TcpStream)>;

/// MASTER_ADDR:MASTER_PORT as written.
fn address(world: &World) -> String {
    format!("{}:{}", world.master_addr, world.master_port)
}

/// Rank 0's side: every other rank's socket, checked, and the id sent to each.
fn host(
    world: &World,
    fingerprint: u64,
    timeout: Duration,
    deadline: Instant,
    make_id: impl FnOnce() -> Result<[u8; 128]>,
) -> Result<([u8; 128], Peers)> {
    let address = address(world);
    let listener = TcpListener::bind((world.master_addr.as_str(), world.master_port)).map_err(|error| {
        let hint = match error.kind() {
            ErrorKind::AddrInUse => {
                format!("port {} is in use (another job?): choose another MASTER_PORT", world.master_port)
            }
            ErrorKind::AddrNotAvailable => {
                format!("{} is not an address of this host: MASTER_ADDR names rank 0's host", world.master_addr)
            }
            _ => "check MASTER_ADDR and MASTER_PORT".into(),
        };
        anyhow!(error).context(format!(
            "rank 0 could not listen on {address} (MASTER_ADDR:MASTER_PORT) for the rendezvous: {hint}"
        ))
    })?;
    listener.set_nonblocking(true).context("setting up the rendezvous listener")?;
    let mut peers: Peers = Vec::new();
    while peers.len() < world.world_size - 1 {
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..world.world_size)
                        .filter(|r| !peers.iter().any(|(p, _)| p == r))
                        .map(|r| r.to_string())
                        .collect();
                    let problem = format!(
                        "rank 0 waited {} s on {address} for {} ranks: rank(s) {} never connected (are they running, with the same MASTER_ADDR and MASTER_PORT?)",
                        timeout.as_secs_f64(),
                        world.world_size - 1,
                        missing.join(", ")
                    );
                    return Err(refuse_all(&mut peers, problem));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(error) => return Err(error).with_context(|| format!("accepting a rank on {address}")),
        };
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| {
                stream.set_read_timeout(Some(
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100)),
                ))
            })
            .and_then(|()| Hello::read(&mut stream));
        let hello = match hello {
            Ok(hello) if hello.magic == MAGIC => hello,
            // A port scan or a health check, not a rank: the rendezvous goes on.
            _ => {
                let _ = writeln!(
                    std::io::stderr(),
                    "warning: ignoring a connection to {address} from {from} that is not a transponder rank"
                );
                continue;
            }
        };
        if let Err(problem) = check(&hello, world, fingerprint, &peers) {
            let _ = Reply::Refused(problem.clone()).write(&mut stream);
            return Err(refuse_all(&mut peers, problem));
        }
        let _ = stream.set_nodelay(true);
        peers.push((hello.rank as usize, stream));
    }
    let id = match make_id() {
        Ok(id) => id,
        Err(error) => {
            let problem = format!("rank 0 could not create the communicator id: {error:#}");
            return Err(refuse_all(&mut peers, problem));
        }
    };
    for (rank, stream) in &mut peers {
        Reply::Accepted(Box::new(id))
            .write(stream)
            .with_context(|| format!("sending the communicator id to rank {rank}"))?;
    }
    Ok((id, peers))
}

/// Why rank 0 refuses `hello`, if it does.
fn check(hello: &Hello, world: &World, fingerprint: u64, peers: &[(usize, TcpStream)]) -> Result<(), String> {
    let (rank, size) = (hello.rank, hello.world_size);
    if hello.version != PROTOCOL_VERSION {
        return Err(format!(
            "rank {rank} speaks rendezvous protocol {}, rank 0 speaks {PROTOCOL_VERSION}: run the same transponder build on every rank",
            hello.version
        ));
    }
    if size != world.world_size as u64 {
        return Err(format!(
            "rank {rank} was started with world size {size}, rank 0 with {}: every rank needs the same WORLD_SIZE",
            world.world_size
        ));
    }
    if rank == 0 {
        return Err("a second process claims rank 0: every rank needs its own RANK".into());
    }
    if rank >= size {
        return Err(format!("rank {rank} is out of range for world size {size}"));
    }
    if peers.iter().any(|(peer, _)| *peer as u64 == rank) {
        return Err(format!("two processes claim rank {rank}: every rank needs its own RANK"));
    }
    if hello.fingerprint != fingerprint {
        return Err(format!(
            "rank {rank}'s training config differs from rank 0's (fingerprint {:016x}, rank 0's {fingerprint:016x}): start every rank with the same arguments and binary",
            hello.fingerprint
        ));
    }
    Ok(())
}

/// Tells every accepted rank that the rendezvous stopped over `problem`, and returns rank 0's
/// error.
fn refuse_all(peers: &mut [(usize, TcpStream)], problem: String) -> anyhow::Error {
    for (_, stream) in peers {
        let _ = Reply::Refused(format!("rank 0 stopped it: {problem}")).write(stream);
    }
    anyhow!("the rendezvous failed: {problem}")
}

/// A non-zero rank's side: rank 0's socket, once it accepted this rank, and the id.
fn join(world: &World, fingerprint: u64, timeout: Duration, deadline: Instant) -> Result<([u8; 128], Peers)> {
    let address = address(world);
    let mut pause = Duration::from_millis(50);
    let mut stream = loop {
        let last_error = match try_connect(world, deadline) {
            Ok(stream) => break stream,
            Err(error) => error,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!(
                "could not reach rank 0 at {address} (MASTER_ADDR:MASTER_PORT) within {} s: {last_error:#}",
                timeout.as_secs_f64()
            );
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_secs(1));
    };
    let _ = stream.set_nodelay(true);
    Hello::new(world.rank, world.world_size, fingerprint)
        .write(&mut stream)
        .with_context(|| format!("sending this rank's hello to rank 0 at {address}"))?;
    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    stream.set_read_timeout(Some(wait)).context("setting the rendezvous socket's timeout")?;
    let reply = Reply::read(&mut stream).map_err(|error| match error.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow!(
            "rank 0 at {address} did not complete the rendezvous within {} s (is every rank running?)",
            timeout.as_secs_f64()
        ),
        _ => anyhow!(error).context(format!("rank 0 at {address} closed the connection during the rendezvous")),
    })?;
    match reply {
        Reply::Accepted(id) => Ok((*id, vec![(0, stream)])),
        Reply::Refused(problem) => bail!("the rendezvous failed: rank 0 refused rank {}: {problem}", world.rank),
    }
}

/// One connection attempt to every address MASTER_ADDR resolves to.
fn try_connect(world: &World, deadline: Instant) -> Result<TcpStream> {
    let addresses: Vec<SocketAddr> = (world.master_addr.as_str(), world.master_port)
        .to_socket_addrs()
        .with_context(|| format!("resolving MASTER_ADDR {}", world.master_addr))?
        .collect();
    let mut last = anyhow!("MASTER_ADDR {} resolves to no address", world.master_addr);
    for address in addresses {
        let wait =
            deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), Duration::from_secs(2));
        match TcpStream::connect_timeout(&address, wait) {
            Ok(stream) => return Ok(stream),
            Err(error) => last = anyhow!(error),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::super::testing::{free_port, rendezvous_all, test_id, world};
    use super::*;

    fn error(result: &Result<([u8; 128], ControlChannel)>) -> String {
        format!("{:#}", result.as_ref().err().expect("an error"))
    }

    #[test]
    fn three_ranks_meet_and_share_rank_0s_id() {
        let port = free_port();
        let (results, stops) =
            rendezvous_all((0..3).map(|rank| (world(rank, 3, port), 42)).collect(), Duration::from_secs(10));
        let finishing: Vec<_> = results
            .into_iter()
            .map(|result| {
                let (id, channel) = result.unwrap();
                assert_eq!(id, test_id());
                std::thread::spawn(move || channel.finish())
            })
            .collect();
        for thread in finishing {
            thread.join().unwrap().unwrap();
        }
        assert_eq!(stops.next(Duration::from_millis(200)), None, "nobody reports a death after finishing");
    }

    #[test]
    fn a_single_rank_needs_no_socket() {
        let (results, _) = rendezvous_all(vec![(world(0, 1, 1), 1)], Duration::from_secs(1));
        let (id, channel) = results.into_iter().next().unwrap().unwrap();
        assert_eq!(id, test_id());
        channel.finish().unwrap();
    }

    #[test]
    fn a_wrong_world_size_fails_both_ranks() {
        let port = free_port();
        let (results, _) =
            rendezvous_all(vec![(world(0, 2, port), 1), (world(1, 3, port), 1)], Duration::from_secs(10));
        for result in &results {
            let message = error(result);
            assert!(message.contains("rank 1 was started with world size 3, rank 0 with 2"), "{message}");
        }
        assert!(error(&results[1]).contains("rank 0 refused rank 1"), "{}", error(&results[1]));
    }

    #[test]
    fn a_duplicate_rank_fails_everyone() {
        let port = free_port();
        let ranks = vec![(world(0, 3, port), 1), (world(1, 3, port), 1), (world(1, 3, port), 1)];
        let (results, _) = rendezvous_all(ranks, Duration::from_secs(10));
        for result in &results {
            let message = error(result);
            assert!(message.contains("two processes claim rank 1"), "{message}");
        }
    }

    #[test]
    fn a_different_config_fails_both_ranks() {
        let port = free_port();
        let (results, _) =
            rendezvous_all(vec![(world(0, 2, port), 1), (world(1, 2, port), 2)], Duration::from_secs(10));
        for result in &results {
            let message = error(result);
            assert!(message.contains("rank 1's training config differs from rank 0's"), "{message}");
        }
    }

    #[test]
    fn an_out_of_range_rank_is_refused() {
        let port = free_port();
        let (results, _) =
            rendezvous_all(vec![(world(0, 2, port), 1), (world(5, 2, port), 1)], Duration::from_secs(10));
        for result in &results {
            let message = error(result);
            assert!(message.contains("rank 5 is out of range for world size 2"), "{message}");
        }
    }

    #[test]
    fn a_second_rank_0_finds_the_port_taken() {
        let port = free_port();
        let (results, _) =
            rendezvous_all(vec![(world(0, 2, port), 1), (world(0, 2, port), 1)], Duration::from_millis(500));
        let messages: Vec<String> = results.iter().map(error).collect();
        assert!(messages.iter().any(|m| m.contains("is in use")), "{messages:?}");
    }

    #[test]
    fn a_busy_port_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (results, _) = rendezvous_all(vec![(world(0, 2, port), 1)], Duration::from_secs(1));
        let message = error(&results[0]);
        assert!(
            message.contains(&format!("could not listen on 127.0.0.1:{port}")) && message.contains("in use"),
            "{message}"
        );
    }

    #[test]
    fn an_unreachable_master_fails_within_the_timeout() {
        let port = free_port();
        let started = Instant::now();
        let (results, _) = rendezvous_all(vec![(world(1, 2, port), 1)], Duration::from_millis(300));
        let message = error(&results[0]);
        assert!(
            message.contains(&format!(
                "could not reach rank 0 at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 0.3 s"
            )),
            "{message}"
        );
        assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    }

    #[test]
    fn a_missing_rank_times_rank_0_out_and_releases_the_others() {
        let port = free_port();
        let (results, _) =
            rendezvous_all(vec![(world(0, 3, port), 1), (world(1, 3, port), 1)], Duration::from_millis(500));
        let message = error(&results[0]);
        assert!(message.contains("rank(s) 2 never connected"), "{message}");
        let message = error(&results[1]);
        assert!(message.contains("rank 0 stopped it") && message.contains("rank(s) 2 never connected"), "{message}");
    }
}
