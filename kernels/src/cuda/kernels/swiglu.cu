// SwiGLU gating y = silu(g)·u = g·σ(g)·u, forward and backward (cpu/swiglu.rs), in grid-stride
// loops. The backward recomputes σ(g) from g and writes
// (gradients are written, not added: kernels/src/lib.rs):
//   dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),   du = dy·g·σ(g)
// Each f32 output may have a bf16 twin (non-null pointer): the same values rounded to nearest
// even, as f32_to_bf16_kernel writes them, for the bf16 products that read the output.

// Each kernel handles W consecutive elements per step: W = 4 (16-byte loads and stores, 8-byte
// for the bf16 twins: fewer instructions and more bytes in flight per thread) over the first
// n − n % 4 elements when every pointer is aligned to that, then W = 1 for the rest (all of them
// when a pointer is not aligned). Same arithmetic per element on both paths.

// out[i] = g·σ(g)·u for i in [i0, i0 + W)
template <int W>
__device__ __forceinline__ void swiglu_forward_at(const float* gate, const float* up, float* out, bf16_t* out_bf16,
                                                  i64 i0) {
    float g[W], u[W], y[W];
    load_f32(g, gate + i0);
    load_f32(u, up + i0);
    for (int k = 0; k < W; ++k) y[k] = g[k] * sigmoid_f(g[k]) * u[k];
    store_f32(out + i0, y);
    if (out_bf16) store_bf16(out_bf16 + i0, y);
}

extern "C" __global__ void swiglu_forward(const float* gate, const float* up, float* out, bf16_t* out_bf16, i64 n) {
    const bool wide = is_aligned(gate, 16) && is_aligned(up, 16) && is_aligned(out, 16) && is_aligned(out_bf16, 8);
    const i64 quads = wide ? n / 4 : 0;
    GRID_STRIDE(q, quads) swiglu_forward_at<4>(gate, up, out, out_bf16, 4 * q);
    GRID_STRIDE_FROM(i, 4 * quads, n) swiglu_forward_at<1>(gate, up, out, out_bf16, i);
}

// dgate[i] = dout[i]·up[i]·silu'(gate[i]),  dup[i] = dout[i]·silu(gate[i]) for i in [i0, i0 + W)
template <int W>
__device__ __forceinline__ void swiglu_backward_at(const float* gate, const float* up, const float* dout,
                                                   float* dgate, float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16,
                                                   i64 i0) {
    float g[W], u[W], dy[W], dg[W], du[W];
    load_f32(g, gate + i0);
    load_f32(dy, dout + i0);
    load_f32(u, up + i0);
    for (int k = 0; k < W; ++k) {
        float s = sigmoid_f(g[k]);
        // d/dg silu(g) = σ(g)·(1 + g·(1 − σ(g)))
        float dsilu = s * (1.0f + g[k] * (1.0f - s));
        dg[k] = dy[k] * u[k] * dsilu;
        du[k] = dy[k] * (g[k] * s);
    }
    store_f32(dgate + i0, dg);
    store_f32(dup + i0, du);
    if (dgate_bf16) store_bf16(dgate_bf16 + i0, dg);
    if (dup_bf16) store_bf16(dup_bf16 + i0, du);
}

extern "C" __global__ void swiglu_backward(const float* gate, const float* up, const float* dout, float* dgate,
                                           float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16, i64 n) {
    const bool wide = is_aligned(gate, 16) && is_aligned(up, 16) && is_aligned(dout, 16) && is_aligned(dgate, 16) &&
                      is_aligned(dup, 16) && is_aligned(dgate_bf16, 8) && is_aligned(dup_bf16, 8);
    const i64 quads = wide ? n / 4 : 0;
    GRID_STRIDE(q, quads) swiglu_backward_at<4>(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, 4 * q);
    GRID_STRIDE_FROM(i, 4 * quads, n) swiglu_backward_at<1>(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, i);
}
