//! Shape-checked ops: each validates shapes, dtype and device (returning an error that
//! names the op and the shapes), then dispatches to a kernel. No autograd here.

mod concat;
mod conv;
mod elementwise;
mod matmul;
mod nn;
mod reduce;
mod swiglu;

pub use kernels::cpu::binary::Binary;
pub use kernels::cpu::unary::Unary;
pub use nn::{CrossEntropy, LayerNormOutput, RmsNormOutput};
