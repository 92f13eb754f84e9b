//! The gradient-check toolkit every crate's tests share: one finite-difference helper
//! ([`derivative`], [`gradient`]), one set of f64 reference functions ([`oracle`]), one
//! tolerance table per dtype ([`Dtype::table`]), one comparison of gradients ([`compare`],
//! [`check_gradient`]) that names the worst element and one of computed values ([`close`],
//! [`assert_close`]).
//!
//! Two kinds of check use it:
//! - kernel checks (`kernels`' unit tests): the analytic gradient of an f32 kernel against
//!   differences of an f64 oracle ([`Dtype::F64`] table);
//! - engine checks (`autograd::gradcheck`, used by `nn` and `tests`): the gradient from the
//!   tape against differences of the engine's own f32 forward ([`Dtype::F32`] table).
//!
//! The crate has no dependencies, so the lowest crate (`kernels`) can take it as a
//! dev-dependency and `autograd` as a normal one without a cycle.

mod compare;
mod difference;
pub mod oracle;
mod tolerance;

pub use compare::{assert_close, assert_within, check_gradient, close, compare, Mismatch, Worst};
pub use difference::{derivative, derivative_with_noise, gradient, Estimate};
pub use tolerance::{Dtype, Table, Tolerance};
