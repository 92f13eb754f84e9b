//! Layers, contextual modulators, optimizers and initialisers for Transponder.
//!
//! Layers own their parameters as [`autograd::Var`] leaves and expose them through
//! [`Module`] with hierarchical names (`layers.0.self_attn.q_proj.weight`), which the
//! optimizers, checkpoints and parameter counts all walk.

pub mod attention;
pub mod ccl;
pub mod ffn;
pub mod init;
pub mod layers;
pub mod modulator;
pub mod module;
pub mod optim;
pub mod per_token;
pub mod trace;
pub mod vision;

pub use module::{Module, NamedParameter};
