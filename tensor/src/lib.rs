//! N-d tensors for Transponder: shape, strides, dtype and device, views without copies,
//! broadcasting, and shape-checked dispatch to the `kernels` crate. No autograd here.
//!
//! A [`Tensor`] is an immutable view (`Arc` storage + shape + strides + offset): views
//! (reshape, permute, narrow, expand) share storage; ops return new tensors. Compute is f32;
//! bf16 and f16 are storage formats converted with [`Tensor::to_dtype`].

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
mod view;

pub use dtype::{DType, Device};
pub use error::{Error, Result};
pub use rng::Rng;
pub use shape::{broadcast_shapes, contiguous_strides, with_last_dim};
pub use storage::Storage;
pub use tensor::{HostLater, Tensor};
