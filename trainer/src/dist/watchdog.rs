//! A deadline for collectives that cannot time out themselves: real NCCL spins forever on a
//! dead peer. The training thread marks a collective in flight ([`Watchdog::arm`]); a thread
//! holding only std synchronisation (the caller's tensors are `Rc` and never cross) stops the
//! process when it stays in flight past `--collective-timeout`, or when `poll` (NCCL's async
//! error check) reports an error, telling the other ranks first.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{FailureNotifier, EXIT_COLLECTIVE_TIMEOUT};

/// NCCL's async-error check: `Some(message)` once the communicator has failed.
pub type Poll = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// What the watchdog does with the line saying why the process stops (tests collect it).
type FireAction = Box<dyn Fn(String) + Send>;

/// Stops the process when a collective stays in flight longer than its timeout.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Marks a collective in flight until dropped.
pub struct WatchdogGuard<'a> {
    watchdog: &'a Watchdog,
}

struct Shared {
    in_flight: Mutex<Option<InFlight>>,
    quit: AtomicBool,
}

#[derive(Clone, Copy)]
struct InFlight {
    what: &'static str,
    step: usize,
    since: Instant,
}

impl Watchdog {
    /// A thread that stops the process when a collective stays in flight longer than
    /// `timeout` (--collective-timeout): it prints "collective <what> of step <s> has not
    /// completed after <T> s (--collective-timeout): stopping; last checkpoint: ...", tells
    /// the others through `notifier` and exits with [`EXIT_COLLECTIVE_TIMEOUT`]. `poll` is
    /// called about once a second while armed and stops the process the same way when it
    /// returns `Some(message)`.
    pub fn start(timeout: Duration, notifier: FailureNotifier, poll: Option<Poll>) -> Watchdog {
        let fire = |line: String| {
            // Best effort: with stderr gone the exit status still tells.
            let _ = writeln!(std::io::stderr(), "{line}");
            std::process::exit(EXIT_COLLECTIVE_TIMEOUT)
        };
        Watchdog::start_with(timeout, notifier, poll, Box::new(fire))
    }

    /// [`Watchdog::start`] with the action on firing given.
    fn start_with(timeout: Duration, notifier: FailureNotifier, poll: Option<Poll>, fire: FireAction) -> Watchdog {
        let shared = Arc::new(Shared { in_flight: Mutex::new(None), quit: AtomicBool::new(false) });
        let watched = Arc::clone(&shared);
        // A tenth of the deadline, between 10 ms and the second `poll` wants.
        let tick = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let thread = std::thread::Builder::new()
            .name("collective-watchdog".into())
            .spawn(move || {
                while !watched.quit.load(Ordering::SeqCst) {
                    std::thread::park_timeout(tick);
                    let Some(in_flight) = *watched.in_flight.lock().unwrap_or_else(|p| p.into_inner()) else {
                        continue;
                    };
                    let (what, step) = (in_flight.what, in_flight.step);
                    let cause = match poll.as_ref().and_then(|poll| poll()) {
                        Some(message) => format!("collective {what} of step {step} failed: {message}"),
                        None if in_flight.since.elapsed() >= timeout => format!(
                            "collective {what} of step {step} has not completed after {} s (--collective-timeout)",
                            timeout.as_secs_f64()
                        ),
                        None => continue,
                    };
                    notifier.report_failure(&cause);
                    return fire(format!("{cause}: stopping; {}", notifier.checkpoint_text()));
                }
            })
            .expect("starting the collective watchdog thread");
        Watchdog { shared, thread: Some(thread) }
    }

    /// Marks `what` of `step` in flight until the guard drops.
    pub fn arm(&self, what: &'static str, step: usize) -> WatchdogGuard<'_> {
        *self.shared.in_flight.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(InFlight { what, step, since: Instant::now() });
        WatchdogGuard { watchdog: self }
    }
}

impl Drop for WatchdogGuard<'_> {
    fn drop(&mut self) {
        *self.watchdog.shared.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.quit.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::super::testing::channels;
    use super::*;

    #[test]
    fn a_collective_past_its_deadline_stops_the_rank_and_tells_the_others() {
        let (ranks, stops) = channels(2);
        ranks[1].set_step(3);
        let (sender, fired) = channel();
        let watchdog = Watchdog::start_with(
            Duration::from_millis(200),
            ranks[1].notifier(),
            None,
            Box::new(move |line| sender.send(line).unwrap()),
        );
        let _guard = watchdog.arm("all_reduce", 3);
        let line = fired.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(line, "collective all_reduce of step 3 has not completed after 0.2 s (--collective-timeout): stopping; no checkpoint yet");
        let (rank, line) = stops.next(Duration::from_secs(10)).unwrap();
        assert_eq!(rank, 0);
        assert!(line.starts_with("rank 1 failed at step 3: "), "{line}");
        assert!(line.contains(": collective all_reduce of step 3 has not completed after 0.2 s"), "{line}");
    }

    #[test]
    fn a_collective_that_completes_in_time_is_not_reported() {
        let (ranks, _stops) = channels(1);
        let (sender, fired) = channel();
        let watchdog = Watchdog::start_with(
            Duration::from_millis(300),
            ranks[0].notifier(),
            None,
            Box::new(move |line| sender.send(line).unwrap()),
        );
        for step in 0..5 {
            let _guard = watchdog.arm("all_reduce", step);
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(500));
        assert!(fired.try_recv().is_err(), "the watchdog fired with nothing in flight too long");
    }

    #[test]
    fn an_error_from_poll_stops_the_rank() {
        let (ranks, _stops) = channels(1);
        let (sender, fired) = channel();
        let poll: Poll = Box::new(|| Some("remote process exited or there was a network error".into()));
        let watchdog = Watchdog::start_with(
            Duration::from_secs(600),
            ranks[0].notifier(),
            Some(poll),
            Box::new(move |line| sender.send(line).unwrap()),
        );
        std::thread::sleep(Duration::from_millis(1500));
        assert!(fired.try_recv().is_err(), "poll is only called while a collective is in flight");
        let _guard = watchdog.arm("broadcast", 0);
        let line = fired.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(line.starts_with("collective broadcast of step 0 failed: remote process exited"), "{line}");
    }
}
