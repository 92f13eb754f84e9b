//! Raw compute for Transponder: functions over slices, no shapes and no autograd.
//!
//! Every kernel takes plain `&[f32]` inputs and writes into caller-owned `&mut [f32]`
//! outputs.
//!
//! The gradient contract, one for every backward kernel on both devices: a backward kernel
//! *writes* its gradients (`dx = ∂L/∂x`). Whatever a gradient buffer holds on entry is
//! ignored and every element is overwritten (zeros where nothing flows back), so callers
//! hand over fresh, uninitialised buffers and never zero-fill them. A value used twice gets
//! one gradient per use, and the autograd engine sums them (`Var::backward_with` in
//! `autograd/src/var.rs`, through `Tensor::accumulate`), or hands the sum so far to the op
//! that writes the next one (`Var::from_op_absorbing`), which reads it as an input (RMSNorm's
//! `residual`) or, on a GPU, has cuBLAS add onto it (`Tensor::add_matmul`, β = 1). Tests
//! pass NaN-filled buffers, so a kernel that reads or skips an element fails them. The one
//! kind of function that adds into its output on purpose is a building block of a reduction:
//! a GEMM with `Store::Accumulate` (`C += A·B`, BLAS's β = 1), the fused gate's row passes;
//! each says so where it is declared.
//!
//! [`collective`] is the host collective: NCCL's collectives over TCP on host slices, for
//! data parallelism on the CPU and as the engine of the emulated NCCL (`cuda::nccl`).
//!
//! Dimension legend used in doc comments: `B` batch, `T` sequence, `C` channels / width,
//! `H` heads, `D` head dim, `V` vocabulary, `N` rows.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
