//! The control channel: the rendezvous sockets kept open (a star, rank 0 ↔ every rank) so a
//! rank's death or failure stops every other rank at once, with one line naming the lost rank,
//! the step and the last checkpoint, instead of leaving them spinning in a collective.
//!
//! A thread per socket reads the peer's frames ([`super::wire`]): a peer's `failed` frame or
//! its end of stream (it died) stops this rank; rank 0 first relays either to every other
//! rank. The clean end is a barrier: each rank sends `done` and waits; rank 0 waits for every
//! `done`, then answers `done` to all; only then does anyone close, so no finished rank is
//! mistaken for a dead one.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use anyhow::{anyhow, Context, Result};

use super::wire::{Frame, Tag, NO_STEP};
use super::EXIT_PEER_FAILED;

/// What a rank does with the one line saying why it stops: print it and exit with
/// [`EXIT_PEER_FAILED`] in production; tests collect it.
pub(crate) type StopAction = Arc<dyn Fn(String) + Send + Sync>;

/// The production [`StopAction`]: the line on stderr, then `exit(EXIT_PEER_FAILED)`.
pub(crate) fn exit_on_stop() -> StopAction {
    Arc::new(|line: String| {
        // Best effort: with stderr gone the exit status still tells.
        let _ = writeln!(std::io::stderr(), "{line}");
        std::process::exit(EXIT_PEER_FAILED)
    })
}

/// The rendezvous sockets kept open: failure propagation and the end-of-run barrier.
pub struct ControlChannel {
    shared: Arc<Shared>,
    streams: Vec<TcpStream>,
    watchers: Vec<JoinHandle<()>>,
}

/// A cheap cloneable handle that tells the other ranks this one is stopping (for threads
/// such as the [`super::Watchdog`]'s, which must not own the channel that `finish` consumes).
#[derive(Clone)]
pub struct FailureNotifier {
    shared: Arc<Shared>,
}

struct Shared {
    rank: usize,
    /// The step the run is at, [`NO_STEP`] before the first.
    step: AtomicU64,
    checkpoint: Mutex<Option<PathBuf>>,
    /// Set once this rank stops for any reason: later losses are then expected, not reported.
    stopping: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
    /// (peer rank, its socket): rank 0 holds every other rank's, the others rank 0's.
    writers: Vec<(usize, Mutex<TcpStream>)>,
    on_stop: StopAction,
}

#[derive(Default)]
struct State {
    /// Ranks whose `done` rank 0 has received.
    done: Vec<usize>,
    /// A rank other than 0 received rank 0's `done`: everyone finished.
    released: bool,
    /// The line this rank stopped with.
    stopped: Option<String>,
}

impl ControlChannel {
    /// The channel of `rank` over `peers` (rank 0: every other rank's socket; another rank:
    /// rank 0's), with a watcher thread per socket.
    pub(crate) fn start(rank: usize, peers: Vec<(usize, TcpStream)>, on_stop: StopAction) -> Result<ControlChannel> {
        let mut writers = Vec::with_capacity(peers.len());
        let mut readers = Vec::with_capacity(peers.len());
        let mut streams = Vec::with_capacity(peers.len());
        for (peer, stream) in peers {
            let clone = || stream.try_clone().with_context(|| format!("duplicating the control socket of rank {peer}"));
            readers.push((peer, clone()?));
            streams.push(clone()?);
            writers.push((peer, Mutex::new(stream)));
        }
        let shared = Arc::new(Shared {
            rank,
            step: AtomicU64::new(NO_STEP),
            checkpoint: Mutex::new(None),
            stopping: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            writers,
            on_stop,
        });
        let watchers = readers
            .into_iter()
            .map(|(peer, reader)| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("control-{peer}"))
                    .spawn(move || if rank == 0 { shared.watch_rank(peer, reader) } else { shared.watch_host(reader) })
                    .context("starting a control-channel thread")
            })
            .collect::<Result<_>>()?;
        Ok(ControlChannel { shared, streams, watchers })
    }

    /// The step the run is at (atomic), for failure messages; the peers are told too, and name
    /// that step if this rank dies (a rank may die a step ahead of a peer still finishing the
    /// step before, saving a checkpoint, say). One 17-byte frame per peer per step: a rank
    /// other than 0 writes one, rank 0 one to every other rank.
    pub fn set_step(&self, step: usize) {
        let step = step as u64;
        if self.shared.step.swap(step, Ordering::Relaxed) != step {
            self.shared.send(None, &Frame { tag: Tag::Step, origin: self.shared.rank, step, message: String::new() });
        }
    }

    /// The run's last good checkpoint path, for failure messages.
    pub fn set_checkpoint(&self, path: &Path) {
        *lock(&self.shared.checkpoint) = Some(path.to_path_buf());
    }

    /// This rank is stopping with an error: tell the others (rank 0 relays to every rank)
    /// before exiting.
    pub fn report_failure(&self, message: &str) {
        self.shared.report_failure(message);
    }

    /// A handle for other threads to report this rank's failure with.
    pub fn notifier(&self) -> FailureNotifier {
        FailureNotifier { shared: Arc::clone(&self.shared) }
    }

    /// Stops this rank (with [`EXIT_PEER_FAILED`] in production) when `input` ends: given the
    /// stdin pipe `transponder launch` holds open, a rank does not outlive a killed launcher.
    pub(crate) fn watch_launcher(&self, mut input: impl Read + Send + 'static) {
        let shared = Arc::clone(&self.shared);
        // Detached: a thread blocked on stdin cannot be joined; `stopping` silences it.
        let spawned = std::thread::Builder::new().name("launcher-pipe".into()).spawn(move || {
            let mut sink = [0; 64];
            while matches!(input.read(&mut sink), Ok(n) if n > 0) {}
            let line = format!(
                "the launcher (transponder launch) exited: stopping rank {}; {}",
                shared.rank,
                shared.checkpoint_text()
            );
            shared.stop(line, None);
        });
        if let Err(error) = spawned {
            let _ = writeln!(std::io::stderr(), "warning: not watching the launcher's pipe: {error}");
        }
    }

    /// Clean end: a barrier over the channel so no rank mistakes a finished peer for a dead
    /// one, then close. Waits for every rank to call `finish` (a dead rank stops this one as
    /// at any other time).
    pub fn finish(self) -> Result<()> {
        let shared = &self.shared;
        let mut state = lock(&shared.state);
        if shared.rank == 0 {
            while state.done.len() < shared.writers.len() && state.stopped.is_none() {
                state = wait(&shared.changed, state);
            }
            if state.stopped.is_none() {
                drop(state);
                shared.send(None, &Frame { tag: Tag::Done, origin: 0, step: shared.step(), message: String::new() });
                return Ok(());
            }
        } else {
            drop(state);
            shared.send(
                None,
                &Frame { tag: Tag::Done, origin: shared.rank, step: shared.step(), message: String::new() },
            );
            state = lock(&shared.state);
            while !state.released && state.stopped.is_none() {
                state = wait(&shared.changed, state);
            }
        }
        match state.stopped.take() {
            Some(line) => Err(anyhow!(line)),
            None => Ok(()),
        }
    }
}

impl Drop for ControlChannel {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        for stream in &self.streams {
            // The peer sees the end of stream: after `finish` it expects it, else this rank died.
            let _ = stream.shutdown(Shutdown::Both);
        }
        for watcher in self.watchers.drain(..) {
            let _ = watcher.join();
        }
    }
}

impl FailureNotifier {
    /// This rank is stopping with an error: tell the others before exiting.
    pub fn report_failure(&self, message: &str) {
        self.shared.report_failure(message);
    }

    /// "last checkpoint: <path> (rerun with --resume to continue)", or "no checkpoint yet".
    pub fn checkpoint_text(&self) -> String {
        self.shared.checkpoint_text()
    }
}

impl Shared {
    fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    fn checkpoint_text(&self) -> String {
        match &*lock(&self.checkpoint) {
            Some(path) => format!("last checkpoint: {} (rerun with --resume to continue)", path.display()),
            None => "no checkpoint yet".into(),
        }
    }

    fn report_failure(&self, message: &str) {
        self.stopping.store(true, Ordering::SeqCst);
        self.send(None, &Frame { tag: Tag::Failed, origin: self.rank, step: self.step(), message: message.into() });
    }

    /// Writes `frame` to every peer but `except`; a dead peer's error is not news.
    fn send(&self, except: Option<usize>, frame: &Frame) {
        for (peer, writer) in &self.writers {
            if Some(*peer) != except {
                let _ = frame.write(&mut *lock(writer));
            }
        }
    }

    /// Stops this rank with `line`, once (later calls, and a loss after `stopping`, are quiet);
    /// rank 0 first relays `relay` to every rank but the one it came from.
    fn stop(&self, line: String, relay: Option<(usize, Frame)>) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some((from, frame)) = relay {
            self.send(Some(from), &frame);
        }
        lock(&self.state).stopped = Some(line.clone());
        self.changed.notify_all();
        (self.on_stop)(line);
    }

    /// Rank 0's watcher of rank `peer`.
    fn watch_rank(&self, peer: usize, mut reader: TcpStream) {
        // The step `peer` last said it started.
        let mut peer_step = NO_STEP;
        loop {
            match Frame::read(&mut reader) {
                Ok(Frame { tag: Tag::Step, step, .. }) => peer_step = step,
                Ok(Frame { tag: Tag::Done, .. }) => {
                    lock(&self.state).done.push(peer);
                    self.changed.notify_all();
                }
                Ok(Frame { tag: Tag::Failed, step, message, .. }) => {
                    let line = format!(
                        "rank {peer} failed {}: {message}; stopping rank 0; {}",
                        at(step),
                        self.checkpoint_text()
                    );
                    return self.stop(line, Some((peer, Frame { tag: Tag::Failed, origin: peer, step, message })));
                }
                // Only rank 0 sends `lost`.
                Ok(Frame { tag: Tag::Lost, .. }) => {}
                Err(_) => {
                    if self.stopping.load(Ordering::SeqCst) || lock(&self.state).done.contains(&peer) {
                        return;
                    }
                    let step = if peer_step == NO_STEP { self.step() } else { peer_step };
                    let line = format!(
                        "rank {peer} exited (connection closed) {}: stopping rank 0; {}",
                        at(step),
                        self.checkpoint_text()
                    );
                    return self.stop(
                        line,
                        Some((peer, Frame { tag: Tag::Lost, origin: peer, step, message: String::new() })),
                    );
                }
            }
        }
    }

    /// A non-zero rank's watcher of rank 0.
    fn watch_host(&self, mut reader: TcpStream) {
        // The step rank 0 last said it started.
        let mut host_step = NO_STEP;
        let line = loop {
            break match Frame::read(&mut reader) {
                Ok(Frame { tag: Tag::Done, .. }) => {
                    lock(&self.state).released = true;
                    self.changed.notify_all();
                    return;
                }
                Ok(Frame { tag: Tag::Failed, origin, step, message }) => {
                    format!("rank {origin} failed {}: {message};", at(step))
                }
                Ok(Frame { tag: Tag::Lost, origin, step, .. }) => {
                    format!("rank {origin} exited (connection closed) {}:", at(step))
                }
                Ok(Frame { tag: Tag::Step, step, .. }) => {
                    host_step = step;
                    continue;
                }
                Err(_) => {
                    if self.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let step = if host_step == NO_STEP { self.step() } else { host_step };
                    format!("lost rank 0 (the rendezvous host) {}: connection closed;", at(step))
                }
            };
        };
        self.stop(format!("{line} stopping rank {}; {}", self.rank, self.checkpoint_text()), None);
    }
}

/// "at step s", or "before the first step".
fn at(step: u64) -> String {
    if step == NO_STEP {
        "before the first step".into()
    } else {
        format!("at step {step}")
    }
}

/// Locks `mutex`; a thread that panicked holding it left plain data, still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::testing::channels;
    use super::*;

    #[test]
    fn a_rank_that_drops_without_finishing_stops_the_others() {
        let (mut ranks, stops) = channels(3);
        for rank in &ranks {
            rank.set_step(3);
        }
        ranks[1].set_checkpoint(Path::new("/runs/a/checkpoint.safetensors"));
        drop(ranks.pop());
        let lines = stops.take(2);
        assert_eq!(
            lines[0],
            (0, "rank 2 exited (connection closed) at step 3: stopping rank 0; no checkpoint yet".into())
        );
        let want = "rank 2 exited (connection closed) at step 3: stopping rank 1; \
                    last checkpoint: /runs/a/checkpoint.safetensors (rerun with --resume to continue)";
        assert_eq!(lines[1], (1, want.into()));
        assert_eq!(stops.next(Duration::from_millis(200)), None, "one line per rank");
    }

    #[test]
    fn a_rank_that_dies_a_step_ahead_of_rank_0_is_named_at_its_own_step() {
        let (mut ranks, stops) = channels(3);
        ranks[0].set_step(2);
        ranks[1].set_step(2);
        ranks[2].set_step(2);
        ranks[2].set_step(3);
        drop(ranks.pop());
        let lines = stops.take(2);
        assert_eq!(
            lines[0],
            (0, "rank 2 exited (connection closed) at step 3: stopping rank 0; no checkpoint yet".into())
        );
        assert!(lines[1].1.starts_with("rank 2 exited (connection closed) at step 3: stopping rank 1"), "{lines:?}");
    }

    #[test]
    fn losing_rank_0_a_step_ahead_names_its_step() {
        let (mut ranks, stops) = channels(2);
        ranks[1].set_step(2);
        ranks[0].set_step(2);
        ranks[0].set_step(3);
        drop(ranks.remove(0));
        let lines = stops.take(1);
        assert!(lines[0].1.starts_with("lost rank 0 (the rendezvous host) at step 3: connection closed"), "{lines:?}");
    }

    #[test]
    fn losing_rank_0_stops_the_others() {
        let (mut ranks, stops) = channels(3);
        ranks[1].set_step(4);
        drop(ranks.remove(0));
        let lines = stops.take(2);
        assert_eq!(
            lines[0],
            (
                1,
                "lost rank 0 (the rendezvous host) at step 4: connection closed; stopping rank 1; no checkpoint yet"
                    .into()
            )
        );
        assert!(lines[1].1.starts_with("lost rank 0 (the rendezvous host) before the first step"), "{lines:?}");
    }

    #[test]
    fn a_reported_failure_reaches_every_rank() {
        let (ranks, stops) = channels(3);
        ranks[1].set_step(5);
        ranks[1].report_failure("out of memory");
        let lines = stops.take(2);
        assert_eq!(lines[0], (0, "rank 1 failed at step 5: out of memory; stopping rank 0; no checkpoint yet".into()));
        assert_eq!(lines[1], (2, "rank 1 failed at step 5: out of memory; stopping rank 2; no checkpoint yet".into()));
        drop(ranks);
        assert_eq!(
            stops.next(Duration::from_millis(200)),
            None,
            "the failed rank reports nothing, nor do the others twice"
        );
    }

    #[test]
    fn rank_0s_failure_reaches_every_rank() {
        let (ranks, stops) = channels(3);
        ranks[0].notifier().report_failure("disk full");
        let lines = stops.take(2);
        assert_eq!(lines[0].1, "rank 0 failed before the first step: disk full; stopping rank 1; no checkpoint yet");
        assert_eq!(lines[1].0, 2);
    }

    #[test]
    fn finishing_while_a_peer_dies_is_an_error() {
        let (mut ranks, stops) = channels(3);
        let finishing = ranks.remove(0);
        let thread = std::thread::spawn(move || finishing.finish());
        drop(ranks.pop());
        let message = format!("{:#}", thread.join().unwrap().unwrap_err());
        assert!(message.starts_with("rank 2 exited (connection closed)"), "{message}");
        assert_eq!(stops.take(2).len(), 2, "ranks 0 and 1 stop");
    }

    #[test]
    fn finishing_together_reports_nothing() {
        let (ranks, stops) = channels(4);
        let threads: Vec<_> = ranks.into_iter().map(|rank| std::thread::spawn(move || rank.finish())).collect();
        for thread in threads {
            thread.join().unwrap().unwrap();
        }
        assert_eq!(stops.next(Duration::from_millis(300)), None);
    }

    #[test]
    fn the_end_of_the_launchers_pipe_stops_the_rank() {
        let (ranks, stops) = channels(2);
        ranks[1].watch_launcher(std::io::empty());
        let (rank, line) = stops.next(Duration::from_secs(10)).unwrap();
        assert_eq!(
            (rank, line.as_str()),
            (1, "the launcher (transponder launch) exited: stopping rank 1; no checkpoint yet")
        );
    }
}
