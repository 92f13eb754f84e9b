// RMSNorm and LayerNorm over the last axis (cpu/norm.rs): x is [N, C]. RMSNorm gives each
// row one warp (common.cuh's warp_rms_norm_row: 8 rows a block of 256 threads, no block
// barrier per row), LayerNorm one block. The forward saves rstd (and mean) per row; the
// backward writes dx = ... per row (gradients are written, not added: kernels/src/lib.rs). The
// weight/bias gradients are column sums over rows in a fixed order (no atomics): LayerNorm's
// come from norm_param_grads_partial, finished by reduce.cu's column_sums_finish; RMSNorm's
// backward writes the same partial sums itself, finished by rms_norm_weight_grad_finish (same
// order, same bits). The rows' forward ends are common.cuh's warp_rms_norm_row and
// warp_add_rms_norm_row, which the fused gate's residual add and norm (fused_gate.cu) shares.

// Row lanes of a chunk of rows in the norms' column sums (NORM_ROW_LANES, common.cuh): lane l
// holds rows r0 + l, r0 + l + 8, ... of the chunk (norm_param_grads_partial's blockDim.y; the
// warps of an RMSNorm backward block).
//
// The RMSNorm row kernels (NORM_ROW_LANES warps a block) ask for 2 blocks (16 warps) an SM, at
// most 128 registers a thread (their __launch_bounds__): ptxas's free choice took
// add_rms_norm_forward to 129 (one block, 8 warps).

// Rows r, r + gridDim.x·8, ... for warp w of the RMSNorm row kernels' blocks: r = blockIdx.x·8 + w.
#define NORM_WARP_ROWS(r, rows) \
    for (i64 r = (i64)blockIdx.x * NORM_ROW_LANES + (threadIdx.x >> 5); r < (rows); r += (i64)gridDim.x * NORM_ROW_LANES)

// y = x·rstd·w, rstd = 1/√(mean(x²) + eps)
// y_bf16 (when not null) gets y rounded to nearest even, for the bf16 products reading y; y
// may then be null (y in bf16 alone).
extern "C" __global__ void __launch_bounds__(NORM_ROW_LANES * 32, 2)
    rms_norm_forward(const float* x, const float* w, float* y, bf16_t* y_bf16, float* rstd, i64 rows, i64 cols,
                     float eps) {
    const bool quads = (cols & 3) == 0 && is_aligned(x, 16) && is_aligned(w, 16) && is_aligned(y, 16) &&
                       is_aligned(y_bf16, 8);
    NORM_WARP_ROWS(r, rows) {
        const float* xr = x + r * cols;
        const auto in = [&](i64 j, float (&v)[4]) { load_chunk(v, xr, j, cols, quads); };
        warp_rms_norm_row(in, nullptr, xr, w, y ? y + r * cols : nullptr, y_bf16 ? y_bf16 + r * cols : nullptr,
                          rstd + r, cols, eps, quads);
    }
}

// The pre-ln LLaMA block's residual add and the next RMSNorm in one pass, a warp per row
// (warp_add_rms_norm_row, common.cuh). delta is f32, or (the _delta_bf16 kernel) bf16: the
// sublayer's output projection, stored so under bf16 products as autocast stores a product,
// added to the f32 stream as its widened values.
template <typename Delta>
__device__ __forceinline__ void add_rms_norm_rows(const float* x, const Delta* delta, const float* w, float* sum,
                                                  float* y, bf16_t* y_bf16, float* rstd, i64 rows, i64 cols,
                                                  float eps) {
    const bool quads = (cols & 3) == 0 && is_aligned(x, 16) && is_aligned(delta, 4 * sizeof(Delta)) &&
                       is_aligned(w, 16) && is_aligned(sum, 16) && is_aligned(y, 16) && is_aligned(y_bf16, 8);
    NORM_WARP_ROWS(r, rows) {
        const Delta* dr = delta + r * cols;
        const auto delta_at = [&](i64 j, float (&d)[4]) { load_chunk(d, dr, j, cols, quads); };
        warp_add_rms_norm_row(x + r * cols, delta_at, w, sum + r * cols, y ? y + r * cols : nullptr,
                              y_bf16 ? y_bf16 + r * cols : nullptr, rstd + r, cols, eps, quads);
    }
}

extern "C" __global__ void __launch_bounds__(NORM_ROW_LANES * 32, 2)
    add_rms_norm_forward(const float* x, const float* delta, const float* w, float* sum, float* y, bf16_t* y_bf16,
                         float* rstd, i64 rows, i64 cols, float eps) {
    add_rms_norm_rows(x, delta, w, sum, y, y_bf16, rstd, rows, cols, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_ROW_LANES * 32, 2)
    add_rms_norm_forward_delta_bf16(const float* x, const bf16_t* delta, const float* w, float* sum, float* y,
                                    bf16_t* y_bf16, float* rstd, i64 rows, i64 cols, float eps) {
    add_rms_norm_rows(x, delta, w, sum, y, y_bf16, rstd, rows, cols, eps);
}

// With g = dy ⊙ w:  d/dx_j = r·g_j − x_j·r³·(Σ_k g_k x_k)/C
// residual (when not null) is the gradient already reaching x by another path (a pre-ln block's
// residual stream): dx is then residual + d/dx. dx_bf16 (when not null) gets dx rounded to
// nearest even, for the bf16 products reading it.
// The weight's gradient d/dw_j = Σ_rows dy_j·x̂_j (x̂ = x·r) comes from the same pass, in
// norm_param_grads_partial's order: the rows are cut into chunks of rows_per_chunk and each
// chunk into NORM_ROW_LANES lanes; block `chunk` has a warp per lane, which walks its lane's rows
// in order (a row at a time, as warp_rms_norm_row: Σ_k g_k x_k in its order of columns) and
// adds its columns' dy·x̂ into its lane's partial row lane_partial_w[(chunk·NORM_ROW_LANES +
// lane)·cols + j]: in registers for a lane's first ROW_QUADS chunks, written once at the end,
// and in place past them (no other thread touches them: no atomics, no barrier).
// rms_norm_weight_grad_finish adds them up. lane_partial_w null: no weight gradient. dy is
// f32, or (the _dy_bf16 kernel) bf16: the input gradient of the bf16 products that read y,
// stored so under bf16 products.
template <typename Dy>
__device__ __forceinline__ void rms_norm_backward_rows(const float* x, const float* w, const float* rstd, const Dy* dy,
                                                       const float* residual, float* dx, bf16_t* dx_bf16, i64 rows,
                                                       i64 cols, i64 rows_per_chunk, float* lane_partial_w) {
    const int lane = threadIdx.x & 31, row_lane = threadIdx.x >> 5;
    const i64 chunk = blockIdx.x;
    const i64 r0 = chunk * rows_per_chunk;
    const i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    const bool quads = (cols & 3) == 0 && is_aligned(x, 16) && is_aligned(w, 16) &&
                       is_aligned(dy, 4 * sizeof(Dy)) && is_aligned(residual, 16) && is_aligned(dx, 16) &&
                       is_aligned(dx_bf16, 8) && is_aligned(lane_partial_w, 16);
    float* dw_lane = lane_partial_w ? lane_partial_w + (chunk * NORM_ROW_LANES + row_lane) * cols : nullptr;
    const float zeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (dw_lane) {
        for (i64 j = 4 * (lane + 32 * ROW_QUADS); j < cols; j += 128) store_chunk(dw_lane, zeros, j, cols, quads);
    }
    float dw_kept[ROW_QUADS][4];
#pragma unroll
    for (int k = 0; k < ROW_QUADS; ++k) dw_kept[k][0] = dw_kept[k][1] = dw_kept[k][2] = dw_kept[k][3] = 0.0f;

    for (i64 r = r0 + row_lane; r < r1; r += NORM_ROW_LANES) {
        const float* xr = x + r * cols;
        const Dy* dyr = dy + r * cols;
        const float rs = rstd[r];
        // Σ_k g_k x_k over the lane's chunks in order, then over the warp.
        float gx = 0.0f;
        const auto dot = [&](i64 j) {
            float xj[4], dyj[4], wj[4];
            load_chunk(xj, xr, j, cols, quads);
            load_chunk(dyj, dyr, j, cols, quads);
            load_chunk(wj, w, j, cols, quads);
            for (int e = 0; e < 4; ++e) gx += dyj[e] * wj[e] * xj[e];
        };
#pragma unroll
        for (int k = 0; k < ROW_QUADS; ++k) {
            const i64 j = 4 * (lane + 32 * k);
            if (j < cols) dot(j);
        }
        for (i64 j = 4 * (lane + 32 * ROW_QUADS); j < cols; j += 128) dot(j);
        gx = warp_sum(gx);
        const float c = rs * rs * rs * gx / (float)cols;
        // dx and the weight's partial sums: every register chunk's loads (x, dy and w again, the
        // lane's own reads of a moment ago, and the residual) before the first store of dx.
        const auto grad = [&](i64 j, float (&g)[4], float (&dw)[4]) {
            float xj[4], dyj[4], wj[4];
            load_chunk(xj, xr, j, cols, quads);
            load_chunk(dyj, dyr, j, cols, quads);
            load_chunk(wj, w, j, cols, quads);
            for (int e = 0; e < 4; ++e) g[e] = dyj[e] * wj[e] * rs - xj[e] * c;
            if (residual) {
                float res[4];
                load_chunk(res, residual + r * cols, j, cols, quads);
                for (int e = 0; e < 4; ++e) g[e] = res[e] + g[e];
            }
            if (dw_lane) {
                for (int e = 0; e < 4; ++e) dw[e] += dyj[e] * xj[e] * rs;
            }
        };
        const auto out = [&](i64 j, const float (&g)[4]) {
            store_chunk(dx + r * cols, g, j, cols, quads);
            if (dx_bf16) store_chunk(dx_bf16 + r * cols, g, j, cols, quads);
        };
        float grads[ROW_QUADS][4];
#pragma unroll
        for (int k = 0; k < ROW_QUADS; ++k) {
            const i64 j = 4 * (lane + 32 * k);
            if (j < cols) grad(j, grads[k], dw_kept[k]);
        }
#pragma unroll
        for (int k = 0; k < ROW_QUADS; ++k) {
            const i64 j = 4 * (lane + 32 * k);
            if (j < cols) out(j, grads[k]);
        }
        for (i64 j = 4 * (lane + 32 * ROW_QUADS); j < cols; j += 128) {
            float gj[4], dw[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (dw_lane) load_chunk(dw, dw_lane, j, cols, quads);
            grad(j, gj, dw);
            out(j, gj);
            if (dw_lane) store_chunk(dw_lane, dw, j, cols, quads);
        }
    }
    if (dw_lane) {
#pragma unroll
        for (int k = 0; k < ROW_QUADS; ++k) {
            const i64 j = 4 * (lane + 32 * k);
            if (j < cols) store_chunk(dw_lane, dw_kept[k], j, cols, quads);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_ROW_LANES * 32, 2)
    rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy, const float* residual,
                      float* dx, bf16_t* dx_bf16, i64 rows, i64 cols, i64 rows_per_chunk, float* lane_partial_w) {
    rms_norm_backward_rows(x, w, rstd, dy, residual, dx, dx_bf16, rows, cols, rows_per_chunk, lane_partial_w);
}

extern "C" __global__ void __launch_bounds__(NORM_ROW_LANES * 32, 2)
    rms_norm_backward_dy_bf16(const float* x, const float* w, const float* rstd, const bf16_t* dy,
                              const float* residual, float* dx, bf16_t* dx_bf16, i64 rows, i64 cols, i64 rows_per_chunk,
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
