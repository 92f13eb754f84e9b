// RMSNorm and LayerNorm over the last axis (cpu/norm.rs): x is [N, C], one block per row.
// The forward saves rstd (and mean) per row; the backward writes dx = ... per row (gradients
// are written, not added: kernels/src/lib.rs). The weight/bias gradients are column sums over
// rows in a fixed order (no atomics): LayerNorm's come from norm_param_grads_partial, finished
// by reduce.cu's column_sums_finish; RMSNorm's backward writes the same partial sums itself,
// finished by rms_norm_weight_grad_finish (same order, same bits). The rows' forward ends are
// common.cuh's rms_norm_row and add_rms_norm_row, which the fused gate's residual add and norm
// (fused_gate.cu) shares.

// Row lanes of a chunk of rows in the norms' column sums: lane l holds rows r0 + l, r0 + l + 8,
// ... of the chunk (norm_param_grads_partial's blockDim.y).
#define NORM_ROW_LANES 8

// y = x·rstd·w, rstd = 1/√(mean(x²) + eps)
// y_bf16 (when not null) gets y rounded to nearest even, for the bf16 products reading y; y
// may then be null (y in bf16 alone).
extern "C" __global__ void rms_norm_forward(const float* x, const float* w, float* y, bf16_t* y_bf16, float* rstd,
                                            i64 rows, i64 cols, float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float ss = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) ss += xr[j] * xr[j];
        rms_norm_row(xr, ss, w, y ? y + r * cols : nullptr, y_bf16 ? y_bf16 + r * cols : nullptr, rstd + r, cols, eps);
    }
}

// The pre-ln LLaMA block's residual add and the next RMSNorm in one pass, a row at a time
// (add_rms_norm_row, common.cuh). delta is f32, or (the _delta_bf16 kernel) bf16: the
// sublayer's output projection, stored so under bf16 products as autocast stores a product,
// added to the f32 stream as its widened values.
template <typename Delta>
__device__ __forceinline__ void add_rms_norm_rows(const float* x, const Delta* delta, const float* w, float* sum,
                                                  float* y, bf16_t* y_bf16, float* rstd, i64 rows, i64 cols,
                                                  float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Delta* dr = delta + r * cols;
        add_rms_norm_row(x + r * cols, [&](i64 j) { return as_f32(dr[j]); }, w, sum + r * cols,
                         y ? y + r * cols : nullptr, y_bf16 ? y_bf16 + r * cols : nullptr, rstd + r, cols, eps);
    }
}

extern "C" __global__ void add_rms_norm_forward(const float* x, const float* delta, const float* w, float* sum,
                                                float* y, bf16_t* y_bf16, float* rstd, i64 rows, i64 cols,
                                                float eps) {
    add_rms_norm_rows(x, delta, w, sum, y, y_bf16, rstd, rows, cols, eps);
}

extern "C" __global__ void add_rms_norm_forward_delta_bf16(const float* x, const bf16_t* delta, const float* w,
                                                           float* sum, float* y, bf16_t* y_bf16, float* rstd, i64 rows,
                                                           i64 cols, float eps) {
    add_rms_norm_rows(x, delta, w, sum, y, y_bf16, rstd, rows, cols, eps);
}

// With g = dy ⊙ w:  d/dx_j = r·g_j − x_j·r³·(Σ_k g_k x_k)/C
// residual (when not null) is the gradient already reaching x by another path (a pre-ln block's
// residual stream): dx is then residual + d/dx. dx_bf16 (when not null) gets dx rounded to
// nearest even, for the bf16 products reading it.
// The weight's gradient d/dw_j = Σ_rows dy_j·x̂_j (x̂ = x·r) comes from the same pass, in
// norm_param_grads_partial's order: the rows are cut into chunks of rows_per_chunk and each
// chunk into NORM_ROW_LANES lanes; block (lane, chunk) walks its lane's rows in order (one row
// at a time, the whole block on it, as one block per row would) and each thread adds its
// columns' dy·x̂ into its own elements of lane_partial_w[(chunk·NORM_ROW_LANES + lane)·cols + j]
// (no other thread touches them: no atomics, no barrier). rms_norm_weight_grad_finish adds
// them up. lane_partial_w null: no weight gradient. dy is f32, or (the _dy_bf16 kernel) bf16:
// the input gradient of the bf16 products that read y, stored so under bf16 products.
template <typename Dy>
__device__ __forceinline__ void rms_norm_backward_rows(const float* x, const float* w, const float* rstd, const Dy* dy,
                                                       const float* residual, float* dx, bf16_t* dx_bf16, i64 rows,
                                                       i64 cols, i64 rows_per_chunk, float* lane_partial_w) {
    const i64 lane = blockIdx.x, chunk = blockIdx.y;
    const i64 r0 = chunk * rows_per_chunk;
    const i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float* dw_lane = lane_partial_w ? lane_partial_w + (chunk * NORM_ROW_LANES + lane) * cols : nullptr;
    if (dw_lane) {
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) dw_lane[j] = 0.0f;
    }
    for (i64 r = r0 + lane; r < r1; r += NORM_ROW_LANES) {
        const float* xr = x + r * cols;
        const Dy* dyr = dy + r * cols;
        float* dxr = dx + r * cols;
        float rs = rstd[r];
        float gx = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) gx += as_f32(dyr[j]) * w[j] * xr[j];
        gx = block_sum(gx);
        float c = rs * rs * rs * gx / (float)cols;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const float dyj = as_f32(dyr[j]);
            float g = dyj * w[j] * rs - xr[j] * c;
            if (residual) g = residual[r * cols + j] + g;
            dxr[j] = g;
            if (dx_bf16) dx_bf16[r * cols + j] = f32_to_bf16(g);
            if (dw_lane) dw_lane[j] += dyj * xr[j] * rs;
        }
    }
}

extern "C" __global__ void rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy,
                                             const float* residual, float* dx, bf16_t* dx_bf16, i64 rows, i64 cols,
                                             i64 rows_per_chunk, float* lane_partial_w) {
    rms_norm_backward_rows(x, w, rstd, dy, residual, dx, dx_bf16, rows, cols, rows_per_chunk, lane_partial_w);
}

extern "C" __global__ void rms_norm_backward_dy_bf16(const float* x, const float* w, const float* rstd,
                                                     const bf16_t* dy, const float* residual, float* dx,
                                                     bf16_t* dx_bf16, i64 rows, i64 cols, i64 rows_per_chunk,
                                                     float* lane_partial_w) {
    rms_norm_backward_rows(x, w, rstd, dy, residual, dx, dx_bf16, rows, cols, rows_per_chunk, lane_partial_w);
}

// dw[j] = Σ_chunk (Σ_lane lane_partial_w[(chunk·NORM_ROW_LANES + lane)·cols + j]): the lanes of a
// chunk in order in f32, then the chunks in order in f64 (chunk_total, common.cuh), as
// norm_param_grads_partial and column_sums_finish add them. Block (32, ≤ FINISH_CHUNKS) per 32
// columns.
extern "C" __global__ void rms_norm_weight_grad_finish(const float* lane_partial_w, i64 chunks, i64 cols,
                                                       float* dw) {
    __shared__ float tile[FINISH_CHUNKS][32];
    const i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    const float total = chunk_total(chunks, j < cols, tile, [&](i64 chunk) {
        float sum = 0.0f;
        for (int lane = 0; lane < NORM_ROW_LANES; ++lane) {
            sum += lane_partial_w[(chunk * NORM_ROW_LANES + lane) * cols + j];
        }
        return sum;
    });
    if (threadIdx.y == 0 && j < cols) dw[j] = total;
}

// y = (x − mean)·rstd (·w + b when given); mean and rstd saved per row. Two passes: the
// centred sum of squares does not cancel the way Σx² − C·mean² does.
extern "C" __global__ void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                                              float* rstd, i64 rows, i64 cols, float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        float s = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
        float mu = block_sum(s) / (float)cols;
        float ss = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            float d = xr[j] - mu;
            ss += d * d;
        }
        ss = block_sum(ss);
        float rs = 1.0f / sqrtf(ss / (float)cols + eps);
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            float v = (xr[j] - mu) * rs;
            if (w) v *= w[j];
            if (b) v += b[j];
            yr[j] = v;
        }
        if (threadIdx.x == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

// With x̂ = (x − mean)·r and g = dy ⊙ w:  d/dx_j = r·(g_j − mean(g) − x̂_j·mean(g ⊙ x̂))
extern "C" __global__ void layer_norm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                                               const float* dy, float* dx, i64 rows, i64 cols) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        const float* dyr = dy + r * cols;
        float* dxr = dx + r * cols;
        float mu = mean[r], rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            float g = w ? dyr[j] * w[j] : dyr[j];
            sg += g;
            sgx += g * (xr[j] - mu) * rs;
        }
        float mean_g = block_sum(sg) / (float)cols;
        float mean_gx = block_sum(sgx) / (float)cols;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            float g = w ? dyr[j] * w[j] : dyr[j];
            float x_hat = (xr[j] - mu) * rs;
            dxr[j] = (g - mean_g - x_hat * mean_gx) * rs;
        }
    }
}

// LayerNorm's d/dw_j = Σ_rows dy_j·x̂_j,  d/db_j = Σ_rows dy_j,  x̂ = (x − mean)·rstd. Partial
// sums per chunk of rows: partial_w[chunk·cols + col], likewise partial_b when given. Block
// (32, NORM_ROW_LANES); grid (⌈cols/32⌉, chunks).
extern "C" __global__ void norm_param_grads_partial(const float* x, const float* dy, const float* mean,
                                                    const float* rstd, i64 rows, i64 cols, i64 rows_per_chunk,
                                                    float* partial_w, float* partial_b) {
    __shared__ float tile_w[8][33];
    __shared__ float tile_b[8][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 chunk = blockIdx.y;
    i64 r0 = chunk * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float acc_w = 0.0f, acc_b = 0.0f;
    if (col < cols) {
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
            float g = dy[r * cols + col];
            acc_w += g * (x[r * cols + col] - mean[r]) * rstd[r];
            acc_b += g;
        }
    }
    tile_w[threadIdx.y][threadIdx.x] = acc_w;
    tile_b[threadIdx.y][threadIdx.x] = acc_b;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        float sw = 0.0f, sb = 0.0f;
        for (int j = 0; j < 8; ++j) {
            sw += tile_w[j][threadIdx.x];
            sb += tile_b[j][threadIdx.x];
        }
        if (partial_w) partial_w[chunk * cols + col] = sw;
        if (partial_b) partial_b[chunk * cols + col] = sb;
    }
}
