// Causal scaled-dot-product attention, flash-style (cpu/attention.rs; Dao et al. 2022).
// q [B, Tq, H, D], k and v [B, Tk, H, D], out [B, Tq, H, D], lse [B, H, Tq]. Query i sits
// at absolute position i + (Tk − Tq) and attends keys s ≤ that position.
//
// Forward: one warp per query, QB queries (warps) per block, all of one (b, h). The block
// walks key tiles of 32: K and V rows are staged in shared memory, lane j of a warp scores
// key s0 + j, and the warp keeps an online softmax (running max m and sum l) and its
// output accumulator in registers (D ≤ 128: four dims per lane). Only lse is saved.
//
// Backward (no atomics, deterministic), two launches: dq with one warp per query walking key
// tiles, which also writes delta_i = Σ_d dO·O, then dk, dv with one warp per key walking query
// tiles; both recompute
// P = e^(scale·q·k − lse).  With S = scale·QKᵀ, P = softmax(S), O = PV:
//   d/dV = Pᵀ·dO,  d/dS = P ⊙ (dO·Vᵀ − δ),  d/dQ = scale·dS·K,  d/dK = scale·dSᵀ·Q.
//
// Shared-memory rows that a lane reads whole (lane = key or query) use an odd stride
// KS = D | 1, so the 32 lanes hit 32 different banks.

#define MAX_HEAD_DIM 128
#define DIMS_PER_LANE 4  // MAX_HEAD_DIM / 32
#define KEY_TILE 32
#define QB 8             // queries (forward, dq) or keys (dk/dv) per block: one warp each

__device__ __forceinline__ i64 row_at(i64 b, i64 t, i64 h, i64 seq, i64 heads, i64 head_dim) {
    return ((b * seq + t) * heads + h) * head_dim;
}

// Stages rows t0..t0+31 of head (b, h) of `src` ([B, T, H, D]) into tile[32][stride];
// rows past `limit` are zero.
__device__ __forceinline__ void stage_rows(float* tile, int stride, const float* src, i64 b, i64 h, i64 t0,
                                           i64 limit, i64 seq, i64 heads, i64 head_dim) {
    for (int e = threadIdx.x; e < KEY_TILE * head_dim; e += blockDim.x) {
        int r = e / (int)head_dim, d = e % (int)head_dim;
        i64 t = t0 + r;
        tile[r * stride + d] = t < limit ? src[row_at(b, t, h, seq, heads, head_dim) + d] : 0.0f;
    }
}

// Dynamic shared memory: K tile [32][KS], V tile [32][KS], q rows [QB][D]. out_bf16 (when not
// null) gets out rounded to nearest even, for the bf16 products that read it.
extern "C" __global__ void __launch_bounds__(QB * 32)
    attention_forward(const float* q, const float* k, const float* v, float* out, bf16_t* out_bf16, float* lse,
                      i64 batch, i64 q_seq, i64 kv_seq, i64 heads, i64 head_dim, float scale) {
    DYNAMIC_SHARED(float, smem);
    const int ks = (int)(head_dim | 1);
    float* k_tile = smem;
    float* v_tile = k_tile + KEY_TILE * ks;
    float* q_rows = v_tile + KEY_TILE * ks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 b = blockIdx.y / heads, h = blockIdx.y % heads;
    const i64 offset = kv_seq - q_seq;
    const i64 q0 = (i64)blockIdx.x * QB;
    const i64 i = q0 + warp;
    const bool active = i < q_seq;
    const i64 position = i + offset;
    const i64 last = (q0 + QB < q_seq ? q0 + QB : q_seq) - 1;
    const i64 end = last + offset + 1;  // keys the block needs: 0..end

    float* q_row = q_rows + warp * head_dim;
    if (active) {
        for (int d = lane; d < head_dim; d += 32) q_row[d] = q[row_at(b, i, h, q_seq, heads, head_dim) + d];
    }
    float m = NEG_INF, l = 0.0f;
    float acc[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (i64 s0 = 0; s0 < end; s0 += KEY_TILE) {
        __syncthreads();  // every warp is done with the previous tile (and q_row is written)
        stage_rows(k_tile, ks, k, b, h, s0, kv_seq, kv_seq, heads, head_dim);
        stage_rows(v_tile, ks, v, b, h, s0, kv_seq, kv_seq, heads, head_dim);
        __syncthreads();
        if (!active || s0 > position) continue;  // warp-uniform: this tile is all in the future
        const i64 s = s0 + lane;
        float score = NEG_INF;
        if (s <= position) {
            const float* k_row = k_tile + lane * ks;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot += q_row[d] * k_row[d];
            score = scale * dot;
        }
        // Key s0 ≤ position is visible, so the tile's max is finite; e^(−∞ − finite) = 0 on
        // the first tile.
        float new_m = fmaxf(m, warp_max(score));
        float p = s <= position ? expf(score - new_m) : 0.0f;
        float correction = expf(m - new_m);
        l = l * correction + warp_sum(p);
        m = new_m;
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; ++j) acc[j] *= correction;
        for (int t = 0; t < KEY_TILE; ++t) {
            float pt = __shfl_sync(FULL_MASK, p, t);
#pragma unroll
            for (int j = 0; j < DIMS_PER_LANE; ++j) {
                int d = lane + 32 * j;
                if (d < head_dim) acc[j] += pt * v_tile[t * ks + d];
            }
        }
    }
    if (active) {
        i64 at = row_at(b, i, h, q_seq, heads, head_dim);
        float inv = 1.0f / l;
        for (int j = 0; j < DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < head_dim) {
                float o = acc[j] * inv;
                out[at + d] = o;
                if (out_bf16) out_bf16[at + d] = f32_to_bf16(o);
            }
        }
        if (lane == 0) lse[(b * heads + h) * q_seq + i] = m + logf(l);
    }
}

// dq = scale·Σ_s dS_is·k_s, one warp per query (as the forward). Gradients are written, not
// added (kernels/src/lib.rs): every row of dq, dk and dv is written once. Each warp first
// computes its query's delta[b, h, i] = Σ_d dout·out (lane partial sums in d order, then the
// warp sum) and writes it for attention_backward_dkv, launched after.
// Dynamic shared memory: K tile [32][KS], V tile [32][KS], q rows [QB][D], dout rows [QB][D].
extern "C" __global__ void __launch_bounds__(QB * 32)
    attention_backward_dq(const float* q, const float* k, const float* v, const float* out, const float* dout,
                          const float* lse, float* delta, float* dq, i64 batch, i64 q_seq, i64 kv_seq, i64 heads,
                          i64 head_dim, float scale) {
    DYNAMIC_SHARED(float, smem);
    const int ks = (int)(head_dim | 1);
    float* k_tile = smem;
    float* v_tile = k_tile + KEY_TILE * ks;
    float* q_rows = v_tile + KEY_TILE * ks;
    float* do_rows = q_rows + QB * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 b = blockIdx.y / heads, h = blockIdx.y % heads;
    const i64 offset = kv_seq - q_seq;
    const i64 q0 = (i64)blockIdx.x * QB;
    const i64 i = q0 + warp;
    const bool active = i < q_seq;
    const i64 position = i + offset;
    const i64 last = (q0 + QB < q_seq ? q0 + QB : q_seq) - 1;
    const i64 end = last + offset + 1;

    float* q_row = q_rows + warp * head_dim;
    float* do_row = do_rows + warp * head_dim;
    float row_lse = 0.0f, row_delta = 0.0f;
    if (active) {
        i64 at = row_at(b, i, h, q_seq, heads, head_dim);
        for (int d = lane; d < head_dim; d += 32) {
            q_row[d] = q[at + d];
            do_row[d] = dout[at + d];
        }
        row_lse = lse[(b * heads + h) * q_seq + i];
        float s = 0.0f;
        for (int d = lane; d < head_dim; d += 32) s += out[at + d] * dout[at + d];
        row_delta = warp_sum(s);  // `active` is uniform across the warp
        if (lane == 0) delta[(b * heads + h) * q_seq + i] = row_delta;
    }
    float acc[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (i64 s0 = 0; s0 < end; s0 += KEY_TILE) {
        __syncthreads();
        stage_rows(k_tile, ks, k, b, h, s0, kv_seq, kv_seq, heads, head_dim);
        stage_rows(v_tile, ks, v, b, h, s0, kv_seq, kv_seq, heads, head_dim);
        __syncthreads();
        if (!active || s0 > position) continue;
        const i64 s = s0 + lane;
        float ds = 0.0f;
        if (s <= position) {
            const float* k_row = k_tile + lane * ks;
            const float* v_row = v_tile + lane * ks;
            float qk = 0.0f, dp = 0.0f;
            for (int d = 0; d < head_dim; ++d) {
                qk += q_row[d] * k_row[d];
                dp += do_row[d] * v_row[d];
            }
            float p = expf(scale * qk - row_lse);
            ds = p * (dp - row_delta);
        }
        for (int t = 0; t < KEY_TILE; ++t) {
            float dst = __shfl_sync(FULL_MASK, ds, t);
#pragma unroll
            for (int j = 0; j < DIMS_PER_LANE; ++j) {
                int d = lane + 32 * j;
                if (d < head_dim) acc[j] += dst * k_tile[t * ks + d];
            }
        }
    }
    if (active) {
        i64 at = row_at(b, i, h, q_seq, heads, head_dim);
        for (int j = 0; j < DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < head_dim) dq[at + d] = scale * acc[j];
        }
    }
}

// dv = Σ_i P_is·dO_i and dk = scale·Σ_i dS_is·q_i, one warp per key s, QB keys per block,
// walking the query tiles that see those keys (queries i with i + offset ≥ s).
// Dynamic shared memory: q tile [32][KS], dout tile [32][KS], k rows [QB][D], v rows
// [QB][D], lse [32], delta [32]. dv_bf16 (when not null) gets dv rounded to nearest even.
extern "C" __global__ void __launch_bounds__(QB * 32)
    attention_backward_dkv(const float* q, const float* k, const float* v, const float* dout, const float* lse,
                           const float* delta, float* dk, float* dv, bf16_t* dv_bf16, i64 batch, i64 q_seq,
                           i64 kv_seq, i64 heads, i64 head_dim, float scale) {
    DYNAMIC_SHARED(float, smem);
    const int ks = (int)(head_dim | 1);
    float* q_tile = smem;
    float* do_tile = q_tile + KEY_TILE * ks;
    float* k_rows = do_tile + KEY_TILE * ks;
    float* v_rows = k_rows + QB * head_dim;
    float* lse_tile = v_rows + QB * head_dim;
    float* delta_tile = lse_tile + KEY_TILE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 b = blockIdx.y / heads, h = blockIdx.y % heads;
    const i64 offset = kv_seq - q_seq;
    const i64 s_first = (i64)blockIdx.x * QB;
    const i64 s = s_first + warp;
    const bool active = s < kv_seq;
    // The first query that sees key s_first: i + offset ≥ s_first.
    const i64 i_start = s_first > offset ? s_first - offset : 0;

    float* k_row = k_rows + warp * head_dim;
    float* v_row = v_rows + warp * head_dim;
    if (active) {
        i64 at = row_at(b, s, h, kv_seq, heads, head_dim);
        for (int d = lane; d < head_dim; d += 32) {
            k_row[d] = k[at + d];
            v_row[d] = v[at + d];
        }
    }
    const float* lse_bh = lse + (b * heads + h) * q_seq;
    const float* delta_bh = delta + (b * heads + h) * q_seq;
    float acc_k[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    float acc_v[DIMS_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (i64 i0 = i_start; i0 < q_seq; i0 += KEY_TILE) {
        __syncthreads();
        stage_rows(q_tile, ks, q, b, h, i0, q_seq, q_seq, heads, head_dim);
        stage_rows(do_tile, ks, dout, b, h, i0, q_seq, q_seq, heads, head_dim);
        for (int e = threadIdx.x; e < KEY_TILE; e += blockDim.x) {
            i64 i = i0 + e;
            lse_tile[e] = i < q_seq ? lse_bh[i] : 0.0f;
            delta_tile[e] = i < q_seq ? delta_bh[i] : 0.0f;
        }
        __syncthreads();
        if (!active) continue;
        const i64 i = i0 + lane;
        float p = 0.0f, ds = 0.0f;
        if (i < q_seq && i + offset >= s) {
            const float* q_row = q_tile + lane * ks;
            const float* do_row = do_tile + lane * ks;
            float qk = 0.0f, dp = 0.0f;
            for (int d = 0; d < head_dim; ++d) {
                qk += q_row[d] * k_row[d];
                dp += do_row[d] * v_row[d];
            }
            p = expf(scale * qk - lse_tile[lane]);
            ds = p * (dp - delta_tile[lane]);
        }
        for (int t = 0; t < KEY_TILE; ++t) {
            float pt = __shfl_sync(FULL_MASK, p, t);
            float dst = __shfl_sync(FULL_MASK, ds, t);
#pragma unroll
            for (int j = 0; j < DIMS_PER_LANE; ++j) {
                int d = lane + 32 * j;
                if (d < head_dim) {
                    acc_v[j] += pt * do_tile[t * ks + d];
                    acc_k[j] += dst * q_tile[t * ks + d];
                }
            }
        }
    }
    if (active) {
        i64 at = row_at(b, s, h, kv_seq, heads, head_dim);
        for (int j = 0; j < DIMS_PER_LANE; ++j) {
            int d = lane + 32 * j;
            if (d < head_dim) {
                dv[at + d] = acc_v[j];
                if (dv_bf16) dv_bf16[at + d] = f32_to_bf16(acc_v[j]);
                dk[at + d] = scale * acc_k[j];
            }
        }
    }
}

// The unfused baseline for the bench: one thread per query writes its scaled scores to
// `scores` ([B·H·Tq, Tk] in global memory), then a softmax and the weighted sum of V.
extern "C" __global__ void attention_naive_forward(const float* q, const float* k, const float* v, float* out,
                                                   float* scores, i64 batch, i64 q_seq, i64 kv_seq, i64 heads,
                                                   i64 head_dim, float scale) {
    GRID_STRIDE(r, batch * heads * q_seq) {
        i64 i = r % q_seq, h = (r / q_seq) % heads, b = r / (q_seq * heads);
        i64 keys = i + kv_seq - q_seq + 1;
        const float* qi = q + row_at(b, i, h, q_seq, heads, head_dim);
        float* row = scores + r * kv_seq;
        float m = NEG_INF;
        for (i64 s = 0; s < keys; ++s) {
            const float* ks_row = k + row_at(b, s, h, kv_seq, heads, head_dim);
            float dot = 0.0f;
            for (i64 d = 0; d < head_dim; ++d) dot += qi[d] * ks_row[d];
            row[s] = scale * dot;
            m = fmaxf(m, row[s]);
        }
        float total = 0.0f;
        for (i64 s = 0; s < keys; ++s) {
            row[s] = expf(row[s] - m);
            total += row[s];
        }
        float* oi = out + row_at(b, i, h, q_seq, heads, head_dim);
        for (i64 d = 0; d < head_dim; ++d) oi[d] = 0.0f;
        for (i64 s = 0; s < keys; ++s) {
            const float* vs = v + row_at(b, s, h, kv_seq, heads, head_dim);
            float p = row[s] / total;
            for (i64 d = 0; d < head_dim; ++d) oi[d] += p * vs[d];
        }
    }
}
