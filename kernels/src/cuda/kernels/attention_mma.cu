// Causal attention on the tensor cores: bf16 mma.sync.m16n8k16 with f32 accumulation, the
// FlashAttention-2 schedule (Dao 2023, Algorithms 1 and 2). Same contract as attention.cu:
// q [B, Tq, H, D], k and v [B, Tk, H, D] (f32), out [B, Tq, H, D], lse [B, H, Tq]; query i
// sits at position i + (Tk − Tq) and attends keys s ≤ that position.
//
// q, k and v are f32, or already bf16 (the _bf16 entry points: RoPE rounds them as it writes
// them, with the same rounding as the staging below, so both give the same bits). The _bf16
// forward may write its output in bf16 only (out null, as FlashAttention-2 stores O), and the
// _bf16 backward reads O so. The backward writes each of dq, dk and dv in f32 (with a bf16
// twin beside it when given a bf16 pointer too) or in bf16 alone (its f32 pointer null): under
// bf16 products the projections' products read them so. Given RoPE's tables it writes them as
// the packed QKV product's gradient instead, dq and dk rotated back (RowsOut below), so that
// RoPE's backward takes no launch of its own. The bf16 inputs may also be read straight from
// the packed QKV product ([B, T, 3, H, D], tokens 3·H·D elements apart) unrotated, q and k
// rotated by RoPE's tables as they are loaded (RowsIn below), so that RoPE's forward takes no
// launch either. dO is f32, or bf16
// beside bf16 q, k, v and O (the _bf16_dout_bf16 entry points: the output projection's input
// gradient, stored so under bf16 products); the products read it rounded to bf16 either way,
// so a bf16 dO gives the bits of the f32 one it rounds.
//
// Precision (as PyTorch's SDPA under bf16 autocast): q, k, v and dO are rounded to bf16 as
// they are staged, and so are the probabilities P and dS before their products; scores, the
// online softmax (running max m, sum l), lse, δ and every accumulator stay f32. The softmax
// works in base 2 (scores scaled by scale·log₂e, exponentials by exp2_ftz), lse is stored in
// natural units; the causal mask is tested only in tiles some query of the warp sees in part.
//
// Work split. A block is 4 warps; each warp owns 16 rows of the output (queries for the
// forward, keys for the backward) and keeps its operand fragments and accumulators in
// registers. The block walks tiles of 64 keys (or queries), staged row-major in shared
// memory as bf16, two buffers: bf16 inputs go in by cp.async, the next tile's copies in
// flight while the warps multiply the current one (f32 inputs are rounded on the way through
// registers, so their staging waits); every product reads its B fragments from the tiles there,
// four 8 × 8 blocks an instruction (ldmatrix):
//   forward   S = Q·Kᵀ, online softmax, O += P·V
//   backward  Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − δ), dV += Pᵀ·dO, dK += dSᵀ·Q, and
//             dQ += dS·K into the block's own partial dq (then a finish adds the partials)
// No atomics, a fixed order of additions: every run gives the same bits.
//
// Global accesses move 2 or 4 floats at once (8- and 16-byte loads and stores): every
// tensor is a whole device buffer, which starts 16-byte aligned (the allocator's blocks: 256
// bytes on a GPU, 16 on the emulator), and a row of D floats is a multiple of 64 bytes.
//
// Fragments (PTX ISA "mma.m16n8k16", g = lane / 4, t = lane % 4): A row-major 16 × 16,
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; B 16 × 8,
// b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; the f32 result C 16 × 8, c0, c1 = C[g][2t, 2t+1],
// c2, c3 = C[g+8][2t, 2t+1]. Two adjacent result tiles (16 columns) therefore hold exactly an
// A fragment's elements: P and dS go from one product to the next without leaving registers.
//
// Head dims 16, 32, 48 and 64 (multiples of 16, the depth of one mma; larger ones would
// spill the accumulators: attention.cu serves them).

#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_ROWS (TC_WARPS * 16)  // rows of the output per block: 16 per warp
#define TC_TILE 64               // keys (forward) or queries (backward) per shared tile
#define TC_PAD 8                 // bf16 padding per shared row (16 bytes): with it the 8 rows
                                 // of 16 bytes one ldmatrix matrix reads fall in distinct banks
                                 // for every supported D, and rows stay 16-byte aligned

// Where row (b, t) of head h starts in a tensor whose tokens are `stride` elements apart (H·D
// when dense [B, T, H, D]; 3·H·D in the packed QKV product).
template <int D>
__device__ __forceinline__ i64 head_row(i64 b, i64 t, i64 h, i64 seq, i64 stride) {
    return (b * seq + t) * stride + h * D;
}

// How a kernel reads q, k and v: tokens `stride` elements apart and, when `cos` is given
// (bf16 inputs, Tq = Tk), q and k rotated by RoPE's tables ([positions, D/2], rope.cu: row t
// at position t) as they are loaded: widened, rotated in f32 (common.cuh's rope_rotate_pair)
// and rounded to bf16, the bits rope.cu writes from the same bf16 product. v is never rotated.
struct RowsIn {
    i64 stride;
    const float* cos;
    const float* sin;
};

// Rows t0..t0+63 of head (b, h) of an f32 `src` ([B, T, H, D]) into tile[64][D + PAD],
// rounded to bf16; rows at or past `limit` are zero. A thread moves 4 adjacent values at a time
// (one 16-byte load, then the shared stores), STAGE_BATCH chunks a round, all of a round's loads
// issued before its first store so that they are in flight together (a load-then-store loop
// waits out each load's latency in turn); rounds of 4 keep the registers a round holds to 16.
// The tile is complete when it returns.
#define STAGE_BATCH 4
template <int D>
__device__ __forceinline__ void stage_tile(bf16_t* tile, const float* src, i64 b, i64 h, i64 t0, i64 limit, i64 seq,
                                           i64 stride) {
    constexpr int PER_THREAD = TC_TILE * D / 4 / TC_THREADS;  // D / 8 chunks of 4 values
    constexpr int BATCH = PER_THREAD < STAGE_BATCH ? PER_THREAD : STAGE_BATCH;
#pragma unroll
    for (int i0 = 0; i0 < PER_THREAD; i0 += BATCH) {
        f32x4 chunk[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int e = threadIdx.x + (i0 + i) * TC_THREADS, r = e / (D / 4), c = 4 * (e % (D / 4));
            const i64 t = t0 + r;
            chunk[i] = f32x4{};
            if (i0 + i < PER_THREAD && t < limit)
                chunk[i] = *reinterpret_cast<const f32x4*>(src + head_row<D>(b, t, h, seq, stride) + c);
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            if (i0 + i >= PER_THREAD) break;
            const int e = threadIdx.x + (i0 + i) * TC_THREADS, r = e / (D / 4), c = 4 * (e % (D / 4));
            unsigned int* words = reinterpret_cast<unsigned int*>(tile + r * (D + TC_PAD) + c);
            words[0] = bf16x2(chunk[i].v[0], chunk[i].v[1]);
            words[1] = bf16x2(chunk[i].v[2], chunk[i].v[3]);
        }
    }
}

// The same rows of a bf16 `src` by cp.async (common.cuh), 16 bytes (8 values) a copy, D / 16
// copies a thread, rows at or past `limit` zero-filled: issued, not complete. The caller
// commits them as a group and waits for it, then a barrier, before the block reads the tile:
// the kernels below stage the next tile while they multiply the current one.
template <int D>
__device__ __forceinline__ void stage_tile(bf16_t* tile, const bf16_t* src, i64 b, i64 h, i64 t0, i64 limit, i64 seq,
                                           i64 stride) {
    constexpr int COPIES = TC_TILE * D / 8 / TC_THREADS;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
        const int e = threadIdx.x + i * TC_THREADS, r = e / (D / 8), c = 8 * (e % (D / 8));
        const i64 t = t0 + r;
        const bool row = t < limit;
        cp_async(tile + r * (D + TC_PAD) + c, row ? src + head_row<D>(b, t, h, seq, stride) + c : src, 16, row ? 16 : 0);
    }
}

// Key tile s0 of head (b, h) into one K and one V buffer (the forward's operands).
template <int D, typename In>
__device__ __forceinline__ void stage_key_tile(bf16_t* k_tile, bf16_t* v_tile, const In* k, const In* v, i64 b, i64 h,
                                               i64 s0, i64 kv_seq, i64 stride) {
    stage_tile<D>(k_tile, k, b, h, s0, kv_seq, kv_seq, stride);
    stage_tile<D>(v_tile, v, b, h, s0, kv_seq, kv_seq, stride);
}

// Rotates the rows t0.. below `limit` of a complete staged tile in place by RoPE's tables
// (RowsIn), 4 pairs at a time (8-byte shared and 16-byte table accesses). The caller's barrier
// then makes the rotated tile visible to the block.
template <int D>
__device__ __forceinline__ void rotate_tile(bf16_t* tile, i64 t0, i64 limit, const float* cos, const float* sin) {
    constexpr int GROUPS = D / 8;  // groups of 4 pairs per row
    for (int e = threadIdx.x; e < TC_TILE * GROUPS; e += TC_THREADS) {
        const int r = e / GROUPS, c = 4 * (e % GROUPS);
        const i64 t = t0 + r;
        if (t >= limit) continue;
        bf16_t* lo_at = tile + r * (D + TC_PAD) + c;
        float a[4], b[4], co[4], si[4], lo[4], hi[4];
        load_f32(a, (const bf16_t*)lo_at);
        load_f32(b, (const bf16_t*)(lo_at + D / 2));
        load_f32(co, cos + t * (D / 2) + c);
        load_f32(si, sin + t * (D / 2) + c);
#pragma unroll
        for (int k = 0; k < 4; ++k) rope_rotate_pair(a[k], b[k], co[k], si[k], 1.0f, lo[k], hi[k]);
        store_bf16(lo_at, lo);
        store_bf16(lo_at + D / 2, hi);
    }
}

// The current tile is in once this returns: the copies issued since the last call (the next
// tile's, or none) are committed as a group, every earlier group (the current tile's) is
// waited for, and the barrier makes every thread's copies visible to the block.
__device__ __forceinline__ void wait_for_tile() {
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
}

// Two adjacent values p[0], p[1] as one register of bf16 halves, the first in the low half.
__device__ __forceinline__ unsigned int pair_bf16(const float* p) {
    const f32x2 pair = *reinterpret_cast<const f32x2*>(p);
    return bf16x2(pair.v[0], pair.v[1]);
}
__device__ __forceinline__ unsigned int pair_bf16(const bf16_t* p) { return *reinterpret_cast<const unsigned int*>(p); }

// The A fragments of rows row0..row0+15 of head (b, h) of `src` (f32 or bf16, rows ≥ limit
// are zero; tokens `stride` elements apart), straight from global memory into registers:
// frag[kk] covers columns 16·kk..16·kk+15. Given RoPE's tables (bf16 `src`, RowsIn), each row
// is rotated as it is loaded: a lane holds columns 8m + 2t and 8m + 2t + 1 of its rows for
// every m, so column c < D/2 and its partner c + D/2 (D/2 a multiple of 8) are the same lane's.
template <int D, typename In>
__device__ __forceinline__ void load_a_rows(unsigned int (*frag)[4], const In* src, i64 b, i64 h, i64 row0, i64 limit,
                                            i64 seq, i64 stride, const float* cos = nullptr,
                                            const float* sin = nullptr) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        i64 row = row0 + g + 8 * half;
        const In* p = src + head_row<D>(b, row, h, seq, stride);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            int c = 16 * kk + 2 * t;
            frag[kk][half] = 0u;
            frag[kk][half + 2] = 0u;
            if (row < limit) {
                frag[kk][half] = pair_bf16(p + c);
                frag[kk][half + 2] = pair_bf16(p + c + 8);
            }
        }
        if (cos && row < limit) {
            // Columns 8m + 2t, +1 sit in frag[m / 2][half + 2·(m % 2)].
#pragma unroll
            for (int m = 0; m < D / 16; ++m) {
                const int pm = m + D / 16, c = 8 * m + 2 * t;
                unsigned int& lo_word = frag[m / 2][half + 2 * (m % 2)];
                unsigned int& hi_word = frag[pm / 2][half + 2 * (pm % 2)];
                const f32x2 co = *reinterpret_cast<const f32x2*>(cos + row * (D / 2) + c);
                const f32x2 si = *reinterpret_cast<const f32x2*>(sin + row * (D / 2) + c);
                float lo[2], hi[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float a = bf16_to_f32((bf16_t)(lo_word >> (16 * e)));
                    const float b = bf16_to_f32((bf16_t)(hi_word >> (16 * e)));
                    rope_rotate_pair(a, b, co.v[e], si.v[e], 1.0f, lo[e], hi[e]);
                }
                lo_word = bf16x2(lo[0], lo[1]);
                hi_word = bf16x2(hi[0], hi[1]);
            }
        }
    }
}

// The B fragments of two adjacent 8-column tiles of B[k][n] = tile[n0 + n][k0 + k], k0..k0+15:
// the tile's rows are B's columns (the second factor of X·Yᵀ, Y staged row-major). One
// ldmatrix_x4 (common.cuh) of the four 8 × 8 blocks (rows n0.., n0 + 8.. × columns k0.., k0 + 8..):
// frag[0], frag[1] for columns n0..n0+7, frag[2], frag[3] for n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b_transposed_pair(unsigned int* frag, const bf16_t* tile, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    const int row = n0 + (lane & 7) + 8 * (lane >> 4), col = k0 + 8 * ((lane >> 3) & 1);
    ldmatrix_x4(frag, tile + row * (D + TC_PAD) + col);
}

// The B fragments of two adjacent 8-column tiles of B[k][n] = tile[k0 + k][n0 + n], k0..k0+15:
// the tile's rows are B's rows (the second factor of X·Y, Y staged row-major). One
// ldmatrix_x4_trans of the blocks (rows k0.., k0 + 8.. × columns n0.., n0 + 8..): frag[0],
// frag[1] for columns n0..n0+7, frag[2], frag[3] for n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b_pair(unsigned int* frag, const bf16_t* tile, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int row = k0 + (lane & 7) + 8 * ((lane >> 3) & 1), col = n0 + 8 * (lane >> 4);
    ldmatrix_x4_trans(frag, tile + row * (D + TC_PAD) + col);
}

// acc[nt] (16 × 64: 8 tiles of 8 columns) = A · tileᵀ for the warp's 16 rows of A (fragments
// `a`, depth D) and the 64 staged rows of `tile`. Each result tile sums its depth in order.
template <int D>
__device__ __forceinline__ void product_a_tile_t(float (*acc)[4], const unsigned int (*a)[4], const bf16_t* tile) {
#pragma unroll
    for (int nt = 0; nt < 8; nt += 2) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        acc[nt + 1][0] = acc[nt + 1][1] = acc[nt + 1][2] = acc[nt + 1][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned int b[4];
            load_b_transposed_pair<D>(b, tile, 8 * nt, 16 * kk);
            MMA_M16N8K16_BF16(acc[nt], a[kk], b);
            MMA_M16N8K16_BF16(acc[nt + 1], a[kk], b + 2);
        }
    }
}

// out[nd] (16 × D) += A · tile[k0 .. k0 + 16] for one A fragment `a` (16 rows, depth 16) and
// staged rows k0.. of `tile`.
template <int D>
__device__ __forceinline__ void accumulate_rows(float (*out)[4], const unsigned int (&a)[4], const bf16_t* tile, int k0) {
#pragma unroll
    for (int nd = 0; nd < D / 8; nd += 2) {
        unsigned int b[4];
        load_b_pair<D>(b, tile, k0, 8 * nd);
        MMA_M16N8K16_BF16(out[nd], a, b);
        MMA_M16N8K16_BF16(out[nd + 1], a, b + 2);
    }
}

// out[nd] (16 × D) += P · tile for P (16 × 64, the f32 result tiles `p`, rounded to bf16 here)
// and the 64 staged rows of `tile`.
template <int D>
__device__ __forceinline__ void accumulate_p_tile(float (*out)[4], const float (*p)[4], const bf16_t* tile) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        const float* lo = p[2 * kc];
        const float* hi = p[2 * kc + 1];
        const unsigned int a[4] = {bf16x2(lo[0], lo[1]), bf16x2(lo[2], lo[3]), bf16x2(hi[0], hi[1]),
                                   bf16x2(hi[2], hi[3])};
        accumulate_rows<D>(out, a, tile, 16 * kc);
    }
}

// The sum or max of a value over the four lanes that share a result row (same g).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

// Where a kernel stores its result rows: the f32 values and their bf16 twin (either may be
// null), `stride` elements between two tokens' rows (H·D in a dense [B, T, H, D] tensor; 3·H·D
// where the rows are a third of the packed QKV product's gradient [B, T, 3, H, D]) and, when
// `cos` is given, RoPE's tables ([positions, D/2], rope.cu): each row is then rotated back (the
// inverse rotation, RoPE's backward) by the angles of its position before it is stored, so
// that the backward writes dqkv = [Rᵀ dq | Rᵀ dk | dv] itself, with no RoPE launch after it.
struct RowsOut {
    float* f32;
    bf16_t* bf16;
    i64 stride;
    const float* cos;
    const float* sin;
};

// Writes the warp's 16 × D result rows row0.. (`scale` times the accumulator) of head (b, h)
// into `dst`, skipping rows at or past `limit`; row r sits at position r + position_offset
// (RoPE's table row). A lane holds two adjacent columns of a row: it writes them as one
// 8-byte store (one 4-byte store of the bf16 pair), so a warp's store fills whole 32-byte
// sectors instead of half of each. Column c < D/2 pairs with c + D/2, which the same lane
// holds in tile nd + D/16 (D/2 is a multiple of 8), so the rotation stays in registers.
template <int D>
__device__ __forceinline__ void store_rows(const float (*acc)[4], float scale, const RowsOut& dst, i64 b, i64 h,
                                           i64 row0, i64 limit, i64 seq, i64 position_offset) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        i64 row = row0 + g + 8 * half;
        if (row >= limit) continue;
        i64 at = (b * seq + row) * dst.stride + h * D;
        float v[D / 8][2];
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            v[nd][0] = scale * acc[nd][2 * half];
            v[nd][1] = scale * acc[nd][2 * half + 1];
        }
        if (dst.cos) {
            const i64 table_row = (row + position_offset) * (D / 2);
#pragma unroll
            for (int nd = 0; nd < D / 16; ++nd) {
                const int c = 8 * nd + 2 * t;
                const f32x2 cos_pair = *reinterpret_cast<const f32x2*>(dst.cos + table_row + c);
                const f32x2 sin_pair = *reinterpret_cast<const f32x2*>(dst.sin + table_row + c);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float* partner = &v[nd + D / 16][e];
                    rope_rotate_pair(v[nd][e], *partner, cos_pair.v[e], sin_pair.v[e], -1.0f, v[nd][e], *partner);
                }
            }
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            const int c = 8 * nd + 2 * t;
            if (dst.f32) *reinterpret_cast<f32x2*>(dst.f32 + at + c) = f32x2{{v[nd][0], v[nd][1]}};
            if (dst.bf16) *reinterpret_cast<unsigned int*>(dst.bf16 + at + c) = bf16x2(v[nd][0], v[nd][1]);
        }
    }
}

// Where a warp of a forward block stands: head (b, h), its 16 queries from row0,
// the keys its block needs (0..end), the last key its first query sees (warp_first: every key
// up to it is seen by all its queries) and the last its last query sees (warp_last), and the
// positions of the lane's two query rows g and g + 8.
struct QueryWarp {
    i64 b, h, row0, end, warp_first, warp_last, position[2];
};

__device__ __forceinline__ QueryWarp query_warp(i64 q_seq, i64 kv_seq, i64 heads) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const i64 offset = kv_seq - q_seq;
    const i64 q0 = (i64)blockIdx.x * TC_ROWS, row0 = q0 + 16 * warp;
    QueryWarp w;
    w.b = blockIdx.y / heads;
    w.h = blockIdx.y % heads;
    w.row0 = row0;
    w.end = (q0 + TC_ROWS < q_seq ? q0 + TC_ROWS : q_seq) + offset;
    w.warp_first = row0 + offset;
    w.warp_last = (row0 + 15 < q_seq ? row0 + 15 : q_seq - 1) + offset;
    w.position[0] = row0 + g + offset;
    w.position[1] = row0 + g + 8 + offset;
    return w;
}

// ---------------------------------------------------------------------------------------
// Forward: one block per 64 queries of one (b, h), grid (⌈Tq/64⌉, B·H).

// v clamped to a tile's 0..TC_TILE, in 32 bits: the masks' bounds, so that their tests per
// score compare ints.
__device__ __forceinline__ int clamp_to_tile(i64 v) { return (int)(v < 0 ? 0 : v > TC_TILE ? TC_TILE : v); }

// The scores of a key tile from s0 for a warp's 16 queries, scaled by scale_log2 (the
// softmax's scale times log₂e: the forward's softmax works in base 2, as FlashAttention's does,
// so that each exponential is one exp2), masked where MASKED (keys past a query's position or
// past kv_seq become −∞; a tile every query of the warp sees whole skips the test), and their
// max per row (this lane's share).
template <bool MASKED>
__device__ __forceinline__ void scale_scores(float (&s)[8][4], i64 s0, i64 kv_seq, const QueryWarp& w,
                                             float scale_log2, float (&tile_max)[2]) {
    const int t = threadIdx.x & 3;
    // Key s0 + c is seen by the lane's query row `half` when c < seen[half] (in 32 bits).
    int seen[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        seen[half] = clamp_to_tile((w.position[half] + 1 < kv_seq ? w.position[half] + 1 : kv_seq) - s0);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int half = e >> 1;
            float score = scale_log2 * s[nt][e];
            if (MASKED && 8 * nt + 2 * t + (e & 1) >= seen[half]) score = NEG_INF;
            s[nt][e] = score;
            tile_max[half] = fmaxf(tile_max[half], score);
        }
    }
}

// One key tile of the forward for a warp's 16 queries (fragments qa): S = Q·Kᵀ scaled and
// masked, the online softmax's running max m and row sums l (in base 2: P = 2^(S·scale·log₂e −
// m) = e^(S·scale − m·ln 2)), O rescaled, then O += P·V.
template <int D>
__device__ __forceinline__ void forward_tile(const unsigned int (*qa)[4], const bf16_t* k_tile, const bf16_t* v_tile,
                                             i64 s0, i64 kv_seq, const QueryWarp& w, float scale_log2, float (*o)[4],
                                             float (&m)[2], float (&l)[2]) {
    float s[8][4];
    product_a_tile_t<D>(s, qa, k_tile);
    // Scale and mask; the new running max per row. Key 0 is in the first tile and every
    // query sees it, so each row's max is finite from the first tile on.
    float tile_max[2] = {NEG_INF, NEG_INF};
    if (s0 + TC_TILE - 1 <= w.warp_first && s0 + TC_TILE <= kv_seq) {  // warp-uniform
        scale_scores<false>(s, s0, kv_seq, w, scale_log2, tile_max);
    } else {
        scale_scores<true>(s, s0, kv_seq, w, scale_log2, tile_max);
    }
    float correction[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float new_m = fmaxf(m[half], quad_max(tile_max[half]));
        correction[half] = exp2_ftz(m[half] - new_m);  // 2^(−∞) = 0 on the first tile
        m[half] = new_m;
        l[half] *= correction[half];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int half = e >> 1;
            s[nt][e] = exp2_ftz(s[nt][e] - m[half]);  // masked: 2^(−∞) = 0
            l[half] += s[nt][e];
        }
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
        o[nd][0] *= correction[0];
        o[nd][1] *= correction[0];
        o[nd][2] *= correction[1];
        o[nd][3] *= correction[1];
    }
    accumulate_p_tile<D>(o, s, v_tile);
}

template <int D, typename In>
__device__ __forceinline__ void attention_mma_forward(const In* q, const In* k, const In* v, RowsIn in, float* out,
                                                      bf16_t* out_bf16, float* lse, i64 q_seq, i64 kv_seq, i64 heads,
                                                      float scale) {
    __shared__ __align__(16) bf16_t k_tiles[2][TC_TILE * (D + TC_PAD)];
    __shared__ __align__(16) bf16_t v_tiles[2][TC_TILE * (D + TC_PAD)];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const QueryWarp w = query_warp(q_seq, kv_seq, heads);
    const i64 b = w.b, h = w.h, row0 = w.row0;

    // Key tile i goes into buffer i & 1: tile i + 1 is staged while tile i is multiplied.
    stage_key_tile<D>(k_tiles[0], v_tiles[0], k, v, b, h, 0, kv_seq, in.stride);
    cp_async_commit();
    unsigned int qa[D / 16][4];
    load_a_rows<D>(qa, q, b, h, row0, q_seq, q_seq, in.stride, in.cos, in.sin);
    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // l: this lane's share of the row sum

    int buf = 0;
    for (i64 s0 = 0; s0 < w.end; s0 += TC_TILE, buf ^= 1) {
        if (s0 + TC_TILE < w.end) {
            stage_key_tile<D>(k_tiles[buf ^ 1], v_tiles[buf ^ 1], k, v, b, h, s0 + TC_TILE, kv_seq, in.stride);
        }
        wait_for_tile();
        if (in.cos) {
            rotate_tile<D>(k_tiles[buf], s0, kv_seq, in.cos, in.sin);
            __syncthreads();
        }
        // Warp-uniform: only where some key of the tile is visible to the warp's queries.
        if (row0 < q_seq && s0 <= w.warp_last) {
            forward_tile<D>(qa, k_tiles[buf], v_tiles[buf], s0, kv_seq, w, scale * LOG2E, o, m, l);
        }
        __syncthreads();  // every warp is done with buffer buf before the tile after next goes into it
    }
    if (row0 >= q_seq) return;
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l[half] = quad_sum(l[half]);
        inv[half] = 1.0f / l[half];
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
        o[nd][0] *= inv[0];
        o[nd][1] *= inv[0];
        o[nd][2] *= inv[1];
        o[nd][3] *= inv[1];
    }
    store_rows<D>(o, 1.0f, RowsOut{out, out_bf16, heads * D, nullptr, nullptr}, b, h, row0, q_seq, q_seq, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = row0 + g + 8 * half;
        if (t == 0 && row < q_seq) lse[(b * heads + h) * q_seq + row] = m[half] * LN2 + logf(l[half]);
    }
}

// ---------------------------------------------------------------------------------------
// Backward: one pass over each key tile for dk, dv and dq together, grid (G, B·H), then a
// finish launch for dq.
//
// Block (g, b·H + h) takes key tiles g, g + G, g + 2G, ... of head (b, h), in order (G =
// gridDim.x, the key tiles' groups: the launcher picks enough for the GPU's SMs). For each key
// tile it walks the query tiles that see it, FlashAttention-2's backward, each warp owning 16
// keys (fragments ka, va):
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ and dSᵀ = Pᵀ ⊙ (dPᵀ − δ), dV += Pᵀ·dO, dK += dSᵀ·Q     (dkv_tile)
//   dQ += dS·K                                                   (load_dq_partial, dq_update)
// dK and dV stay in registers until the key tile's last query tile. For dQ the warps put
// their rows of dSᵀ in shared memory (over the query tile's stage, which the products above
// have read by then) and each warp multiplies 16 query rows of dS by the key tile, staged
// beside. FlashAttention-2 adds dQ into global memory with atomics, in whatever order the
// blocks arrive; here the block adds into its group's own f32 partial (dq_part[g][b, h]: [Tq,
// D]): written on the group's first key tile (whose query tiles include every one its later
// key tiles see), then read back and added to, by this block alone, in the order of its key
// tiles. The finish launch adds the groups' partials in group order, scales and stores dq.
// No atomics: every run gives the same bits. (The two kernels this replaced, one for dq and
// one for dk and dv, each computed S, P and dP: seven tile products where this takes five.)
//
// δ_i = Σ_d dO_i·O_i = Σ_s P_is·dP_is in f32, from O as stored and dO as staged (rounded to
// bf16, as dP's product reads it, so that dP − δ cancels where it should: one visible key,
// O_i = V_0 exactly, and dS = 0): the block computes it on its group's first key tile into
// the stage and its group's delta_part row, and later key tiles stage it from there as lse.

// The first query that sees key s: query i sits at position i + offset (offset = Tk − Tq) and
// sees keys up to it. A backward block walks query tiles from there, and so writes its
// group's partial dq from there on, where the finish reads it.
__device__ __forceinline__ i64 first_query_seeing(i64 s, i64 offset) { return s > offset ? s - offset : 0; }

// Query tile i0 of head (b, h) into one stage: its Q and dO rows (stage_tile), their rows' lse
// and (with_delta) δ, threads 0-63 copying lse and 64-127 δ, 4 bytes each (zeros past q_seq).
template <int D, typename In, typename Dy>
__device__ __forceinline__ void stage_query_tile(bf16_t* q_tile, bf16_t* do_tile, float* lse_tile, float* delta_tile,
                                                 const In* q, const Dy* dout, const float* lse_bh,
                                                 const float* delta_bh, bool with_delta, i64 b, i64 h, i64 i0,
                                                 i64 q_seq, i64 heads, i64 q_stride) {
    static_assert(TC_THREADS == 2 * TC_TILE, "a thread for each lse and each δ of a tile");
    stage_tile<D>(q_tile, q, b, h, i0, q_seq, q_seq, q_stride);
    stage_tile<D>(do_tile, dout, b, h, i0, q_seq, q_seq, heads * D);
    const bool lse_part = threadIdx.x < TC_TILE;
    if (!lse_part && !with_delta) return;
    const int e = threadIdx.x % TC_TILE;
    const i64 i = i0 + e;
    const float* src = lse_part ? lse_bh : delta_bh;
    cp_async((lse_part ? lse_tile : delta_tile) + e, i < q_seq ? src + i : src, 4, i < q_seq ? 4 : 0);
}

// δ of the staged query tile's rows: threads 2r and 2r + 1 sum row r's two halves of the
// columns in order (dO as staged, O as stored, 4 values a load), then add the two, into the
// stage's δ (zero past q_seq) and the group's delta row.
template <int D, typename O>
__device__ __forceinline__ void delta_rows(float* delta_tile, float* delta_bh, const bf16_t* do_tile, const O* out,
                                           i64 b, i64 h, i64 i0, i64 q_seq, i64 heads) {
    static_assert(TC_THREADS == 2 * TC_TILE, "two threads a row");
    const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
    const i64 row = i0 + r;
    float sum = 0.0f;
    if (row < q_seq) {
        const O* o = out + head_row<D>(b, row, h, q_seq, heads * D) + part * (D / 2);
        const bf16_t* dy = do_tile + r * (D + TC_PAD) + part * (D / 2);
#pragma unroll
        for (int d = 0; d < D / 2; d += 4) {
            float dyv[4], ov[4];
            load_f32(dyv, dy + d);
            load_f32(ov, o + d);
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += dyv[e] * ov[e];
        }
    }
    sum += __shfl_xor_sync(FULL_MASK, sum, 1);
    if (part == 0) {
        delta_tile[r] = row < q_seq ? sum : 0.0f;
        if (row < q_seq) delta_bh[row] = sum;
    }
}

// Pᵀ and dSᵀ of a query tile from i0 for a warp's keys: P = 2^(S·scale·log₂e − lse·log₂e),
// the forward's probabilities (its softmax in base 2, lse in natural units), zero where the
// query does not see the key when MASKED (a tile whose every query sees all the warp's keys
// skips the test).
template <bool MASKED>
__device__ __forceinline__ void probabilities(float (&st)[8][4], float (*ds)[4], const float* lse_tile,
                                              const float* delta_tile, i64 i0, i64 q_seq, i64 kv_seq,
                                              const i64 (&key)[2], float scale_log2) {
    const int t = threadIdx.x & 3;
    // Query i0 + c sees key[half] when c < rows (a query of the tile) and c ≥ first[half] (its
    // position i0 + c + Tk − Tq reaches the key; never for a key past kv_seq): both in 32 bits.
    const int rows = clamp_to_tile(q_seq - i0);
    int first[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        first[half] = key[half] < kv_seq ? clamp_to_tile(key[half] - (kv_seq - q_seq) - i0) : TC_TILE;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int half = e >> 1, c = 8 * nt + 2 * t + (e & 1);
            float p = exp2_ftz(scale_log2 * st[nt][e] - LOG2E * lse_tile[c]);
            if (MASKED && (c >= rows || c < first[half])) p = 0.0f;
            st[nt][e] = p;                               // Pᵀ
            ds[nt][e] = p * (ds[nt][e] - delta_tile[c]);  // dSᵀ
        }
    }
}

// One query tile of dk/dv for a warp's 16 keys (fragments ka, va; key[] the lane's two keys,
// warp_last_key the warp's last): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ and dSᵀ = Pᵀ ⊙ (dPᵀ − δ),
// dV += Pᵀ·dO, dK += dSᵀ·Q; dSᵀ is left in ds (f32, the result tiles' layout) for dQ.
template <int D>
__device__ __forceinline__ void dkv_tile(const unsigned int (*ka)[4], const unsigned int (*va)[4],
                                         const bf16_t* q_tile, const bf16_t* do_tile, const float* lse_tile,
                                         const float* delta_tile, i64 i0, i64 q_seq, i64 kv_seq, const i64 (&key)[2],
                                         i64 warp_last_key, float scale_log2, float (*acc_k)[4], float (*acc_v)[4],
                                         float (*ds)[4]) {
    float st[8][4];
    product_a_tile_t<D>(st, ka, q_tile);
    product_a_tile_t<D>(ds, va, do_tile);
    // Warp-uniform: every query of the tile sees every key of the warp.
    if (i0 + TC_TILE <= q_seq && i0 + kv_seq - q_seq >= warp_last_key && warp_last_key < kv_seq) {
        probabilities<false>(st, ds, lse_tile, delta_tile, i0, q_seq, kv_seq, key, scale_log2);
    } else {
        probabilities<true>(st, ds, lse_tile, delta_tile, i0, q_seq, kv_seq, key, scale_log2);
    }
    accumulate_p_tile<D>(acc_v, st, do_tile);
    accumulate_p_tile<D>(acc_k, ds, q_tile);
}

// dSᵀ's shared tile: [64 keys][64 queries + PAD] bf16, so that its transposing loads (ldmatrix
// .trans) fall in distinct banks as the other tiles' do.
#define DS_ROW (TC_TILE + TC_PAD)

// The warp's 16 rows of dSᵀ (keys 16·warp + g, + 8; f32 result tiles `ds`) into the shared
// tile, rounded to bf16 as dK's product rounded them; zeros where the warp saw no query of the
// tile (`seen` false: ds holds nothing).
__device__ __forceinline__ void store_ds(bf16_t* tile, const float (*ds)[4], bool seen) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = 16 * warp + g + 8 * half, col = 8 * nt + 2 * t;
            *reinterpret_cast<unsigned int*>(tile + row * DS_ROW + col) =
                seen ? bf16x2(ds[nt][2 * half], ds[nt][2 * half + 1]) : 0u;
        }
    }
}

// The A fragment of rows m0..m0+15, columns k0..k0+15 of A = tileᵀ for a tile stored [k][m]
// (rows DS_ROW apart): one ldmatrix_x4_trans of the four 8 × 8 blocks (k0.., m0..), (k0..,
// m0 + 8..), (k0 + 8.., m0..), (k0 + 8.., m0 + 8..), which are a0..a3.
__device__ __forceinline__ void load_a_transposed(unsigned int* frag, const bf16_t* tile, int m0, int k0) {
    const int lane = threadIdx.x & 31, matrix = lane >> 3;
    const int row = k0 + (lane & 7) + 8 * (matrix >> 1), col = m0 + 8 * (matrix & 1);
    ldmatrix_x4_trans(frag, tile + row * DS_ROW + col);
}

// The warp's 16 query rows (i0 + 16·warp + g, + 8) of its group's partial dq (dq_bh: [Tq, D])
// in the result tiles' layout: as stored, or zeros on the group's first key tile (`first`),
// which writes them, and past q_seq. Loaded before the tile's other work, so that the loads
// are in flight while it runs.
template <int D>
__device__ __forceinline__ void load_dq_partial(float (*acc)[4], const float* dq_bh, i64 i0, i64 q_seq, bool first) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = i0 + 16 * warp + g + 8 * half;
        const bool read = !first && row < q_seq;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            const f32x2 p = read ? *reinterpret_cast<const f32x2*>(dq_bh + row * D + 8 * nd + 2 * t) : f32x2{};
            acc[nd][2 * half] = p.v[0];
            acc[nd][2 * half + 1] = p.v[1];
        }
    }
}

// Those rows += dS·K (dS [64 queries][64 keys] read from the stored dSᵀ tile by transposing
// loads, K the staged key tile), then stored back; rows at or past q_seq are not stored.
template <int D>
__device__ __forceinline__ void dq_update(float (*acc)[4], float* dq_bh, const bf16_t* ds_tile, const bf16_t* k_tile,
                                          i64 i0, i64 q_seq) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kc = 0; kc < TC_TILE / 16; ++kc) {
        unsigned int a[4];
        load_a_transposed(a, ds_tile, 16 * warp, 16 * kc);
        accumulate_rows<D>(acc, a, k_tile, 16 * kc);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = i0 + 16 * warp + g + 8 * half;
        if (row >= q_seq) continue;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            *reinterpret_cast<f32x2*>(dq_bh + row * D + 8 * nd + 2 * t) = f32x2{{acc[nd][2 * half], acc[nd][2 * half + 1]}};
        }
    }
}

template <int D, typename In, typename O, typename Dy>
__device__ __forceinline__ void attention_mma_backward(const In* q, const In* k, const In* v, RowsIn in, const O* out,
                                                       const Dy* dout, const float* lse, float* delta_part,
                                                       float* dq_part, float* dk, bf16_t* dk_bf16, float* dv,
                                                       bf16_t* dv_bf16, i64 grad_stride, const float* cos_table,
                                                       const float* sin_table, i64 q_seq, i64 kv_seq, i64 heads,
                                                       float scale) {
    constexpr int TILE_ELEMS = TC_TILE * (D + TC_PAD);
    constexpr int STAGE = 2 * TILE_ELEMS;  // a query tile's Q rows, then its dO rows
    constexpr int DS_ELEMS = TC_TILE * DS_ROW;
    __shared__ __align__(16) bf16_t stages[2][STAGE];
    __shared__ __align__(16) bf16_t ds_own[DS_ELEMS > STAGE ? DS_ELEMS : 1];  // D = 16: dSᵀ outgrows a stage
    __shared__ __align__(16) bf16_t k_tile[TILE_ELEMS];
    __shared__ __align__(16) float lse_tiles[2][TC_TILE];
    __shared__ __align__(16) float delta_tiles[2][TC_TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const i64 group = blockIdx.x, groups = gridDim.x, bh = blockIdx.y, heads_total = gridDim.y;
    const i64 b = bh / heads, h = bh % heads;
    const i64 offset = kv_seq - q_seq;
    const float* lse_bh = lse + bh * q_seq;
    float* delta_bh = delta_part + (group * heads_total + bh) * q_seq;
    float* dq_bh = dq_part + (group * heads_total + bh) * q_seq * D;

    for (i64 s_first = group * TC_TILE; s_first < kv_seq; s_first += groups * TC_TILE) {
        const bool first = s_first == group * TC_TILE;
        const i64 row0 = s_first + 16 * warp;
        const i64 key[2] = {row0 + g, row0 + g + 8};
        const i64 i_start = first_query_seeing(s_first, offset);

        // Query tile n goes into stage n & 1: tile n + 1 is staged while tile n is multiplied.
        // The key tile (for dQ's products) goes in with the first.
        stage_tile<D>(k_tile, k, b, h, s_first, kv_seq, kv_seq, in.stride);
        stage_query_tile<D>(stages[0], stages[0] + TILE_ELEMS, lse_tiles[0], delta_tiles[0], q, dout, lse_bh, delta_bh,
                            !first, b, h, i_start, q_seq, heads, in.stride);
        cp_async_commit();
        unsigned int ka[D / 16][4], va[D / 16][4];
        load_a_rows<D>(ka, k, b, h, row0, kv_seq, kv_seq, in.stride, in.cos, in.sin);
        load_a_rows<D>(va, v, b, h, row0, kv_seq, kv_seq, in.stride);
        float acc_k[D / 8][4], acc_v[D / 8][4];
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            acc_k[nd][0] = acc_k[nd][1] = acc_k[nd][2] = acc_k[nd][3] = 0.0f;
            acc_v[nd][0] = acc_v[nd][1] = acc_v[nd][2] = acc_v[nd][3] = 0.0f;
        }

        int buf = 0;
        for (i64 i0 = i_start; i0 < q_seq; i0 += TC_TILE, buf ^= 1) {
            bf16_t* q_tile = stages[buf];
            bf16_t* do_tile = stages[buf] + TILE_ELEMS;
            if (i0 + TC_TILE < q_seq) {
                stage_query_tile<D>(stages[buf ^ 1], stages[buf ^ 1] + TILE_ELEMS, lse_tiles[buf ^ 1],
                                    delta_tiles[buf ^ 1], q, dout, lse_bh, delta_bh, !first, b, h, i0 + TC_TILE, q_seq,
                                    heads, in.stride);
            }
            wait_for_tile();
            if (in.cos) {
                rotate_tile<D>(q_tile, i0, q_seq, in.cos, in.sin);
                if (i0 == i_start) rotate_tile<D>(k_tile, s_first, kv_seq, in.cos, in.sin);
                __syncthreads();
            }
            if (first) {
                delta_rows<D>(delta_tiles[buf], delta_bh, do_tile, out, b, h, i0, q_seq, heads);
                __syncthreads();
            }
            // Warp-uniform: only where the warp has keys and some query of the tile sees one.
            const bool seen = row0 < kv_seq && i0 + TC_TILE - 1 + offset >= row0;
            float ds[8][4];
            if (seen) {
                dkv_tile<D>(ka, va, q_tile, do_tile, lse_tiles[buf], delta_tiles[buf], i0, q_seq, kv_seq, key,
                            row0 + 15, scale * LOG2E, acc_k, acc_v, ds);
            }
            float dq_acc[D / 8][4];
            load_dq_partial<D>(dq_acc, dq_bh, i0, q_seq, first);
            __syncthreads();  // every warp is done with the stage's Q and dO: dSᵀ goes over them
            bf16_t* ds_tile = DS_ELEMS > STAGE ? ds_own : q_tile;
            store_ds(ds_tile, ds, seen);
            __syncthreads();
            dq_update<D>(dq_acc, dq_bh, ds_tile, k_tile, i0, q_seq);
            __syncthreads();  // every warp is done with the stage before the tile after next goes into it
        }
        // dk rotated back by RoPE's tables when given (dv never: v is not rotated), each key at its own position.
        store_rows<D>(acc_k, scale, RowsOut{dk, dk_bf16, grad_stride, cos_table, sin_table}, b, h, row0, kv_seq, kv_seq,
                      0);
        store_rows<D>(acc_v, 1.0f, RowsOut{dv, dv_bf16, grad_stride, nullptr, nullptr}, b, h, row0, kv_seq, kv_seq, 0);
    }
}

// dq = scale · Σ_g dq_part[g] (the groups in order, each from its first key tile's first
// query on: the rows it wrote), stored as the backward's other gradients are (store_rows:
// rotated back by RoPE's tables when given). One block per 64 queries of one (b, h), grid
// (⌈Tq/64⌉, B·H), a warp per 16 rows, as the forward.
template <int D>
__device__ __forceinline__ void attention_mma_backward_dq_finish(const float* dq_part, i64 groups, float* dq,
                                                                 bf16_t* dq_bf16, i64 grad_stride,
                                                                 const float* cos_table, const float* sin_table,
                                                                 i64 q_seq, i64 kv_seq, i64 heads, float scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 bh = blockIdx.y, heads_total = gridDim.y, b = bh / heads, h = bh % heads;
    const i64 row0 = (i64)blockIdx.x * TC_ROWS + 16 * warp;
    const i64 offset = kv_seq - q_seq;
    float acc[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    for (i64 group = 0; group < groups; ++group) {
        const i64 first_row = first_query_seeing(group * TC_TILE, offset);
        const float* part = dq_part + (group * heads_total + bh) * q_seq * D;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const i64 row = row0 + g + 8 * half;
            if (row >= q_seq || row < first_row) continue;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                const f32x2 p = *reinterpret_cast<const f32x2*>(part + row * D + 8 * nd + 2 * t);
                acc[nd][2 * half] += p.v[0];
                acc[nd][2 * half + 1] += p.v[1];
            }
        }
    }
    store_rows<D>(acc, scale, RowsOut{dq, dq_bf16, grad_stride, cos_table, sin_table}, b, h, row0, q_seq, q_seq, offset);
}

// ---------------------------------------------------------------------------------------
// One entry point per kernel and supported head dim (attention.rs picks by D). Every one takes
// its inputs' RowsIn after q, k and v (the f32 ones dense and unrotated: attention.rs passes
// RoPE's tables only beside bf16 inputs).
#define MMA_IN_PARAMS i64 in_stride, const float *in_cos, const float *in_sin
#define MMA_IN_ARGS RowsIn{in_stride, in_cos, in_sin}

#define MMA_FORWARD_PARAMS \
    const float *q, const float *k, const float *v, MMA_IN_PARAMS, float *out, bf16_t *out_bf16, float *lse, i64 q_seq, i64 kv_seq, \
        i64 heads, float scale
#define MMA_FORWARD_BF16_PARAMS \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, MMA_IN_PARAMS, float *out, bf16_t *out_bf16, float *lse, i64 q_seq, \
        i64 kv_seq, i64 heads, float scale
#define MMA_FORWARD_ARGS q, k, v, MMA_IN_ARGS, out, out_bf16, lse, q_seq, kv_seq, heads, scale
#define MMA_BACKWARD_TAIL                                                                                         \
    const float *lse, float *delta_part, float *dq_part, float *dk, bf16_t *dk_bf16, float *dv, bf16_t *dv_bf16,    \
        i64 grad_stride, const float *cos_table, const float *sin_table, i64 q_seq, i64 kv_seq, i64 heads, float scale
#define MMA_BACKWARD_PARAMS \
    const float *q, const float *k, const float *v, MMA_IN_PARAMS, const float *out, const float *dout, MMA_BACKWARD_TAIL
#define MMA_BACKWARD_BF16_PARAMS \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, MMA_IN_PARAMS, const bf16_t *out, const float *dout, MMA_BACKWARD_TAIL
#define MMA_BACKWARD_DOUT_BF16_PARAMS                                                                             \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, MMA_IN_PARAMS, const bf16_t *out, const bf16_t *dout,          \
        MMA_BACKWARD_TAIL
#define MMA_BACKWARD_ARGS                                                                                        \
    q, k, v, MMA_IN_ARGS, out, dout, lse, delta_part, dq_part, dk, dk_bf16, dv, dv_bf16, grad_stride, cos_table,      \
        sin_table, q_seq, kv_seq, heads, scale
#define MMA_DQ_FINISH_PARAMS                                                                                      \
    const float *dq_part, i64 groups, float *dq, bf16_t *dq_bf16, i64 grad_stride, const float *cos_table,            \
        const float *sin_table, i64 q_seq, i64 kv_seq, i64 heads, float scale
#define MMA_DQ_FINISH_ARGS dq_part, groups, dq, dq_bf16, grad_stride, cos_table, sin_table, q_seq, kv_seq, heads, scale

extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_forward_d16(MMA_FORWARD_PARAMS) { attention_mma_forward<16>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_forward_d32(MMA_FORWARD_PARAMS) { attention_mma_forward<32>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_forward_d48(MMA_FORWARD_PARAMS) { attention_mma_forward<48>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS, 3) attention_mma_forward_d64(MMA_FORWARD_PARAMS) { attention_mma_forward<64>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_forward_bf16_d16(MMA_FORWARD_BF16_PARAMS) { attention_mma_forward<16>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS, 4) attention_mma_forward_bf16_d32(MMA_FORWARD_BF16_PARAMS) { attention_mma_forward<32>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_forward_bf16_d48(MMA_FORWARD_BF16_PARAMS) { attention_mma_forward<48>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS, 3) attention_mma_forward_bf16_d64(MMA_FORWARD_BF16_PARAMS) { attention_mma_forward<64>(MMA_FORWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_d16(MMA_BACKWARD_PARAMS) { attention_mma_backward<16>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_d32(MMA_BACKWARD_PARAMS) { attention_mma_backward<32>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_d48(MMA_BACKWARD_PARAMS) { attention_mma_backward<48>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_d64(MMA_BACKWARD_PARAMS) { attention_mma_backward<64>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_d16(MMA_BACKWARD_BF16_PARAMS) { attention_mma_backward<16>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_d32(MMA_BACKWARD_BF16_PARAMS) { attention_mma_backward<32>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_d48(MMA_BACKWARD_BF16_PARAMS) { attention_mma_backward<48>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_d64(MMA_BACKWARD_BF16_PARAMS) { attention_mma_backward<64>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_dout_bf16_d16(MMA_BACKWARD_DOUT_BF16_PARAMS) { attention_mma_backward<16>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_dout_bf16_d32(MMA_BACKWARD_DOUT_BF16_PARAMS) { attention_mma_backward<32>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_dout_bf16_d48(MMA_BACKWARD_DOUT_BF16_PARAMS) { attention_mma_backward<48>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_bf16_dout_bf16_d64(MMA_BACKWARD_DOUT_BF16_PARAMS) { attention_mma_backward<64>(MMA_BACKWARD_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_dq_finish_d16(MMA_DQ_FINISH_PARAMS) { attention_mma_backward_dq_finish<16>(MMA_DQ_FINISH_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_dq_finish_d32(MMA_DQ_FINISH_PARAMS) { attention_mma_backward_dq_finish<32>(MMA_DQ_FINISH_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_dq_finish_d48(MMA_DQ_FINISH_PARAMS) { attention_mma_backward_dq_finish<48>(MMA_DQ_FINISH_ARGS); }
extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_mma_backward_dq_finish_d64(MMA_DQ_FINISH_PARAMS) { attention_mma_backward_dq_finish<64>(MMA_DQ_FINISH_ARGS); }
