//! Basic layers: linear, embedding, normalisation, activations-as-layers.

mod embedding;
mod linear;
mod norm;

pub use embedding::Embedding;
pub use linear::Linear;
pub use norm::{DyT, LayerNorm, Norm, RmsNorm};
