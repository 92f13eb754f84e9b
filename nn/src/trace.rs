//! Capturing gate values during a forward pass, for the analyses of the papers (Transponder
//! Figures 2-3, CCL Figures 5-6): a scoped recorder, off by default.
//!
//! [`capture`] switches recording on for the current thread while it runs a closure and
//! returns what the layers recorded. Each record is keyed by the id of one of the recording
//! layer's parameters (a [`Var::id`]), so a model maps it back to a parameter name without
//! threading names through every forward:
//!
//! | recorder | key parameter | kind | value |
//! |---|---|---|---|
//! | a projection's or path's [`Gate`] | the gate's first parameter (`A`, `w1`, `beta1`, `weight`) | `gate` | `[N, m]` (`[m]` for non-contextual) |
//! | [`crate::ccl::ContextConditionedLinear`] | its `bias` | `gate_basis`, `gate_out` | `[N, k]`, `[N, d_out]` |
//!
//! When recording is off the cost is one thread-local flag read per layer: the normal forward
//! is unchanged. Gate values that a fused op never materialises are recomputed (without a
//! graph) only while recording.

use std::cell::{Cell, RefCell};

use autograd::{no_grad, Result, Var};
use tensor::Tensor;

use crate::modulator::Gate;

/// One captured tensor.
#[derive(Clone, Debug)]
pub struct Record {
    /// The [`Var::id`] of the parameter naming the recorder (see the module table).
    pub key: u64,
    /// What was recorded (`gate`, `gate_basis`, `gate_out`).
    pub kind: &'static str,
    /// The values, rows in the order of the forward's input rows.
    pub value: Tensor,
}

thread_local! {
    static RECORDING: Cell<bool> = const { Cell::new(false) };
    static RECORDS: RefCell<Vec<Record>> = const { RefCell::new(Vec::new()) };
}

/// True inside [`capture`] on this thread.
pub fn is_recording() -> bool {
    RECORDING.with(Cell::get)
}

/// Stores `value` when recording (a no-op otherwise).
pub fn record(key: u64, kind: &'static str, value: Tensor) {
    if is_recording() {
        RECORDS.with(|r| r.borrow_mut().push(Record { key, kind, value }));
    }
}

/// Recomputes and stores the gate `gate` produces for `x: [..., d_in]` when recording. The
/// channel × scalar pair is stored as two records (channel, then scalar), each keyed by its
/// own modulator's `A`.
pub fn record_gate(gate: &Gate, x: &Var) -> Result<()> {
    if !is_recording() {
        return Ok(());
    }
    no_grad(|| {
        let shape = x.shape();
        let d_in = shape.last().copied().unwrap_or(1).max(1);
        let rows = x.reshape(&[x.value_ref().numel() / d_in, d_in])?;
        match gate {
            Gate::ChannelScalar { channel, scalar } => {
                record(channel.a_weight.id(), "gate", channel.forward(&rows)?.value());
                record(scalar.a_weight.id(), "gate", scalar.forward(&rows)?.value());
            }
            Gate::Modulator(m) => record(m.a_weight.id(), "gate", m.forward(&rows)?.value()),
            Gate::NonContextual(g) => record(g.beta1.id(), "gate", g.forward()?.value()),
            Gate::Comt(m) => record(m.w1.id(), "gate", m.forward(&rows)?.value()),
            Gate::Dense(g) => record(g.linear.weight.id(), "gate", g.forward(&rows)?.value()),
        }
        Ok(())
    })
}

/// Runs `f` with recording on and returns its result with every record made meanwhile, in
/// the order the layers ran. Nested calls each get their own records.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, Vec<Record>) {
    /// Restores the outer scope's flag and records, also when `f` unwinds.
    struct Restore(bool, Vec<Record>);
    impl Drop for Restore {
        fn drop(&mut self) {
            RECORDING.with(|r| r.set(self.0));
            RECORDS.with(|r| *r.borrow_mut() = std::mem::take(&mut self.1));
        }
    }
    let outer = RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let restore = Restore(RECORDING.with(|r| r.replace(true)), outer);
    let out = f();
    let records = RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    drop(restore);
    (out, records)
}
