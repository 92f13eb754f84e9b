//! The op profiler: wall time per op name, forward and backward, on this thread. The tape
//! (`var.rs`) reports each node it creates and each backward rule it runs; nothing here
//! changes what is computed.

use std::cell::RefCell;
use std::time::Instant;

use crate::Var;

thread_local! {
    static PROFILE: RefCell<Option<Profile>> = const { RefCell::new(None) };
}

/// Wall time per op while profiling is on (see [`Var::profile_start`]): forward time is the
/// time since the previous graph event on this thread (so it includes the glue between ops),
/// backward time is the op's backward rule plus the accumulation of its input gradients.
struct Profile {
    mark: Instant,
    ops: Vec<OpTime>,
}

/// One row of [`Var::profile_stop`]: `(op, forward seconds, backward seconds, calls)`.
pub type OpTime = (&'static str, f64, f64, usize);

impl Profile {
    fn row(&mut self, op: &'static str) -> &mut OpTime {
        let i = match self.ops.iter().position(|r| r.0 == op) {
            Some(i) => i,
            None => {
                self.ops.push((op, 0.0, 0.0, 0));
                self.ops.len() - 1
            }
        };
        &mut self.ops[i]
    }
}

/// Records `op` in the profile (when on): forward time since the last event.
pub(crate) fn profile_forward(op: &'static str) {
    PROFILE.with(|p| {
        if let Some(p) = p.borrow_mut().as_mut() {
            let now = Instant::now();
            let elapsed = (now - p.mark).as_secs_f64();
            p.mark = now;
            let row = p.row(op);
            row.1 += elapsed;
            row.3 += 1;
        }
    })
}

/// Adds backward time since `start` to `op` (when profiling); returns the time now.
pub(crate) fn profile_backward(op: &'static str, start: Option<Instant>) -> Option<Instant> {
    let start = start?;
    PROFILE.with(|p| {
        let mut p = p.borrow_mut();
        let p = p.as_mut()?;
        let now = Instant::now();
        p.row(op).2 += (now - start).as_secs_f64();
        p.mark = now;
        Some(now)
    })
}

pub(crate) fn profiling() -> bool {
    PROFILE.with(|p| p.borrow().is_some())
}

/// The op's name from its backward closure's type, e.g.
/// `autograd::ops::matmul::<impl autograd::var::Var>::matmul::{{closure}}` → `matmul`.
pub(crate) fn op_name<F>() -> &'static str {
    let mut name = std::any::type_name::<F>();
    while let Some(stripped) = name.strip_suffix("::{{closure}}") {
        name = stripped;
    }
    name.rsplit("::").next().unwrap_or(name)
}

impl Var {
    /// Starts (or restarts) timing every op on this thread; see [`Var::profile_stop`].
    pub fn profile_start() {
        PROFILE.with(|p| *p.borrow_mut() = Some(Profile { mark: Instant::now(), ops: Vec::new() }));
    }

    /// Starts the next forward interval now (call before a forward pass, so time spent
    /// outside the graph, e.g. in the optimizer, is not charged to its first op).
    pub fn profile_mark() {
        PROFILE.with(|p| {
            if let Some(p) = p.borrow_mut().as_mut() {
                p.mark = Instant::now();
            }
        })
    }

    /// Stops timing and returns `(op, forward s, backward s, calls)` per op, slowest first.
    pub fn profile_stop() -> Vec<OpTime> {
        let mut ops = PROFILE.with(|p| p.borrow_mut().take()).map(|p| p.ops).unwrap_or_default();
        ops.sort_by(|a, b| (b.1 + b.2).total_cmp(&(a.1 + a.2)));
        ops
    }
}
