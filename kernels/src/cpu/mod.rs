//! CPU kernels: SIMD through `wide`, threads through `rayon` (sequential below a size
//! threshold, because spawning costs more than small loops), matmul through `gemm`.

pub mod attention;
pub mod batch_norm;
pub mod binary;
pub mod conv;
pub mod copy;
pub mod cross_entropy;
pub mod embedding;
pub mod fused_gate;
pub mod gate_rows;
pub mod matmul;
pub mod norm;
pub mod optim;
pub mod parallel;
pub mod pool;
pub mod reduce;
pub mod rope;
pub mod scratch;
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub mod simd16;
pub mod softmax;
pub mod swiglu;
pub mod tile_gemm;
pub mod unary;

/// Whether this CPU runs AVX-512F, where the tile products, the attention score rows, SwiGLU
/// and the Transponder gate rows switch to 16-lane kernels ([`simd16`]) (the check is cached
/// by the standard library).
#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}
