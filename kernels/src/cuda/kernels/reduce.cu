// Reductions (cpu/reduce.rs): sums and max/argmax over one axis of x viewed as
// [outer, n, inner], the squared norm, and column sums used by the backward kernels.
// Every sum runs in a fixed order set by the launch shape (no atomics), so results repeat
// bit for bit; long sums accumulate in f64.

// out[r] = Σ_j x[r·n + j] (inner == 1): one block per row.
extern "C" __global__ void sum_rows(const float* x, i64 rows, i64 n, float* out) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * n;
        double acc = 0.0;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) acc += (double)xr[j];
        acc = block_sum_d(acc);
        if (threadIdx.x == 0) out[r] = (float)acc;
    }
}

// One chunk of one column's sum, the order every column sum uses: thread (x, y) of a
// (32, 8) block adds rows r0 + y, r0 + y + 8, ... < r1 of its column (`column` points at
// its row 0, row stride ld), then thread y = 0 adds the 8 lanes in y order into *out. Every
// thread of the block calls it (it holds two barriers); `valid` is false past the last column.
__device__ __forceinline__ void column_chunk_sum(const float* column, i64 ld, bool valid, i64 r0, i64 r1,
                                                 float (*tile)[33], float* out) {
    float acc = 0.0f;
    if (valid) {
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) acc += column[r * ld];
    }
    __syncthreads();  // a previous call's readers are done with the tile
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && valid) {
        float sum = 0.0f;
        for (int j = 0; j < 8; ++j) sum += tile[j][threadIdx.x];
        *out = sum;
    }
}

// Partial column sums of x viewed as [outer, rows, cols] (row stride ld, outer stride
// outer_stride): partial[(o·chunks + chunk)·cols + col] = Σ over the chunk's rows.
// Block (32, 8): 32 columns, 8 row lanes; grid (⌈cols/32⌉, chunks, ≤ outer).
extern "C" __global__ void column_sums_partial(const float* x, i64 outer, i64 rows, i64 cols, i64 ld,
                                               i64 outer_stride, i64 rows_per_chunk, float* partial) {
    __shared__ float tile[8][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 chunk = blockIdx.y, chunks = gridDim.y;
    i64 r0 = chunk * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    for (i64 o = blockIdx.z; o < outer; o += gridDim.z) {
        column_chunk_sum(x + o * outer_stride + col, ld, col < cols, r0, r1, tile,
                         partial + (o * chunks + chunk) * cols + col);
    }
}

// dst[o·cols + col] = Σ_chunk partial[(o·chunks + chunk)·cols + col], in chunk order, f64.
// Block (32, ≤ FINISH_CHUNKS) per 32 columns (chunk_total); grid (⌈cols/32⌉, ≤ outer).
extern "C" __global__ void column_sums_finish(const float* partial, i64 outer, i64 chunks, i64 cols, float* dst) {
    __shared__ float tile[FINISH_CHUNKS][32];
    const i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
        const float* column = partial + o * chunks * cols + col;
        float total = chunk_total(chunks, col < cols, tile, [&](i64 chunk) { return column[chunk * cols]; });
        if (threadIdx.y == 0 && col < cols) dst[o * cols + col] = total;
    }
}

// Several column sums in one launch (the fused gate's bias, α and B gradients, from its row
// kernel's block terms, and a residual RMSNorm's weight gradient from its lane partials): sum
// s reads rows_of.v[s] rows of srcs.v[s] (cols.v[s] columns, row stride lds.v[s]) in chunks of
// per_chunk_of.v[s] rows, dsts.v[s][col] = Σ_r src[r·ld + col]. Grid (Σ_s ⌈cols/32⌉, the most
// chunks of any sum): sum s has the blocks from first_block.v[s] on, one per 32 of its own
// columns; a block past its sum's chunks only counts itself in. Each block
// writes one chunk's sums of its 32 columns, partial[partial_at.v[s] + chunk·cols + col]; the
// last of the chunks' blocks of a column block (last_block_to_arrive on arrivals[blockIdx.x])
// adds its columns' chunks in order in f64 (chunk_total: column_sums_finish's additions, so
// each sum has column_sums' bits), with the whole parallelism of a separate finish kernel's
// block and no second launch.
extern "C" __global__ void column_sums_many(TensorList srcs, TensorList cols_of, TensorList lds,
                                            TensorList first_block, i64 count, TensorList rows_of,
                                            TensorList per_chunk_of, TensorList partial_at, float* partial,
                                            TensorList dsts, unsigned int* arrivals) {
    __shared__ float tile[8][33];
    __shared__ float finish[8][32];  // chunk_total's tile: 8 chunks side by side (the block's rows)
    const int s = list_entry_of_block(first_block, count);
    const i64 cols = cols_of.v[s], ld = lds.v[s], rows = rows_of.v[s], rows_per_chunk = per_chunk_of.v[s];
    const i64 col = ((i64)blockIdx.x - first_block.v[s]) * 32 + threadIdx.x;
    const bool valid = col < cols;
    const i64 chunk = blockIdx.y;
    const i64 chunks = rows > rows_per_chunk ? (rows + rows_per_chunk - 1) / rows_per_chunk : 1;
    if (chunk < chunks) {  // block-uniform
        const i64 r0 = chunk * rows_per_chunk;
        const i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
        column_chunk_sum((const float*)srcs.v[s] + col, ld, valid, r0, r1, tile,
                         partial + partial_at.v[s] + chunk * cols + col);
    }
    if (!last_block_to_arrive(arrivals + blockIdx.x, gridDim.y)) return;
    const volatile float* totals = partial + partial_at.v[s] + col;
    const float total = chunk_total(chunks, valid, finish, [&](i64 c) { return totals[c * cols]; });
    if (threadIdx.y == 0 && valid) ((float*)dsts.v[s])[col] = total;
}

// Whether (v, i) beats (best, bi): NaN beats numbers, larger beats smaller, and among
// equals the lower index wins — so the reduction finds the first maximum, or the first NaN.
__device__ __forceinline__ bool beats(float v, i64 i, float best, i64 bi) {
    bool vn = is_nan(v), bn = is_nan(best);
    if (vn || bn) return (vn && bn) ? i < bi : vn;
    if (v != best) return v > best;
    return i < bi;
}

// max and first argmax of each row (inner == 1): one block per row.
extern "C" __global__ void max_rows(const float* x, i64 rows, i64 n, float* out, unsigned int* argmax) {
    __shared__ float best_v[32];
    __shared__ i64 best_i[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * n;
        float best = NEG_INF;
        i64 bi = n;  // a sentinel that loses every tie with a real index
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            if (beats(xr[j], j, best, bi)) {
                best = xr[j];
                bi = j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, best, o);
            i64 oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (beats(ov, oi, best, bi)) {
                best = ov;
                bi = oi;
            }
        }
        __syncthreads();  // the previous row's final read is done
        if (lane == 0) {
            best_v[warp] = best;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            best = lane < warps ? best_v[lane] : NEG_INF;
            bi = lane < warps ? best_i[lane] : n;
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(FULL_MASK, best, o);
                i64 oi = __shfl_xor_sync(FULL_MASK, bi, o);
                if (beats(ov, oi, best, bi)) {
                    best = ov;
                    bi = oi;
                }
            }
            if (lane == 0) {
                out[r] = xr[bi];
                argmax[r] = (unsigned int)bi;
            }
        }
    }
}

// max and first argmax over j of x[(o·n + j)·inner + i] (inner > 1): one thread per (o, i),
// the same update rule as the CPU loop.
extern "C" __global__ void max_inner(const float* x, i64 outer, i64 n, i64 inner, float* out,
                                     unsigned int* argmax) {
    GRID_STRIDE(t, outer * inner) {
        i64 o = t / inner, i = t % inner;
        const float* base = x + o * n * inner + i;
        float best = base[0];
        i64 bi = 0;
        for (i64 j = 1; j < n; ++j) {
            float v = base[j * inner];
            if (v > best || (is_nan(v) && !is_nan(best))) {
                best = v;
                bi = j;
            }
        }
        out[t] = best;
        argmax[t] = (unsigned int)bi;
    }
}

// Σ x_t[i]² partials of up to TABLE_LEN tensors in one launch, in f64: tensor t has the
// blocks from first_block.v[t] on (list_entry_of_block), a grid-stride loop of its own over
// its lens.v[t] elements, and each block writes its partial to partial[blockIdx.x].
extern "C" __global__ void sum_squares_partial(TensorTable xs, TensorTable lens, TensorTable first_block, i64 count,
                                               double* partial) {
    const int t = list_entry_of_block(first_block, count);
    const float* x = (const float*)xs.v[t];
    const i64 n = lens.v[t];
    const i64 stride = list_entry_blocks(first_block, count, t) * blockDim.x;
    double acc = 0.0;
    for (i64 i = ((i64)blockIdx.x - first_block.v[t]) * blockDim.x + threadIdx.x; i < n; i += stride) {
        double v = (double)x[i];
        acc += v * v;
    }
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
