//! Raw compute for Transponder: functions over slices, no shapes and no autograd.
//!
//! Every kernel takes plain `&[f32]` inputs and writes into caller-owned `&mut [f32]`
//! outputs. Backward kernels *accumulate* into their gradient buffers (`dx += ...`), so a
//! value used twice just works and the caller never allocates-then-adds.
//!
//! Dimension legend used in doc comments: `B` batch, `T` sequence, `C` channels / width,
//! `H` heads, `D` head dim, `V` vocabulary, `N` rows.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
