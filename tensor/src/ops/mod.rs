//! Shape-checked ops: each validates shapes, dtype and device (returning an error that
//! names the op and the shapes), then dispatches to a kernel. No autograd here.

mod batch_norm;
mod concat;
mod conv;
mod elementwise;
mod fused_gate;
mod matmul;
mod nn;
mod pool;
mod reduce;
mod rope_table;
mod swiglu;

pub use batch_norm::{BatchNormGrads, BatchNormOutput};
pub use conv::Conv2dGrads;
pub use fused_gate::FusedGateSaved;
pub use kernels::cpu::binary::Binary;
pub use kernels::cpu::unary::Unary;
pub use nn::{CrossEntropy, LayerNormOutput, RmsNormOutput};
pub use pool::MaxPoolIndices;
