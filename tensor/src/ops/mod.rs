//! Shape-checked ops: each validates shapes, dtype and device (returning an error that
//! names the op and the shapes), then dispatches to a kernel. No autograd here.
//!
//! One file per op family, named as the kernels' family (`kernels::cpu::<family>`,
//! `kernels::cuda::<family>`): its CPU half first, then, with feature `cuda`, its CUDA half as
//! the module `cuda` at the end of the same file, so an op reads top to bottom in one place.

mod attention;
mod batch_norm;
mod concat;
mod conv;
mod cross_entropy;
mod elementwise;
mod embedding;
mod fused_gate;
mod linear_cross_entropy;
pub(crate) mod matmul;
mod norm;
mod packed_linear;
mod pool;
pub(crate) mod reduce;
mod rope;
mod rope_table;
mod rotary_attention;
mod row_checks;
mod softmax;
mod swiglu;

pub use batch_norm::{BatchNormGrads, BatchNormOutput};
pub use conv::Conv2dGrads;
pub use cross_entropy::{CrossEntropy, SavedTargets};
pub use fused_gate::{FusedGateSaved, GatedProjection};
pub use kernels::cpu::binary::Binary;
pub use kernels::cpu::unary::Unary;
pub use linear_cross_entropy::{LinearCrossEntropy, LOGITS_CHUNK_BYTES};
pub use norm::{AddRmsNormOutput, LayerNormOutput, RmsNormOutput};
pub use packed_linear::ProductOutput;
pub use pool::MaxPoolIndices;
pub use rotary_attention::PackedAttention;
