// Softmax, log-softmax (cpu/softmax.rs) and the fused cross-entropy (cpu/cross_entropy.rs)
// over rows of `cols`: one block per row, the row read from global memory once per pass.
// Backward kernels write their gradients, dx = ... (not added: kernels/src/lib.rs).

// A row's maximum m and Σ_j e^(xr_j − m); every thread of the block gets both. The row is f32
// or bf16 (the LM head's logits under bf16 products), summed as its f32 values.
struct RowMaxSum {
    float m, s;
};

template <typename T>
__device__ RowMaxSum row_max_sum(const T* xr, i64 cols) {
    float m = NEG_INF;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, as_f32(xr[j]));
    m = block_max(m);
    float s = 0.0f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += expf(as_f32(xr[j]) - m);
    s = block_sum(s);
    return RowMaxSum{m, s};
}

// y = softmax(x) (log = 0) or log_softmax(x) (log = 1) of each row.
extern "C" __global__ void softmax_forward(const float* x, float* y, i64 rows, i64 cols, int log) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        const RowMaxSum row = row_max_sum(xr, cols);
        const float m = row.m, s = row.s;
        if (log) {
            float log_total = m + logf(s);
            for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = xr[j] - log_total;
        } else {
            float inv = 1.0f / s;
            for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
        }
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

// log Σ_j e^(xr_j) of one row, shifted by its maximum; every thread of the block gets it.
template <typename T>
__device__ float row_lse(const T* xr, i64 cols) {
    const RowMaxSum row = row_max_sum(xr, cols);
    return row.m + logf(row.s);
}

// d/dlogits_j (lse − logits_t) = softmax_j − [j = t]:  dr_j = scale·(e^(xr_j − lse) − [j = t]),
// and dr16_j = dr_j rounded to nearest even when dr16 is not null. xr and dr are f32 or bf16
// (dr stored in its own type: store_as). dr may be xr (the gradient written over the logits):
// each thread reads only the elements it writes.
template <typename X, typename D>
__device__ void softmax_minus_onehot(const X* xr, float lse, i64 t, float scale, i64 cols, D* dr, bf16_t* dr16) {
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float p = expf(as_f32(xr[j]) - lse);
        float d = scale * (j == t ? p - 1.0f : p);
        store_as(dr + j, d);
        if (dr16) dr16[j] = f32_to_bf16(d);
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
extern "C" __global__ void cross_entropy_forward(const float* logits, const unsigned int* targets, i64 rows,
                                                 i64 cols, i64 ignore, float* losses, float* lse,
                                                 unsigned int* counters) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = logits + r * cols;
        float l = row_lse(xr, cols);
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

// dlogits[r] = scale·(softmax − onehot) for rows not ignored, zeros for ignored rows (and
// rows with a target ≥ cols), with scale = upstream[0] / count: the mean loss's gradient,
// read here so the host never waits. dlogits_bf16 (when not null) gets dlogits rounded to
// nearest even, for the LM head's backward products.
extern "C" __global__ void cross_entropy_backward(const float* logits, const unsigned int* targets,
                                                  const float* lse, i64 rows, i64 cols, i64 ignore,
                                                  const float* upstream, float count, float* dlogits,
                                                  bf16_t* dlogits_bf16) {
    const float scale = count > 0.0f ? upstream[0] / count : 0.0f;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 t = (i64)targets[r];
        float* dr = dlogits + r * cols;
        bf16_t* dr16 = dlogits_bf16 ? dlogits_bf16 + r * cols : nullptr;
        if (t == ignore || t >= cols) {  // uniform across the block
            zero_row(cols, dr, dr16);
            continue;
        }
        softmax_minus_onehot(logits + r * cols, lse[r], t, scale, cols, dr, dr16);
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
// it writes, after the row's barriers.
template <typename T>
__device__ __forceinline__ void cross_entropy_rows(T* logits, const unsigned int* targets, i64 rows, i64 cols,
                                                   i64 ignore, float* losses, int grad, float scale) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T* xr = logits + r * cols;
        i64 t = (i64)targets[r];
        bool kept = t != ignore && t < cols;  // uniform across the block
        // The target's logit, read before the barriers of row_lse: after them the row is
        // overwritten.
        float xt = kept ? as_f32(xr[t]) : 0.0f;
        float l = row_lse(xr, cols);
        if (threadIdx.x == 0) losses[r] = kept ? l - xt : 0.0f;
        if (!grad) continue;
        if (kept) {
            softmax_minus_onehot(xr, l, t, scale, cols, xr, nullptr);
        } else {
            zero_row(cols, xr, nullptr);
        }
    }
}

extern "C" __global__ void cross_entropy_forward_backward(float* logits, const unsigned int* targets, i64 rows,
                                                          i64 cols, i64 ignore, float* losses, int grad,
                                                          float scale) {
    cross_entropy_rows(logits, targets, rows, cols, ignore, losses, grad, scale);
}

extern "C" __global__ void cross_entropy_forward_backward_bf16(bf16_t* logits, const unsigned int* targets, i64 rows,
                                                               i64 cols, i64 ignore, float* losses, int grad,
                                                               float scale) {
    cross_entropy_rows(logits, targets, rows, cols, ignore, losses, grad, scale);
}
