//! Models for Transponder built from presets: the LLaMA decoder with every contextual
//! modulator variant and baseline of SPEC §1-6 ([`llama`]).

pub mod llama;
pub mod resnet;

pub use llama::{Llama, LlamaConfig};

/// What can go wrong building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An invalid config: an unknown name (the message lists the valid ones), an invalid
    /// combination, or inputs that do not fit it.
    #[error("config: {0}")]
    Config(String),
    /// A tensor op failed (shapes, indices).
    #[error(transparent)]
    Tensor(#[from] tensor::Error),
}

/// Result of a model operation.
pub type Result<T> = std::result::Result<T, Error>;
