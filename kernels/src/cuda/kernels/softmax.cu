// Softmax, log-softmax (cpu/softmax.rs) and the fused cross-entropy (cpu/cross_entropy.rs)
// over rows of `cols`: one block per row. A row's maximum and its sum of exponentials come
// from one read of the row (an online sum, as FlashAttention's softmax), the exponentials as
// 2^((x − m)·log₂e) by exp2_ftz (the hardware's ex2: expf is about nine instructions; x − m
// first, so that the row's largest value gives exactly 1, as expf(0) does). A row is read in
// chunks of 4 (one 16-byte load of f32, 8 bytes of bf16) where its width and its start allow.
// Backward kernels write their gradients, dx = ... (not added: kernels/src/lib.rs).

// Chunks of 4 columns: whether a launch's rows of `cols` values of type T, the first at
// `row0`, can be read and written 4 at a time (every row's start on a boundary of the chunk's
// size). Uniform across the launch: the kernels below branch on it once, into row walks
// compiled for each answer (QUADS).
template <typename T>
__device__ __forceinline__ bool quad_rows(const T* row0, i64 cols) {
    return cols % 4 == 0 && is_aligned(row0, 4 * sizeof(T));
}

// A row walk's chunks: thread i takes the chunks at columns 4·(i + k·blockDim.x), k = 0, 1,
// ..., ROW_CHUNKS of them a step (their loads issued together) while that many start inside
// the row, then one a step. Without QUADS a row's last chunk may run past its end: those
// columns read as −∞ (nothing past the row counts in its maximum or its sum).
#define ROW_CHUNKS 4

template <bool QUADS, typename T>
__device__ __forceinline__ void load_logits(float (&v)[4], const T* row, i64 j, i64 cols) {
    if (QUADS) {
        load_f32(v, row + j);
        return;
    }
    for (int e = 0; e < 4; ++e) v[e] = j + e < cols ? as_f32(row[j + e]) : NEG_INF;
}

// A share of a row: its largest value m and s = Σ 2^((x − m)·log₂e) = Σ e^(x − m) over its
// values so far. A share with no value above −∞ yet has m = −∞ and s = 0.
struct RowMaxSum {
    float m, s;
};

// Adds N chunks to a share: when they hold a larger value, the sum so far is rescaled to it
// (one exponential for the N chunks), then each value adds its exponential, in order.
template <int N>
__device__ __forceinline__ void add_chunks(RowMaxSum& a, const float (&x)[N][4]) {
    float chunks_max = NEG_INF;
#pragma unroll
    for (int k = 0; k < N; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) chunks_max = fmaxf(chunks_max, x[k][e]);
    }
    if (chunks_max > a.m) {
        a.s *= exp2_ftz((a.m - chunks_max) * LOG2E);  // 2^(−∞) = 0 on the first chunks
        a.m = chunks_max;
    }
    if (a.m == NEG_INF) return;  // nothing above −∞ so far
#pragma unroll
    for (int k = 0; k < N; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a.s += exp2_ftz((x[k][e] - a.m) * LOG2E);
    }
}

// A row's maximum m and Σ_j e^(xr_j − m), from one read of the row; every thread of the block
// gets both. The row is f32 or bf16 (the LM head's logits under bf16 products), summed as its
// f32 values. Each thread sums its chunks into its share, then the block combines the shares,
// each rescaled to the row's maximum.
template <bool QUADS, typename T>
__device__ RowMaxSum row_max_sum(const T* xr, i64 cols) {
    RowMaxSum a{NEG_INF, 0.0f};
    const i64 step = 4 * (i64)blockDim.x;
    i64 j = 4 * (i64)threadIdx.x;
    for (; j + (ROW_CHUNKS - 1) * step < cols; j += ROW_CHUNKS * step) {
        float x[ROW_CHUNKS][4];
#pragma unroll
        for (int k = 0; k < ROW_CHUNKS; ++k) load_logits<QUADS>(x[k], xr, j + k * step, cols);
        add_chunks(a, x);
    }
    for (; j < cols; j += step) {
        float x[1][4];
        load_logits<QUADS>(x[0], xr, j, cols);
        add_chunks(a, x);
    }
    const float m = block_max(a.m);
    const float s = block_sum(a.m == NEG_INF ? 0.0f : a.s * exp2_ftz((a.m - m) * LOG2E));
    return RowMaxSum{m, s};
}

// y = softmax(x) (log = 0) or log_softmax(x) (log = 1) of each row.
template <bool QUADS>
__device__ __forceinline__ void softmax_rows(const float* x, float* y, i64 rows, i64 cols, int log) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        const RowMaxSum row = row_max_sum<QUADS>(xr, cols);
        const float m = row.m, s = row.s;
        if (log) {
            float log_total = m + logf(s);
            for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = xr[j] - log_total;
        } else {
            const float inv = 1.0f / s;
            for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = exp2_ftz((xr[j] - m) * LOG2E) * inv;
        }
    }
}

extern "C" __global__ void softmax_forward(const float* x, float* y, i64 rows, i64 cols, int log) {
    if (quad_rows(x, cols)) {
        softmax_rows<true>(x, y, rows, cols, log);
    } else {
        softmax_rows<false>(x, y, rows, cols, log);
    }
}

// softmax:     d/dx_j = y_j·(dy_j − Σ_i dy_i·y_i)
// log-softmax: d/dx_j = dy_j − e^(y_j)·Σ_i dy_i
extern "C" __global__ void softmax_backward(const float* y, const float* dy, float* dx, i64 rows, i64 cols,
                                            int log) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* yr = y + r * cols;
        const float* dyr = dy + r * cols;
        float* dxr = dx + r * cols;
        float s = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += log ? dyr[j] : dyr[j] * yr[j];
        s = block_sum(s);
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            dxr[j] = log ? dyr[j] - expf(yr[j]) * s : yr[j] * (dyr[j] - s);
        }
    }
}

// Chunk j of the gradient below from its logits x: d_e = scale·(2^((x_e − shift)·log₂e − offset) −
// [j + e = t]).
__device__ __forceinline__ void gradient_chunk(float (&d)[4], const float (&x)[4], i64 j, i64 t, float scale,
                                               float shift, float offset) {
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = exp2_ftz(fmaf(x[e] - shift, LOG2E, -offset));
    if ((unsigned long long)(t - j) < 4ull) {  // the target's chunk
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] -= j + e == t ? 1.0f : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] *= scale;
}

// d/dlogits_j (lse − logits_t) = softmax_j − [j = t]:  dr_j = scale·(e^(xr_j − lse) − [j = t]),
// the exponential as 2^((xr_j − shift)·log₂e − offset) with lse = shift + offset·ln 2 (the
// row's maximum and log₂ of its sum, or lse and 0), and dr16_j = dr_j rounded to nearest even
// when dr16 is not null. xr and dr are f32 or bf16 (dr stored in its own type). dr may be xr
// (the gradient written over the logits): each thread reads only the chunks it writes,
// ROW_CHUNKS chunks' loads before their stores.
template <bool QUADS, typename X, typename D>
__device__ void softmax_minus_onehot(const X* xr, float shift, float offset, i64 t, float scale, i64 cols, D* dr,
                                     bf16_t* dr16) {
    const i64 step = 4 * (i64)blockDim.x;
    i64 j = 4 * (i64)threadIdx.x;
    for (; j + (ROW_CHUNKS - 1) * step < cols; j += ROW_CHUNKS * step) {
        float x[ROW_CHUNKS][4];
#pragma unroll
        for (int k = 0; k < ROW_CHUNKS; ++k) load_chunk(x[k], xr, j + k * step, cols, QUADS);
#pragma unroll
        for (int k = 0; k < ROW_CHUNKS; ++k) {
            float d[4];
            gradient_chunk(d, x[k], j + k * step, t, scale, shift, offset);
            store_chunk(dr, d, j + k * step, cols, QUADS);
            if (dr16) store_chunk(dr16, d, j + k * step, cols, QUADS);
        }
    }
    for (; j < cols; j += step) {
        float x[4], d[4];
        load_chunk(x, xr, j, cols, QUADS);
        gradient_chunk(d, x, j, t, scale, shift, offset);
        store_chunk(dr, d, j, cols, QUADS);
        if (dr16) store_chunk(dr16, d, j, cols, QUADS);
    }
}

// A row whose gradient is zero (ignored, or a target ≥ cols), and its bf16 copy.
template <typename D>
__device__ void zero_row(i64 cols, D* dr, bf16_t* dr16) {
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        store_as(dr + j, 0.0f);
        if (dr16) dr16[j] = f32_to_bf16(0.0f);
    }
}

// Per row: lse = log Σ e^logits; loss = lse − logits[t], or 0 when t == ignore (ignore < 0:
// none). counters[0] counts rows not ignored; counters[1] counts targets ≥ cols (their loss
// is NaN and their logits are not read).
template <bool QUADS>
__device__ __forceinline__ void cross_entropy_forward_rows(const float* logits, const unsigned int* targets,
                                                           i64 rows, i64 cols, i64 ignore, float* losses,
                                                           float* lse, unsigned int* counters) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = logits + r * cols;
        const RowMaxSum row = row_max_sum<QUADS>(xr, cols);
        const float l = row.m + logf(row.s);
        if (threadIdx.x == 0) {
            i64 t = (i64)targets[r];
            lse[r] = l;
            if (t == ignore) {
                losses[r] = 0.0f;
            } else if (t >= cols) {
                losses[r] = __int_as_float(0x7fc00000);
                atomicAdd(&counters[1], 1u);
            } else {
                losses[r] = l - xr[t];
                atomicAdd(&counters[0], 1u);
            }
        }
    }
}

extern "C" __global__ void cross_entropy_forward(const float* logits, const unsigned int* targets, i64 rows,
                                                 i64 cols, i64 ignore, float* losses, float* lse,
                                                 unsigned int* counters) {
    if (quad_rows(logits, cols)) {
        cross_entropy_forward_rows<true>(logits, targets, rows, cols, ignore, losses, lse, counters);
    } else {
        cross_entropy_forward_rows<false>(logits, targets, rows, cols, ignore, losses, lse, counters);
    }
}

// dlogits[r] = scale·(softmax − onehot) for rows not ignored, zeros for ignored rows (and
// rows with a target ≥ cols), with scale = upstream[0] / count: the mean loss's gradient,
// read here so the host never waits. dlogits_bf16 (when not null) gets dlogits rounded to
// nearest even, for the LM head's backward products.
template <bool QUADS>
__device__ __forceinline__ void cross_entropy_backward_rows(const float* logits, const unsigned int* targets,
                                                            const float* lse, i64 rows, i64 cols, i64 ignore,
                                                            float scale, float* dlogits, bf16_t* dlogits_bf16) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 t = (i64)targets[r];
        float* dr = dlogits + r * cols;
        bf16_t* dr16 = dlogits_bf16 ? dlogits_bf16 + r * cols : nullptr;
        if (t == ignore || t >= cols) {  // uniform across the block
            zero_row(cols, dr, dr16);
            continue;
        }
        softmax_minus_onehot<QUADS>(logits + r * cols, lse[r], 0.0f, t, scale, cols, dr, dr16);
    }
}

extern "C" __global__ void cross_entropy_backward(const float* logits, const unsigned int* targets,
                                                  const float* lse, i64 rows, i64 cols, i64 ignore,
                                                  const float* upstream, float count, float* dlogits,
                                                  bf16_t* dlogits_bf16) {
    const float scale = count > 0.0f ? upstream[0] / count : 0.0f;
    if (quad_rows(logits, cols) && quad_rows(dlogits, cols) && quad_rows(dlogits_bf16, cols)) {
        cross_entropy_backward_rows<true>(logits, targets, lse, rows, cols, ignore, scale, dlogits, dlogits_bf16);
    } else {
        cross_entropy_backward_rows<false>(logits, targets, lse, rows, cols, ignore, scale, dlogits, dlogits_bf16);
    }
}

// The forward and the backward of a row in one visit, the gradient written over the logits
// in their own element type (the LM head's chunked loss: Tensor::linear_cross_entropy):
// losses[r] as cross_entropy_forward writes it (0 for ignored rows and rows with a target ≥
// cols, which the caller has refused), then, when grad is not 0, logits[r] =
// scale·(softmax − onehot) as cross_entropy_backward writes dlogits, rounded to nearest even
// for bf16 logits (a bf16 product's output under bf16 products, as autocast stores it; the
// gradient's readers are the two bf16 products). grad = 0 leaves the logits as they are
// (evaluation). No lse is kept: nothing reads it. Each thread reads only the elements of a row
// it writes, after the row's barriers. Two reads of a row and one write, where a max, a sum
// and the gradient read it three times.
template <bool QUADS, typename T>
__device__ __forceinline__ void cross_entropy_rows(T* logits, const unsigned int* targets, i64 rows, i64 cols,
                                                   i64 ignore, float* losses, int grad, float scale) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T* xr = logits + r * cols;
        i64 t = (i64)targets[r];
        bool kept = t != ignore && t < cols;  // uniform across the block
        // The target's logit, read before the barriers of row_max_sum: after them the row is
        // overwritten.
        const float xt = kept ? as_f32(xr[t]) : 0.0f;
        const RowMaxSum row = row_max_sum<QUADS>(xr, cols);
        if (threadIdx.x == 0) losses[r] = kept ? row.m + logf(row.s) - xt : 0.0f;
        if (!grad) continue;
        if (kept) {
            softmax_minus_onehot<QUADS>(xr, row.m, log2f(row.s), t, scale, cols, xr, (bf16_t*)nullptr);
        } else {
            zero_row(cols, xr, (bf16_t*)nullptr);
        }
    }
}

template <typename T>
__device__ __forceinline__ void cross_entropy_any_rows(T* logits, const unsigned int* targets, i64 rows, i64 cols,
                                                       i64 ignore, float* losses, int grad, float scale) {
    if (quad_rows(logits, cols)) {
        cross_entropy_rows<true>(logits, targets, rows, cols, ignore, losses, grad, scale);
    } else {
        cross_entropy_rows<false>(logits, targets, rows, cols, ignore, losses, grad, scale);
    }
}

extern "C" __global__ void cross_entropy_forward_backward(float* logits, const unsigned int* targets, i64 rows,
                                                          i64 cols, i64 ignore, float* losses, int grad,
                                                          float scale) {
    cross_entropy_any_rows(logits, targets, rows, cols, ignore, losses, grad, scale);
}

extern "C" __global__ void cross_entropy_forward_backward_bf16(bf16_t* logits, const unsigned int* targets, i64 rows,
                                                               i64 cols, i64 ignore, float* losses, int grad,
                                                               float scale) {
    cross_entropy_any_rows(logits, targets, rows, cols, ignore, losses, grad, scale);
}
