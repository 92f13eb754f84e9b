// SwiGLU gating y = silu(g)·u = g·σ(g)·u, forward and backward (cpu/swiglu.rs), in grid-stride
// loops, of separate gate and up tensors or of the two halves of one product. The backward
// recomputes σ(g) from g and writes (gradients are written, not added: kernels/src/lib.rs):
//   dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),   du = dy·g·σ(g)
// The forward's f32 output may have a bf16 twin (non-null pointer): the same values rounded to
// nearest even, as f32_to_bf16_kernel writes them, for the bf16 products that read the output,
// or be null (written in bf16 alone, for products its only readers). Each backward gradient is
// written in f32 or (its f32 pointer null, its bf16 one not) rounded to bf16 alone. The
// gate and up inputs are f32, or (the _bf16 kernels) bf16: a bf16 product's output, as
// autocast stores it; the backward's dout is f32, or bf16 beside bf16 inputs (_dout_bf16: the
// down product's input gradient under bf16 products). The arithmetic is f32 either way.

// Element i of the [rows, cols] output (or output gradient) is at row i / cols, column i % cols.
// The gate and up inputs and their gradients have rows `stride` apart: stride == cols, plain
// contiguous tensors (index i, no division); stride == 2·cols, the two halves of one
// [rows, 2·cols] product (gate columns first, `up` = gate + cols), as the FFN's one GEMM over
// its packed gate and up weights writes it.
__device__ __forceinline__ i64 halves_at(i64 i, i64 cols, i64 stride) {
    if (stride == cols) return i;
    // A 32-bit division when it fits (the usual case): a 64-bit one is emulated on the GPU.
    if (i <= 0xffffffffLL && cols <= 0xffffffffLL) {
        const unsigned row = (unsigned)i / (unsigned)cols;
        return (i64)row * stride + (i - (i64)row * cols);
    }
    return i / cols * stride + i % cols;
}

// Each kernel handles W consecutive elements per step: W = 4 (16-byte loads and stores, 8-byte
// for the bf16 twins: fewer instructions and more bytes in flight per thread) over the first
// n − n % 4 elements when every pointer is aligned to that (and, for halves, the rows split
// into whole groups of 4), then W = 1 for the rest (all of them otherwise). Same arithmetic per
// element on both paths.

// out[i] = g·σ(g)·u for i in [i0, i0 + W), reading gate and up (of type T) at `at`
template <int W, typename T>
__device__ __forceinline__ void swiglu_forward_at(const T* gate, const T* up, float* out, bf16_t* out_bf16, i64 i0,
                                                  i64 at) {
    float g[W], u[W], y[W];
    load_f32(g, gate + at);
    load_f32(u, up + at);
    for (int k = 0; k < W; ++k) y[k] = swiglu_value(g[k], u[k]);
    if (out) store_f32(out + i0, y);
    if (out_bf16) store_bf16(out_bf16 + i0, y);
}

template <typename T>
__device__ __forceinline__ void swiglu_forward_all(const T* gate, const T* up, float* out, bf16_t* out_bf16, i64 n,
                                                   i64 cols, i64 stride) {
    const unsigned int in_bytes = 4 * sizeof(T);
    const bool wide = is_aligned(gate, in_bytes) && is_aligned(up, in_bytes) && is_aligned(out, 16) &&
                      is_aligned(out_bf16, 8) && (stride == cols || cols % 4 == 0);
    const i64 quads = wide ? n / 4 : 0;
    GRID_STRIDE(q, quads) swiglu_forward_at<4>(gate, up, out, out_bf16, 4 * q, halves_at(4 * q, cols, stride));
    GRID_STRIDE_FROM(i, 4 * quads, n) swiglu_forward_at<1>(gate, up, out, out_bf16, i, halves_at(i, cols, stride));
}

extern "C" __global__ void swiglu_forward(const float* gate, const float* up, float* out, bf16_t* out_bf16, i64 n,
                                          i64 cols, i64 stride) {
    swiglu_forward_all(gate, up, out, out_bf16, n, cols, stride);
}

extern "C" __global__ void swiglu_forward_bf16(const bf16_t* gate, const bf16_t* up, float* out, bf16_t* out_bf16,
                                               i64 n, i64 cols, i64 stride) {
    swiglu_forward_all(gate, up, out, out_bf16, n, cols, stride);
}

// dgate = dout·up·silu'(gate),  dup = dout·silu(gate) for i in [i0, i0 + W): dout at i0, the
// inputs and the gradients at `at`
template <int W, typename T, typename D>
__device__ __forceinline__ void swiglu_backward_at(const T* gate, const T* up, const D* dout,
                                                   float* dgate, float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16,
                                                   i64 i0, i64 at) {
    float g[W], u[W], dy[W], dg[W], du[W];
    load_f32(g, gate + at);
    load_f32(dy, dout + i0);
    load_f32(u, up + at);
    for (int k = 0; k < W; ++k) {
        dg[k] = swiglu_gate_grad(g[k], u[k], dy[k]);
        du[k] = swiglu_up_grad(g[k], dy[k]);
    }
    if (dgate) store_f32(dgate + at, dg);
    if (dup) store_f32(dup + at, du);
    if (dgate_bf16) store_bf16(dgate_bf16 + at, dg);
    if (dup_bf16) store_bf16(dup_bf16 + at, du);
}

template <typename T, typename D>
__device__ __forceinline__ void swiglu_backward_all(const T* gate, const T* up, const D* dout, float* dgate,
                                                    float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16, i64 n,
                                                    i64 cols, i64 stride) {
    const unsigned int in_bytes = 4 * sizeof(T);
    const bool wide = is_aligned(gate, in_bytes) && is_aligned(up, in_bytes) && is_aligned(dout, 4 * sizeof(D)) &&
                      is_aligned(dgate, 16) && is_aligned(dup, 16) && is_aligned(dgate_bf16, 8) &&
                      is_aligned(dup_bf16, 8) && (stride == cols || cols % 4 == 0);
    const i64 quads = wide ? n / 4 : 0;
    GRID_STRIDE(q, quads) {
        swiglu_backward_at<4>(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, 4 * q, halves_at(4 * q, cols, stride));
    }
    GRID_STRIDE_FROM(i, 4 * quads, n) {
        swiglu_backward_at<1>(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, i, halves_at(i, cols, stride));
    }
}

extern "C" __global__ void swiglu_backward(const float* gate, const float* up, const float* dout, float* dgate,
                                           float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16, i64 n, i64 cols,
                                           i64 stride) {
    swiglu_backward_all(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, n, cols, stride);
}

extern "C" __global__ void swiglu_backward_bf16(const bf16_t* gate, const bf16_t* up, const float* dout,
                                                float* dgate, float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16, i64 n,
                                                i64 cols, i64 stride) {
    swiglu_backward_all(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, n, cols, stride);
}

// The backward from bf16 gate and up values and a bf16 dout (the down product's input
// gradient, stored so under bf16 products).
extern "C" __global__ void swiglu_backward_bf16_dout_bf16(const bf16_t* gate, const bf16_t* up, const bf16_t* dout,
                                                          float* dgate, float* dup, bf16_t* dgate_bf16,
                                                          bf16_t* dup_bf16, i64 n, i64 cols, i64 stride) {
    swiglu_backward_all(gate, up, dout, dgate, dup, dgate_bf16, dup_bf16, n, cols, stride);
}
