//! Data-parallel training's process machinery: where a process sits in the job ([`World`],
//! from the launcher's environment), the rendezvous that hands every rank the communicator
//! id ([`rendezvous`]), the control channel that stops every rank when one dies
//! ([`ControlChannel`]), the collective deadline ([`Watchdog`]) and `transponder launch`.
//!
//! Exit codes of `transponder` (its commands exit 0 on success, 1 on an error, 2 on a usage
//! error from the argument parser):
//! - [`EXIT_PEER_FAILED`] (3): this rank stopped because another rank failed or died (or
//!   the launcher did); the rank that failed first exits with its own code.
//! - [`EXIT_COLLECTIVE_TIMEOUT`] (4): a collective stayed in flight past
//!   `--collective-timeout`, or the communicator reported an asynchronous error.
//!
//! `transponder launch` exits with the code of the rank that failed first (128 + signal for
//! a killed rank), preferring a rank's own failure over [`EXIT_PEER_FAILED`].

mod control;
mod launch;
mod rendezvous;
mod watchdog;
mod wire;
mod world;

pub use control::{ControlChannel, FailureNotifier};
pub use launch::{launch, LaunchArgs};
pub use rendezvous::rendezvous;
pub use watchdog::{Poll, Watchdog, WatchdogGuard};
pub use world::World;

/// Exit code of a rank stopped by another rank's failure or death.
pub const EXIT_PEER_FAILED: i32 = 3;
/// Exit code of a rank whose collective timed out or failed (the watchdog).
pub const EXIT_COLLECTIVE_TIMEOUT: i32 = 4;

/// Set by `transponder launch` in each rank's environment: stdin is a pipe from the
/// launcher, whose end means the launcher died.
const LAUNCHER_PIPE_ENV: &str = "TRANSPONDER_LAUNCHER_PIPE";

#[cfg(test)]
mod testing;
