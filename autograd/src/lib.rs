//! Reverse-mode automatic differentiation for Transponder.
//!
//! A [`Var`] is a tensor plus the node that produced it. Each op builds its output with
//! [`Var::from_op`], handing over a closure that maps the output's gradient to one
//! gradient per input; the closure holds exactly what that backward reads. `backward()`
//! walks the graph in reverse creation order (a sorted `Vec`, never recursion, so deep
//! graphs cannot overflow the stack) and accumulates gradients with `+=` semantics, so a
//! value used twice just works. Leaves that require gradients (parameters) keep theirs in
//! [`Var::grad`] until [`Var::zero_grad`].
//!
//! Ops live in `ops/`, one family per file, each backward rule right below its forward.

mod gradcheck;
pub mod ops;
mod profile;
mod var;

pub use gradcheck::{gradcheck, gradcheck_leaves, Elements, GradcheckFailure, GradcheckReport};
pub use profile::OpTime;
pub use tensor::{Error, Result, Tensor};
pub use var::{is_grad_enabled, no_grad, Var};
