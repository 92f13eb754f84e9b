//! N-d tensors for Transponder: shape, strides, dtype and device, views without copies,
//! broadcasting, and shape-checked dispatch to the `kernels` crate. No autograd here.
//!
//! A [`Tensor`] is an immutable view (`Arc` storage + shape + strides + offset): views
//! (reshape, permute, narrow, expand) share storage; ops return new tensors. Compute is f32;
//! bf16 and f16 are storage formats converted with [`Tensor::to_dtype`]. A batch's token ids
//! (and the LM head's targets) are [`Tokens`]: on a GPU uploaded once, read there by each op.

mod alloc;
mod creation;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod error;
pub mod ops;
pub mod pool;
pub mod rng;
mod shape;
mod storage;
mod tensor;
mod tokens;
mod view;

pub use dtype::{DType, Device};
pub use error::{Error, Result};
pub use rng::Rng;
pub use shape::{broadcast_shapes, contiguous_strides, with_last_dim};
pub use storage::Storage;
pub use tensor::{HostLater, Tensor};
pub use tokens::Tokens;
