//! Differentiable ops on [`crate::Var`], one family per file. Each forward calls the
//! shape-checked tensor op; its backward rule sits right below it.

mod arithmetic;
mod attention;
mod batch_norm;
mod conv;
mod cross_entropy;
mod embedding;
mod fused_gate;
mod linear_cross_entropy;
mod matmul;
mod norm;
mod packed_linear;
mod pool;
mod reduce;
mod rope;
mod select;
mod softmax;
mod swiglu;
mod unary;
mod view;

pub use fused_gate::GatedProjectionVars;
pub use tensor::ops::{Binary, ProductOutput, Unary};
