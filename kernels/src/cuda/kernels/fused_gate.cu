// The fused gated projection, Transponder eq. 8-10 (cpu/fused_gate.rs):
//
//   [Z | U_c | U_s] = x · [W; A_c; A_s]ᵀ                                  (eq. 8, one GEMM)
//   γ_c = σ̃_αc(φ(U_c + a_c)·B_cᵀ + b_c),  γ_s = σ̃_αs(φ(U_s + a_s)·B_sᵀ + b_s)   (eq. 9)
//   Ẑ   = γ_c ⊙ γ_s ⊙ Z                                                    (eq. 10)
//
// σ̃_α(z) = 2σ(αz). N rows, d_in, d_out, ranks rc and rs (r = rc + rs), K = d_out + r.
// The concatenated weight is stored row-major as [K, d_in] bf16 (W's rows, then A_c's, then
// A_s's), which is exactly the "col" B operand of mma.sync.
//
// fused_gate_mma_r{16,32,64} (Ẑ in f32) and fused_gate_mma_bf16_out_r{16,32,64} (Ẑ in bf16):
// a bf16 tensor-core GEMM (mma.sync.m16n8k16, f32 accumulate) over the concatenated weight.
// A block owns a BM × BN tile of Z and also computes the r summary columns U for its BM rows
// (redundantly across column blocks: r/BN extra work), so the epilogue has everything the
// gate needs: it computes H = φ(U + a), γ_s per row and γ_c per element, and writes Ẑ. Z and
// U reach memory only when `zu` is given (training saves them for backward; inference passes
// null), rounded to bf16 as a bf16 GEMM's output (autocast's), the one copy of ZU the gate and
// its backward read. The main loop, as a tuned GEMM's: the x, W and A tiles of the next depth
// are copied into shared memory by cp.async (no registers on the way) while the warps multiply
// the current ones, two stages deep; the warps read their fragments from the tiles by ldmatrix
// (four 8 × 8 blocks an instruction), and the tiles' rows are XOR-swizzled so that those reads
// and the copies touch every bank once.
//
// fused_gate_apply: the same gate from a bf16 ZU computed by cuBLAS (the engine's path: measured
// faster than fused_gate_mma on an H200 on 2026-11-27, when the mma kernel's main loop staged
// its tiles through registers and read fragments one 32-bit load at a time, at a third of
// cuBLAS's speed; the pipelined main loop above is not yet timed), for a group of projections
// of one input at once. The backward
// kernel mirrors cpu/fused_gate.rs's row pass; its GEMMs and column sums run through cuBLAS
// and reduce.cu.

#define FG_BM 128        // rows of a block tile
#define FG_BN 128        // Z columns of a block tile
#define FG_BK 32         // depth of a shared-memory stage
#define FG_THREADS 256   // 8 warps: 2 along M (64 rows each) × 4 along N (32 columns each)
#define FG_MAX_RANK 64

struct alignas(16) u32x4 {
    unsigned int x, y, z, w;
};

// mma.sync.m16n8k16 bf16 × bf16 + f32. Fragments (PTX ISA "mma.m16n8k16", g = lane / 4,
// t = lane % 4): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]; d0,d1 = D[g][2t..2t+1], d2,d3 = D[g+8][2t..2t+1].
__device__ __forceinline__ void mma_bf16(float* d, const unsigned int* a, const unsigned int* b) {
    MMA_M16N8K16_BF16(d, a, b);
}

// 8 bf16 (16 bytes) of row `row`, columns col..col+7 of a row-major [rows, cols] matrix;
// zeros outside it, one by one (rows of any width).
__device__ __forceinline__ u32x4 load_chunk(const bf16_t* base, i64 rows, i64 cols, i64 row, i64 col) {
    unsigned int e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = row < rows && col + i < cols ? (unsigned int)base[row * cols + col + i] : 0u;
    return u32x4{e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16)};
}

// A shared tile's row holds FG_BK = 32 bf16: 64 bytes, four 16-byte chunks. Chunk c of row r
// sits at chunk c ^ ((r / 2) % 4) of its row, so the 8 rows an ldmatrix block reads (one
// chunk each, 8 consecutive rows: two rows per 128 bytes of banks) land in 8 distinct
// 16-byte bank groups, as do a warp's copies. The offset, in bf16, of (row, chunk):
__device__ __forceinline__ int fg_swizzled(int row, int chunk) { return row * FG_BK + ((chunk ^ ((row >> 1) & 3)) << 3); }

// 16 bytes of row `row`, columns col..col+7 of a row-major [rows, cols] bf16 matrix into the
// shared chunk `dst`, zeros outside it. `vec` (cols % 8 == 0: in-bounds chunks are 16-byte
// aligned and whole) by cp.async, in flight until waited for; otherwise loaded value by value
// and stored at once (a width the engine's presets never have).
__device__ __forceinline__ void fg_copy_chunk(bf16_t* dst, const bf16_t* src, i64 rows, i64 cols, i64 row, i64 col,
                                              bool vec) {
    if (vec) {
        const bool in = row < rows && col < cols;
        cp_async(dst, in ? src + row * cols + col : src, 16, in ? 16 : 0);
    } else {
        *reinterpret_cast<u32x4*>(dst) = load_chunk(src, rows, cols, row, col);
    }
}

// One stage of shared tiles: x [BM][BK], W [BN][BK] and A [RU][BK] (the r rows of A_c and
// A_s, zeros past r), each row swizzled. The block's shared memory is dynamic, BYTES of it
// (mma_shared_bytes in cuda/fused_gate/mod.rs): one allocation for every instantiation.
template <int RU>
struct FgShared {
    static const int STAGE = (FG_BM + FG_BN + RU) * FG_BK;                  // bf16 values
    static const int MAIN_BYTES = 2 * STAGE * 2;                              // two stages
    static const int HS = RU + 4;  // f32 row stride of H: 16-byte rows, 8 rows in distinct bank groups
    static const int EPILOGUE_BYTES = (FG_BM * HS + FG_BM) * 4;               // H [BM][HS] and γ_s [BM]
    static const int BYTES = MAIN_BYTES > EPILOGUE_BYTES ? MAIN_BYTES : EPILOGUE_BYTES;
};

// Issues the copies of the stage at depth k0 into `stage`: two chunks of the x tile and two
// of the W tile per thread (128 rows × 4 chunks each), one chunk of the A tile for the first
// RU·4 threads.
template <int RU>
__device__ __forceinline__ void fg_stage(bf16_t* stage, const bf16_t* x, const bf16_t* cat_w, const bf16_t* u_weight,
                                         i64 rows, i64 d_in, i64 d_out, int r, i64 m0, i64 n0, i64 k0, bool vec) {
    const int tid = threadIdx.x;
    bf16_t* as = stage;
    bf16_t* bs = as + FG_BM * FG_BK;
    bf16_t* us = bs + FG_BN * FG_BK;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int chunk = tid + c * FG_THREADS, row = chunk >> 2, kc = chunk & 3;
        fg_copy_chunk(as + fg_swizzled(row, kc), x, rows, d_in, m0 + row, k0 + 8 * kc, vec);
        fg_copy_chunk(bs + fg_swizzled(row, kc), cat_w, d_out, d_in, n0 + row, k0 + 8 * kc, vec);
    }
    if (tid < RU * 4) fg_copy_chunk(us + fg_swizzled(tid >> 2, tid & 3), u_weight, r, d_in, tid >> 2, k0 + 8 * (tid & 3), vec);
}

// The A fragment (rows row0..row0+15, depth chunks kc, kc + 1 of a stage tile) by one
// ldmatrix_x4: lane l gives row row0 + l % 8 (+ 8 for blocks 1 and 3), chunk kc (+ 1 for
// blocks 2 and 3).
__device__ __forceinline__ void fg_a_fragment(unsigned int* frag, const bf16_t* tile, int row0, int kc) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(frag, tile + fg_swizzled(row0 + (lane & 7) + 8 * ((lane >> 3) & 1), kc + (lane >> 4)));
}

// The B fragments of two 8-column tiles, rows n0..n0+7 and n0+8..n0+15 of a stage tile (B's
// columns: B[k][n] = tile[n][k]), depth chunks kc, kc + 1: frag[0], frag[1] for the first,
// frag[2], frag[3] for the second.
__device__ __forceinline__ void fg_b_fragments(unsigned int* frag, const bf16_t* tile, int n0, int kc) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(frag, tile + fg_swizzled(n0 + (lane & 7) + 8 * (lane >> 4), kc + ((lane >> 3) & 1)));
}

// The warps' products of one stage: acc (the warp's 64 × 32 tile of Z) and acc_u (its 16 rows
// warp·16.. of the block × all RU summary columns), each summing its depth in order.
template <int RU>
__device__ __forceinline__ void fg_multiply(const bf16_t* stage, float (*acc)[4][4], float (*acc_u)[4]) {
    const int warp = threadIdx.x >> 5, warp_m = warp >> 2, warp_n = warp & 3;
    const bf16_t* as = stage;
    const bf16_t* bs = as + FG_BM * FG_BK;
    const bf16_t* us = bs + FG_BN * FG_BK;
#pragma unroll
    for (int kc = 0; kc < FG_BK / 8; kc += 2) {
        unsigned int af[4][4], bf[4][2];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) fg_a_fragment(af[mt], as, warp_m * 64 + mt * 16, kc);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            unsigned int b[4];
            fg_b_fragments(b, bs, warp_n * 32 + np * 16, kc);
            bf[2 * np][0] = b[0], bf[2 * np][1] = b[1], bf[2 * np + 1][0] = b[2], bf[2 * np + 1][1] = b[3];
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[mt][nt], af[mt], bf[nt]);
        // The summary columns: warp w owns rows 16w..16w+15 of the block, all RU columns.
        unsigned int au[4];
        fg_a_fragment(au, as, warp * 16, kc);
#pragma unroll
        for (int up = 0; up < RU / 16; ++up) {
            unsigned int bu[4];
            fg_b_fragments(bu, us, up * 16, kc);
            mma_bf16(acc_u[2 * up], au, bu);
            mma_bf16(acc_u[2 * up + 1], au, bu + 2);
        }
    }
}

// Channel ranks up to FG_REG_RANK (every preset's is 8) with rc % 4 == 0 take the gate
// kernels' register path: a thread keeps its columns' B_c weights in registers, loaded as
// 16-byte vectors (B_c is a whole device buffer, 16-byte aligned, and a column's rc weights
// start at a multiple of 4), and reads a row's h_c from shared memory 16 bytes at a time.
#define FG_REG_RANK 8

// Whether a channel rank takes the register path.
__device__ __forceinline__ bool register_rank(int rc) { return rc <= FG_REG_RANK && (rc & 3) == 0; }

// Column j's channel-gate bias b_c[j] and, on the register path, its B_c weights (zeros past
// rc, and everything zero when `column` is false: j is past the last column).
__device__ __forceinline__ void column_weight(const float* b_cw, const float* b_cb, i64 j, bool column, int rc,
                                              bool regs, float (&w)[FG_REG_RANK], float& bias) {
#pragma unroll
    for (int t = 0; t < FG_REG_RANK; ++t) w[t] = 0.0f;
    bias = column ? b_cb[j] : 0.0f;
    if (!regs || !column) return;
#pragma unroll
    for (int t = 0; t < FG_REG_RANK; t += 4) {
        if (t >= rc) break;
        const f32x4 w4 = *reinterpret_cast<const f32x4*>(b_cw + j * rc + t);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[t + k] = w4.v[k];
    }
}

// On the register path, a row's h_c[0..FG_REG_RANK) from shared memory (h, 16-byte aligned)
// into registers, 16 bytes at a time, zeros past rc (h holds H_s there).
__device__ __forceinline__ void register_hidden(const float* h, int rc, float (&hc)[FG_REG_RANK]) {
#pragma unroll
    for (int t = 0; t < FG_REG_RANK; t += 4) {
        const f32x4 h4 = t < rc ? *reinterpret_cast<const f32x4*>(h + t) : f32x4{};
#pragma unroll
        for (int k = 0; k < 4; ++k) hc[t + k] = h4.v[k];
    }
}

// On the register path, a column's channel-gate logit before its bias, Σ_t h_c[t]·B_c[j, t]
// added in order (as channel_logit), from the row's h_c and the column's weights w, both in
// registers.
__device__ __forceinline__ float register_logit(const float (&hc)[FG_REG_RANK], const float (&w)[FG_REG_RANK],
                                                int rc) {
    float logit = 0.0f;
#pragma unroll
    for (int t = 0; t < FG_REG_RANK; t += 4) {
        if (t >= rc) break;
#pragma unroll
        for (int k = 0; k < 4; ++k) logit += hc[t + k] * w[t + k];
    }
    return logit;
}

// Column j's channel-gate logit before its bias, Σ_t h_c[t]·B_c[j, t] added in order (as
// channel_logit), off the register path: the row's h_c in shared memory (h) and the column's
// B_c row read from global memory (b_cw) one value at a time. On the register path a kernel
// reads a row's h_c into registers once (register_hidden) for all its columns' logits
// (register_logit): the same sums.
__device__ __forceinline__ float column_logit(const float* h, const float* b_cw, i64 j, int rc) {
    float logit = 0.0f;
    const float* column = b_cw + j * rc;
    for (int t = 0; t < rc; ++t) logit += h[t] * column[t];
    return logit;
}

// The register path's logits for two columns (weights w[0], w[1]), the same sums,
// each 16 bytes of the row's h_c (16-byte aligned) read once for both. Not register_hidden
// then register_logit twice: in fused_gate_mma's epilogue, that took ptxas from 128 to 148
// registers (r32) and the kernel from 7,384 to 10,512 instructions.
__device__ __forceinline__ void register_logit_pair(const float* h, const float (&w)[2][FG_REG_RANK], int rc,
                                                    float& logit0, float& logit1) {
#pragma unroll
    for (int t = 0; t < FG_REG_RANK; t += 4) {
        if (t >= rc) break;
        const f32x4 h4 = *reinterpret_cast<const f32x4*>(h + t);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            logit0 += h4.v[k] * w[0][t + k];
            logit1 += h4.v[k] * w[1][t + k];
        }
    }
}

// One row's scalar-gate logit l_s = B_s·H_s + b_s from its H (h[rc..rc + rs)), added in order.
__device__ __forceinline__ float scalar_logit(const float* h, const float* b_sw, const float* b_sb, int rc, int rs) {
    float logit = 0.0f;
    for (int t = 0; t < rs; ++t) logit += b_sw[t] * h[rc + t];
    return logit + b_sb[0];
}

// One row's scalar gate γ_s = 2σ(α_s·l_s).
__device__ __forceinline__ float scalar_gate(const float* h, const float* b_sw, const float* b_sb, float alpha_s,
                                             int rc, int rs) {
    return 2.0f * sigmoid_f(alpha_s * scalar_logit(h, b_sw, b_sb, rc, rs));
}

// One gated output Ẑ = σ̃_αc(logit + b_c)·(2γ_s)·z = 2σ(α_c(logit + b_c))·γ_s·z from column j's
// channel logit before its bias, its bias, the row's doubled scalar gate `scale` and its z:
// gate_apply's and fused_gate_add_rms_norm's arithmetic, one function so both give the same bits.
__device__ __forceinline__ float gated_value(float logit, float bias, float alpha_c, float scale, float z) {
    return sigmoid_f(alpha_c * (logit + bias)) * scale * z;
}

// A row's columns col and col + apart (`second`: the second is a column; apart is 1, adjacent
// columns, except for a RoPE pair of one head: gate_apply's rotary epilogue) as one 8-byte store
// where `pairs` (adjacent columns and an even row width: every pair is 8-byte aligned in a
// whole device buffer), else one by one: the fragment epilogue's stores, so that a warp's store
// fills whole 32-byte sectors.
__device__ __forceinline__ void store_pair(float* p, float v0, float v1, bool second, bool pairs, i64 apart = 1) {
    if (second && pairs) {
        *reinterpret_cast<f32x2*>(p) = f32x2{{v0, v1}};
    } else {
        p[0] = v0;
        if (second) p[apart] = v1;
    }
}

// store_pair rounded to bf16: one 4-byte store when `pairs` (p on a 4-byte boundary).
__device__ __forceinline__ void store_pair(bf16_t* p, float v0, float v1, bool second, bool pairs, i64 apart = 1) {
    if (second && pairs) {
        *reinterpret_cast<unsigned int*>(p) = bf16x2(v0, v1);
    } else {
        p[0] = f32_to_bf16(v0);
        if (second) p[apart] = f32_to_bf16(v1);
    }
}

// One block: rows m0..m0+BM, Z columns n0..n0+BN, plus all r summary columns; Ẑ in `Out`
// (float or bf16_t).
template <int RU, typename Out>
__device__ __forceinline__ void fused_gate_mma(const bf16_t* x, const bf16_t* cat_w, const float* a_c, const float* b_cw,
                                               const float* b_cb, float alpha_c, const float* a_s, const float* b_sw,
                                               const float* b_sb, float alpha_s, int phi, float phi_p, i64 rows,
                                               i64 d_in, i64 d_out, int rc, int rs, bf16_t* zu, Out* out) {
    DYNAMIC_SHARED(u32x4, mma_shared);
    unsigned char* smem = reinterpret_cast<unsigned char*>(mma_shared);
    const int r = rc + rs;
    const i64 width = d_out + r;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int warp_m = warp >> 2, warp_n = warp & 3;
    const i64 m0 = (i64)blockIdx.y * FG_BM, n0 = (i64)blockIdx.x * FG_BN;
    const bool vec = (d_in & 7) == 0;
    const bf16_t* u_weight = cat_w + d_out * d_in;
    bf16_t* stages = reinterpret_cast<bf16_t*>(smem);

    float acc[4][4][4];
    float acc_u[RU / 8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < RU / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_u[i][e] = 0.0f;

    // Depth step i goes into stage i & 1: step i + 1 is in flight while step i is multiplied.
    fg_stage<RU>(stages, x, cat_w, u_weight, rows, d_in, d_out, r, m0, n0, 0, vec);
    cp_async_commit();
    int s = 0;
    for (i64 k0 = 0; k0 < d_in; k0 += FG_BK, s ^= 1) {
        if (k0 + FG_BK < d_in) {
            fg_stage<RU>(stages + (s ^ 1) * FgShared<RU>::STAGE, x, cat_w, u_weight, rows, d_in, d_out, r, m0, n0,
                         k0 + FG_BK, vec);
        }
        // The next step's copies (or none) form one group; every earlier group, this step's, is
        // waited for; the barrier makes every thread's copies visible to the block.
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        fg_multiply<RU>(stages + s * FgShared<RU>::STAGE, acc, acc_u);
        __syncthreads();  // every warp is done with stage s before the step after next goes into it
    }

    // Epilogue. The shared tiles are free (the loop ended on a barrier, no copy is in flight);
    // reuse them for H [BM][HS] (f32) and the per-row scalar gate.
    const int hs = FgShared<RU>::HS;
    float* h = reinterpret_cast<float*>(smem);
    float* gate_s = h + FG_BM * hs;
#pragma unroll
    for (int ut = 0; ut < RU / 8; ++ut) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int row = warp * 16 + g + (e >= 2 ? 8 : 0);
            int col = ut * 8 + 2 * t4 + (e & 1);
            h[row * hs + col] = acc_u[ut][e];
            // U is saved once, by the first column block.
            if (zu && blockIdx.x == 0 && col < r && m0 + row < rows) {
                zu[(m0 + row) * width + d_out + col] = f32_to_bf16(acc_u[ut][e]);
            }
        }
    }
    __syncthreads();
    // H = φ(U + a)
    for (int e = tid; e < FG_BM * r; e += FG_THREADS) {
        int row = e / r, t = e % r;
        float bias = t < rc ? a_c[t] : a_s[t - rc];
        h[row * hs + t] = unary_f(phi, h[row * hs + t] + bias, phi_p);
    }
    __syncthreads();
    // γ_s = 2σ(α_s·(B_s·H_s + b_s)) per row
    if (tid < FG_BM) gate_s[tid] = scalar_gate(h + tid * hs, b_sw, b_sb, alpha_s, rc, rs);
    __syncthreads();
    // Ẑ = σ(α_c·(H_c·B_cᵀ + b_c))·2·γ_s·Z. Per row of its fragment a thread holds two adjacent
    // columns (2·t4, 2·t4 + 1): it computes both columns' logits from the row's H and writes
    // the pair as one 8-byte store, so each store of a warp fills whole 32-byte sectors (8 rows
    // × 4 threads × 8 bytes) instead of half of each.
    const bool pairs_out = (d_out & 1) == 0;
    const bool pairs_zu = zu && (width & 1) == 0;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const i64 col = n0 + warp_n * 32 + nt * 8 + 2 * t4;
        if (col >= d_out) continue;
        const bool second = col + 1 < d_out;
        const i64 col1 = second ? col + 1 : col;  // a real column to read when the pair is cut
        // The pair's weights (in registers on the register path) and biases, then its logits
        // for the thread's 8 rows, in the apply kernel's order. The register path reads each
        // row's h_c 16 bytes at a time: the 8 rows a warp reads at once sit in distinct bank
        // groups (hs·4 bytes ≡ 16 mod 128), and the 4 lanes of a row read one address.
        const bool regs = register_rank(rc);
        float w[2][FG_REG_RANK], bias[2];
        column_weight(b_cw, b_cb, col, true, rc, regs, w[0], bias[0]);
        column_weight(b_cw, b_cb, col1, true, rc, regs, w[1], bias[1]);
        float logit[2][8];
#pragma unroll
        for (int i = 0; i < 8; ++i) logit[0][i] = logit[1][i] = 0.0f;
        if (regs) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float* h_row = h + (warp_m * 64 + (i >> 1) * 16 + g + (i & 1) * 8) * hs;
                register_logit_pair(h_row, w, rc, logit[0][i], logit[1][i]);
            }
        } else {
            for (int t = 0; t < rc; ++t) {
                const float w0 = b_cw[col * rc + t], w1 = b_cw[col1 * rc + t];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float hv = h[(warp_m * 64 + (i >> 1) * 16 + g + (i & 1) * 8) * hs + t];
                    logit[0][i] += hv * w0;
                    logit[1][i] += hv * w1;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int row_local = warp_m * 64 + (i >> 1) * 16 + g + (i & 1) * 8;
            const i64 row = m0 + row_local;
            if (row >= rows) continue;
            const float scale = 2.0f * gate_s[row_local];
            const float z0 = acc[i >> 1][nt][(i & 1) * 2], z1 = acc[i >> 1][nt][(i & 1) * 2 + 1];
            const float y0 = sigmoid_f(alpha_c * (logit[0][i] + bias[0])) * scale * z0;
            const float y1 = sigmoid_f(alpha_c * (logit[1][i] + bias[1])) * scale * z1;
            store_pair(out + row * d_out + col, y0, y1, second, pairs_out);
            if (zu) store_pair(zu + row * width + col, z0, z1, second, pairs_zu);
        }
    }
}

#define FG_PARAMS                                                                                                   \
    const bf16_t *x, const bf16_t *cat_w, const float *a_c, const float *b_cw, const float *b_cb,                   \
        const float *alpha_c, const float *a_s, const float *b_sw, const float *b_sb, const float *alpha_s, int phi, \
        float phi_p, i64 rows, i64 d_in, i64 d_out, int rc, int rs, bf16_t *zu, float *out
#define FG_BF16_OUT_PARAMS                                                                                          \
    const bf16_t *x, const bf16_t *cat_w, const float *a_c, const float *b_cw, const float *b_cb,                   \
        const float *alpha_c, const float *a_s, const float *b_sw, const float *b_sb, const float *alpha_s, int phi, \
        float phi_p, i64 rows, i64 d_in, i64 d_out, int rc, int rs, bf16_t *zu, bf16_t *out
// α_c and α_s are one-element device buffers (no host read-back of a learnable α).
#define FG_ARGS \
    x, cat_w, a_c, b_cw, b_cb, *alpha_c, a_s, b_sw, b_sb, *alpha_s, phi, phi_p, rows, d_in, d_out, rc, rs, zu, out

// Grid (⌈d_out/BN⌉, ⌈N/BM⌉), 256 threads; the suffix is the padded rank (r ≤ suffix).
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_r16(FG_PARAMS) { fused_gate_mma<16>(FG_ARGS); }
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_r32(FG_PARAMS) { fused_gate_mma<32>(FG_ARGS); }
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_r64(FG_PARAMS) { fused_gate_mma<64>(FG_ARGS); }
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_bf16_out_r16(FG_BF16_OUT_PARAMS) { fused_gate_mma<16>(FG_ARGS); }
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_bf16_out_r32(FG_BF16_OUT_PARAMS) { fused_gate_mma<32>(FG_ARGS); }
extern "C" __global__ void __launch_bounds__(FG_THREADS) fused_gate_mma_bf16_out_r64(FG_BF16_OUT_PARAMS) { fused_gate_mma<64>(FG_ARGS); }

// The grouped kernels below (fused_gate_apply and fused_gate_backward_rows) serve a group of
// projections of one input at once (q, k and v; gate and up), each with its own weights and
// modulators: the GEMM's ZU rows hold the groups' [Z_g | U_cg | U_sg] side by side
// (zu_width columns in all) and the outputs their Ẑ_g side by side (out_width columns).
// Both are column-stationary: a thread owns output columns (a pair of adjacent ones in the
// apply, one in the backward), keeps their B_c weights and b_c in registers while it walks
// a block of rows, and reads each row's H and γ_s, which the block computes once into
// shared memory, as broadcasts.

// One projection of a grouped launch (group_lists in cuda/fused_gate/mod.rs): its modulators'
// parameters (params.v[8g ..]: a_c, B_c, b_c, α_c, a_s, B_s, b_s, α_s; α as one-element device
// buffers) and its place (layout.v[3g ..]: its first ZU column, its first output column, its
// d_out).
struct GateGroup {
    const float *a_c, *b_cw, *b_cb, *alpha_c, *a_s, *b_sw, *b_sb, *alpha_s;
    i64 zu_at, out_at, d_out;
};

__device__ __forceinline__ GateGroup gate_group(const TensorList& params, const TensorList& layout, int g) {
    const i64* p = params.v + 8 * g;
    return GateGroup{(const float*)p[0], (const float*)p[1], (const float*)p[2], (const float*)p[3],
                     (const float*)p[4], (const float*)p[5], (const float*)p[6], (const float*)p[7],
                     layout.v[3 * g],    layout.v[3 * g + 1], layout.v[3 * g + 2]};
}

// Rows row0 .. row0 + count of group g: each row's H = φ(U + a) from its ZU row into
// h[row] (the block's shared rows, 16-byte aligned); the block's threads split the count·r
// values. The caller puts a block barrier before (h free) and after (h written).
template <class Z>
__device__ __forceinline__ void block_hidden(f32x4 (*h)[FG_MAX_RANK / 4], const Z* zu, const GateGroup& g, int phi,
                                             float phi_p, i64 row0, int count, i64 zu_width, int rc, int rs) {
    const int r = rc + rs;
    for (int e = threadIdx.x; e < count * r; e += blockDim.x) {
        const int row = e / r, t = e % r;
        const float a = t < rc ? g.a_c[t] : g.a_s[t - rc];
        const Z* zr = zu + (row0 + row) * zu_width + g.zu_at;
        reinterpret_cast<float*>(h[row])[t] = unary_f(phi, as_f32(zr[g.d_out + t]) + a, phi_p);
    }
}

// fused_gate_apply's blocks (apply_blocks in cuda/fused_gate/mod.rs): block (x, y, g) serves
// column tile y of group g (FG_APPLY_TILE output columns, a pair of adjacent ones per thread;
// gate_apply's other pairings below) for row blocks x, x + gridDim.x, ... of FG_APPLY_ROWS
// rows each. It is column-
// stationary: a thread keeps its columns' B_c weights and b_c in registers for every row it
// serves, so B_c is read once per FG_APPLY_ROWS rows rather than once per row, and the block
// computes each row's H and γ_s once, into shared memory, where every thread reads them as a
// broadcast. Each thread issues the Z loads of FG_APPLY_CHUNK rows before it computes and
// stores their outputs, so that several loads per thread are in flight. __launch_bounds__ asks
// for 3 blocks an SM (24 warps, at most 85 registers a thread; ptxas: 80, no spill)
// rather than the 2 that its free choice of 107 registers allows: half again as many loads in
// flight for a memory-bound kernel (bench/kernel_resources.py shows the counts).
#define FG_APPLY_THREADS 256
#define FG_APPLY_BLOCKS_PER_SM 3
#define FG_APPLY_TILE (FG_APPLY_THREADS * 2)
#define FG_APPLY_ROWS 32
#define FG_APPLY_CHUNK 8

// A row's columns col and col + apart (`second`: the second is a column) as one load where
// `pairs` (adjacent columns, the pair on a boundary of its size, as store_pair's), else one by
// one; zero when not read.
__device__ __forceinline__ void load_pair(const float* p, bool second, bool pairs, i64 apart, float& v0, float& v1) {
    if (second && pairs) {
        const f32x2 q = *reinterpret_cast<const f32x2*>(p);
        v0 = q.v[0];
        v1 = q.v[1];
    } else {
        v0 = p[0];
        v1 = second ? p[apart] : 0.0f;
    }
}

// load_pair from bf16: one 4-byte load when `pairs`.
__device__ __forceinline__ void load_pair(const bf16_t* p, bool second, bool pairs, i64 apart, float& v0, float& v1) {
    if (second && pairs) {
        bf16x2_to_f32(*reinterpret_cast<const unsigned int*>(p), v0, v1);
    } else {
        v0 = bf16_to_f32(p[0]);
        v1 = second ? bf16_to_f32(p[apart]) : 0.0f;
    }
}

// How gate_apply pairs a thread's two columns, and what it writes:
//   APPLY_ADJACENT  columns j and j + 1 of one projection; Ẑ, f32 or bf16.
//   APPLY_ROTARY    a RoPE pair (i, i + D/2) of one head of attention's q, k or v (a group of
//                   three of H·D outputs each), written as attention reads them: each its own
//                   dense bf16 [N, H·D] (rope.outs.v[g]), q and k (groups 0 and 1) rotated by
//                   RoPE (rope.cu: token n at table row n % seq of cos and sin, [positions,
//                   D/2]) before they are rounded; what rope_rotate makes of the packed output,
//                   with no launch of its own and one rounding.
//   APPLY_SWIGLU    column j of the FFN's gate and of its up projection (a group of two of one
//                   d_out): Ẑ in bf16 (SwiGLU's backward reads it) and y = silu(ĝ)·û, bf16 into
//                   swiglu_out [N, d_out], from ĝ and û as stored (rounded), by common.cuh's
//                   swiglu_value, as swiglu.cu: the bits of the gate then swiglu_forward_bf16.
#define APPLY_ADJACENT 0
#define APPLY_ROTARY 1
#define APPLY_SWIGLU 2

// APPLY_ROTARY's outputs and tables.
struct RotaryQkv {
    const TensorList* outs;
    const float* cos;
    const float* sin;
    i64 seq, head_dim;
};

// The gate alone, from a saved ZU: out = σ̃_αc(H_c·B_cᵀ + b_c) ⊙ γ_s ⊙ Z for every group
// (the second half of the cuBLAS path; the same arithmetic as fused_gate_mma's epilogue and in
// the same order, so the same bits as a row at a time), written as f32 or rounded to bf16 (O).
// A thread owns two columns, c = 0 and 1, paired as MODE says; each has its own group
// (gs[c]: both blockIdx.z's, except APPLY_SWIGLU's gate and up), column (j + c·apart) and that
// group's H and γ_s rows (part c of the shared rows when the groups differ).
template <class Z, class O, int MODE>
__device__ __forceinline__ void gate_apply(const Z* __restrict__ zu, const TensorList& params,
                                           const TensorList& layout, int phi, float phi_p, i64 rows, i64 zu_width,
                                           i64 out_width, int rc, int rs, O* __restrict__ out, const RotaryQkv& rope,
                                           bf16_t* __restrict__ swiglu_out) {
    constexpr int PARTS = MODE == APPLY_SWIGLU ? 2 : 1;  // groups a block reads
    const GateGroup gs[2] = {gate_group(params, layout, MODE == APPLY_SWIGLU ? 0 : blockIdx.z),
                             gate_group(params, layout, MODE == APPLY_SWIGLU ? 1 : blockIdx.z)};
    // Columns per block: a pair per thread of one projection, or one of each of two.
    const i64 d_out = gs[0].d_out, tile = (i64)blockIdx.y * (PARTS == 2 ? FG_APPLY_THREADS : FG_APPLY_TILE);
    if (tile >= d_out) return;  // the whole block: a tile past this group's columns
    __shared__ f32x4 h_quads[PARTS][FG_APPLY_ROWS][FG_MAX_RANK / 4];  // each row's H, 16-byte aligned
    __shared__ float scale_rows[PARTS][FG_APPLY_ROWS];               // each row's 2·γ_s
    __shared__ int table_rows[MODE == APPLY_ROTARY ? FG_APPLY_ROWS : 1];  // each row's RoPE table offset
    const float alpha_c[2] = {*gs[0].alpha_c, *gs[1].alpha_c};
    const bool regs = register_rank(rc);

    // This thread's columns, j of gs[0] and j + apart of gs[1] (the second sits zu_apart after
    // the first in a ZU row and out_apart after it in an output row), their weights (register
    // path) and biases.
    const i64 half = MODE == APPLY_ROTARY ? rope.head_dim / 2 : 1, pair = tile / 2 + threadIdx.x;
    i64 j, apart, zu_apart, out_apart;
    if (MODE == APPLY_ROTARY) {
        j = pair / half * rope.head_dim + pair % half;
        apart = zu_apart = out_apart = half;
    } else if (MODE == APPLY_SWIGLU) {
        j = tile + threadIdx.x;
        apart = 0;
        zu_apart = gs[1].zu_at - gs[0].zu_at;
        out_apart = gs[1].out_at - gs[0].out_at;
    } else {
        j = tile + 2 * threadIdx.x;
        apart = zu_apart = out_apart = 1;
    }
    const bool live = j < d_out, second = j + apart < gs[1].d_out;
    // Both columns' reads and writes as pairs when they are adjacent and every pair starts on
    // an even element.
    const bool pairs = MODE == APPLY_ADJACENT && ((zu_width | gs[0].zu_at | out_width | gs[0].out_at) & 1) == 0;
    float w[2][FG_REG_RANK], bias[2];
    column_weight(gs[0].b_cw, gs[0].b_cb, j, live, rc, regs, w[0], bias[0]);
    column_weight(gs[1].b_cw, gs[1].b_cb, j + apart, second, rc, regs, w[1], bias[1]);
    // Where the rows go, and whether they rotate (q and k: groups 0 and 1).
    O* dst = MODE == APPLY_ROTARY ? (O*)rope.outs->v[blockIdx.z] : out + gs[0].out_at;
    const i64 dst_width = MODE == APPLY_ROTARY ? d_out : out_width;
    const bool rotate = MODE == APPLY_ROTARY && blockIdx.z < 2;
    const int pair_at = MODE == APPLY_ROTARY ? (int)(pair % half) : 0;  // the pair's column in the table's rows

    for (i64 row0 = (i64)blockIdx.x * FG_APPLY_ROWS; row0 < rows; row0 += (i64)gridDim.x * FG_APPLY_ROWS) {
        const int count = (int)(rows - row0 < FG_APPLY_ROWS ? rows - row0 : FG_APPLY_ROWS);
        __syncthreads();  // every thread is done with the previous rows' H and γ_s
        for (int p = 0; p < PARTS; ++p) block_hidden(h_quads[p], zu, gs[p], phi, phi_p, row0, count, zu_width, rc, rs);
        __syncthreads();
        if (threadIdx.x < count) {
            for (int p = 0; p < PARTS; ++p) {
                const float* h = reinterpret_cast<const float*>(h_quads[p][threadIdx.x]);
                scale_rows[p][threadIdx.x] = 2.0f * scalar_gate(h, gs[p].b_sw, gs[p].b_sb, *gs[p].alpha_s, rc, rs);
            }
            // The row's position within its sequence: one 64-bit modulo per row, not per pair.
            // (Below 2³¹: a table of seq·D/2 floats; the launcher checks.)
            if (MODE == APPLY_ROTARY) table_rows[threadIdx.x] = (int)((row0 + threadIdx.x) % rope.seq * half);
        }
        __syncthreads();
        if (!live) continue;
        for (int c0 = 0; c0 < count; c0 += FG_APPLY_CHUNK) {
            float z[FG_APPLY_CHUNK][2];
#pragma unroll
            for (int k = 0; k < FG_APPLY_CHUNK; ++k) {
                z[k][0] = z[k][1] = 0.0f;
                const Z* zr = zu + (row0 + c0 + k) * zu_width + gs[0].zu_at + j;
                if (c0 + k < count) load_pair(zr, second, pairs, zu_apart, z[k][0], z[k][1]);
            }
#pragma unroll
            for (int k = 0; k < FG_APPLY_CHUNK; ++k) {
                if (c0 + k >= count) break;
                const i64 row = row0 + c0 + k;
                float y[2] = {0.0f, 0.0f};
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (c == 1 && !second) break;
                    const int part = PARTS == 2 ? c : 0;
                    const float* h = reinterpret_cast<const float*>(h_quads[part][c0 + k]);
                    // On the register path each column reads the row's h_c again (from shared
                    // memory): read once for both, ptxas keeps eight rows' h_c live under the
                    // 85-register bound and spills 100 bytes.
                    float hc[FG_REG_RANK];
                    if (regs) register_hidden(h, rc, hc);
                    const float logit =
                        regs ? register_logit(hc, w[c], rc) : column_logit(h, gs[c].b_cw, j + c * apart, rc);
                    y[c] = gated_value(logit, bias[c], alpha_c[c], scale_rows[part][c0 + k], z[k][c]);
                }
                if (rotate) {
                    const int at = table_rows[c0 + k] + pair_at;
                    rope_rotate_pair(y[0], y[1], rope.cos[at], rope.sin[at], 1.0f, y[0], y[1]);
                }
                store_pair(dst + row * dst_width + j, y[0], y[1], second, pairs, out_apart);
                if (MODE == APPLY_SWIGLU) {
                    // SwiGLU of ĝ and û as stored (rounded to bf16), as swiglu.cu reads them.
                    const float g = bf16_to_f32(f32_to_bf16(y[0])), u = bf16_to_f32(f32_to_bf16(y[1]));
                    swiglu_out[row * d_out + j] = f32_to_bf16(swiglu_value(g, u));
                }
            }
        }
    }
}

// No RoPE tables (every mode but APPLY_ROTARY).
#define NO_ROTARY RotaryQkv{nullptr, nullptr, nullptr, 1, 2}

extern "C" __global__ void __launch_bounds__(FG_APPLY_THREADS, FG_APPLY_BLOCKS_PER_SM)
    fused_gate_apply(const float* zu, TensorList params, TensorList layout, int phi, float phi_p, i64 rows,
                     i64 zu_width, i64 out_width, int rc, int rs, float* out) {
    gate_apply<float, float, APPLY_ADJACENT>(zu, params, layout, phi, phi_p, rows, zu_width, out_width, rc, rs, out,
                                             NO_ROTARY, nullptr);
}

// fused_gate_apply from a bf16 ZU (bf16 products).
extern "C" __global__ void __launch_bounds__(FG_APPLY_THREADS, FG_APPLY_BLOCKS_PER_SM)
    fused_gate_apply_bf16(const bf16_t* zu, TensorList params, TensorList layout, int phi, float phi_p, i64 rows,
                          i64 zu_width, i64 out_width, int rc, int rs, float* out) {
    gate_apply<bf16_t, float, APPLY_ADJACENT>(zu, params, layout, phi, phi_p, rows, zu_width, out_width, rc, rs, out,
                                              NO_ROTARY, nullptr);
}

// fused_gate_apply from a bf16 ZU into a bf16 output (for a consumer that reads bf16).
extern "C" __global__ void __launch_bounds__(FG_APPLY_THREADS, FG_APPLY_BLOCKS_PER_SM)
    fused_gate_apply_bf16_out(const bf16_t* zu, TensorList params, TensorList layout, int phi, float phi_p,
                              i64 rows, i64 zu_width, i64 out_width, int rc, int rs, bf16_t* out) {
    gate_apply<bf16_t, bf16_t, APPLY_ADJACENT>(zu, params, layout, phi, phi_p, rows, zu_width, out_width, rc, rs, out,
                                               NO_ROTARY, nullptr);
}

// Attention's gated q, k and v from a bf16 ZU into the bf16 outs.v[0..3] (APPLY_ROTARY), a
// group of three projections of H·D = head_dim·heads outputs each.
extern "C" __global__ void __launch_bounds__(FG_APPLY_THREADS, FG_APPLY_BLOCKS_PER_SM)
    fused_gate_apply_rotary_qkv(const bf16_t* zu, TensorList params, TensorList layout, int phi, float phi_p,
                                i64 rows, i64 zu_width, int rc, int rs, TensorList outs, const float* cos_table,
                                const float* sin_table, i64 seq, i64 head_dim) {
    const RotaryQkv rope{&outs, cos_table, sin_table, seq, head_dim};
    gate_apply<bf16_t, bf16_t, APPLY_ROTARY>(zu, params, layout, phi, phi_p, rows, zu_width, 0, rc, rs,
                                             (bf16_t*)nullptr, rope, nullptr);
}

// The FFN's gated gate and up projections from a bf16 ZU (APPLY_SWIGLU): Ẑ into `out`
// ([N, 2·d_out], bf16) and SwiGLU of its halves into swiglu_out ([N, d_out], bf16).
extern "C" __global__ void __launch_bounds__(FG_APPLY_THREADS, FG_APPLY_BLOCKS_PER_SM)
    fused_gate_apply_swiglu(const bf16_t* zu, TensorList params, TensorList layout, int phi, float phi_p, i64 rows,
                            i64 zu_width, i64 out_width, int rc, int rs, bf16_t* out, bf16_t* swiglu_out) {
    gate_apply<bf16_t, bf16_t, APPLY_SWIGLU>(zu, params, layout, phi, phi_p, rows, zu_width, out_width, rc, rs, out,
                                             NO_ROTARY, swiglu_out);
}

// The residual stream's add and the next RMSNorm of a gated projection's output (Transponder's
// o and down projections, a group of one, from a bf16 ZU): for each row, Ẑ as
// fused_gate_apply_bf16_out stores it (gated_value, rounded to bf16), then sum = x + Ẑ and
// y = rms_norm(sum)·w as add_rms_norm_forward_delta_bf16 computes them (warp_add_rms_norm_row,
// common.cuh): the bits of the two launches, without storing Ẑ or reading it back. A warp per
// row, 8 rows a block (norm.cu's launch); the block computes its rows' H into shared memory,
// then each lane its columns' channel logits, reading each column's B_c row (16-byte loads on
// the register path; the rows stay in L1 from row to row).
// sum, y (or y_bf16 alone) and rstd as add_rms_norm_forward writes them.
extern "C" __global__ void fused_gate_add_rms_norm(const bf16_t* zu, TensorList params, TensorList layout, int phi,
                                                   float phi_p, i64 rows, i64 zu_width, int rc, int rs, const float* x,
                                                   const float* w, float* sum, float* y, bf16_t* y_bf16, float* rstd,
                                                   float eps) {
    const GateGroup g = gate_group(params, layout, 0);
    const i64 cols = g.d_out;
    const float alpha_c = *g.alpha_c, alpha_s = *g.alpha_s;
    __shared__ f32x4 h_quads[NORM_ROW_LANES][FG_MAX_RANK / 4];  // each row's H, 16-byte aligned
    const bool regs = register_rank(rc);
    const int warp = threadIdx.x >> 5;
    const bool quads = (cols & 3) == 0 && is_aligned(x, 16) && is_aligned(w, 16) && is_aligned(sum, 16) &&
                       is_aligned(y, 16) && is_aligned(y_bf16, 8);
    for (i64 r0 = (i64)blockIdx.x * NORM_ROW_LANES; r0 < rows; r0 += (i64)gridDim.x * NORM_ROW_LANES) {
        __syncthreads();  // every warp is done with the previous rows' H
        const int count = rows - r0 < NORM_ROW_LANES ? (int)(rows - r0) : NORM_ROW_LANES;
        block_hidden(h_quads, zu, g, phi, phi_p, r0, count, zu_width, rc, rs);
        __syncthreads();
        const i64 r = r0 + warp;
        if (warp >= count) continue;  // warp-uniform; the next rows' barriers are the loop's top
        const float* h = reinterpret_cast<const float*>(h_quads[warp]);
        const float scale = 2.0f * scalar_gate(h, g.b_sw, g.b_sb, alpha_s, rc, rs);
        const bf16_t* zr = zu + r * zu_width + g.zu_at;
        const bool z_quads = quads && is_aligned(zr, 8);
        float hc[FG_REG_RANK];  // the row's h_c on the register path
        if (regs) register_hidden(h, rc, hc);
        const auto gated = [&](i64 j, float (&d)[4]) {
            float z[4];
            load_chunk(z, zr, j, cols, z_quads);
            for (int e = 0; e < 4; ++e) {
                d[e] = 0.0f;
                if (j + e >= cols) continue;
                float bw[FG_REG_RANK], bias;  // column j + e's B_c row (16-byte loads on the register path) and b_c
                column_weight(g.b_cw, g.b_cb, j + e, true, rc, regs, bw, bias);
                const float logit = regs ? register_logit(hc, bw, rc) : column_logit(h, g.b_cw, j + e, rc);
                d[e] = as_f32(f32_to_bf16(gated_value(logit, bias, alpha_c, scale, z[e])));
            }
        };
        warp_add_rms_norm_row(x + r * cols, gated, w, sum + r * cols, y ? y + r * cols : nullptr,
                              y_bf16 ? y_bf16 + r * cols : nullptr, rstd + r, cols, eps, quads);
    }
}

// fused_gate_backward_rows's blocks (backward_blocks in cuda/fused_gate/mod.rs): block (x, g)
// owns group g's rows [x·rows_per_block, (x + 1)·rows_per_block) and every column of them. It
// walks the columns in tiles of FG_BACK_TILE, one column per thread, and a tile's rows in
// blocks of FG_BACK_ROWS, whose H and γ_s it computes once into shared memory. A thread keeps
// its column's b_c in a register for the tile, and its sum over the block's rows of
// db_c = Σ_n dL_c[n, j], written once per tile as the block's term of that sum (a column sum
// over the blocks adds them up: no dL_c [N, d_out] is stored and read back); likewise the
// column's dB_c = Σ_n dL_c[n, j]·H_c[n, :]. The row sums over columns (dH_c = dL_c·B_c,
// d/dγ_s, dα_c) need a transpose: a thread holds a column, the sums run along a row. Two
// paths:
//
// - The tensor-core path, under bf16 products (dZU in bf16, read only by bf16 products) at
//   channel rank FG_REG_RANK = 8 (every preset's) on compute capability 8.0: a warp stages its
//   32 columns' dL_c of the row block's 16 rows in shared memory as bf16 in two parts (hi = dL
//   rounded, lo = the rest rounded) and multiplies them on the tensor cores: dH_c's share of
//   its columns is one 16 × 8 product over them (dL·B_c, mma.m16n8k16, B_c split alike and
//   held in registers for the tile), the columns' dB_c terms one 32 × 8 product over the 16
//   rows (dLᵀ·H_c, the same stage read transposed by ldmatrix), each as hi·hi + hi·lo + lo·hi
//   with f32 sums: within about 2⁻¹⁷ of each product (f32 sums of f32 products: 2⁻²⁴), far
//   below the bf16 roundings of the products around it. d/dγ_s and dα_c are staged in f32
//   and the warp's lanes add a chunk's rows across its 32 columns; then the 8 warps' shares of
//   a row are added in warp order. Per element that leaves the gate's own arithmetic, the
//   channel logit (8 FMAs) and the stores to the stage, where the path below spends 8 FMAs an
//   element on dB_c and, per warp and row, a share of dL·B_c with B_c read from L1 (32 bytes
//   an element).
// - Otherwise (f32 products: f32 sums throughout; other ranks; devices below 8.0): the threads
//   stage each element's three terms for FG_BACK_CHUNK rows in f32, then warp w sums row w's
//   over the tile's columns (tile_row_sums: a lane adds its eight columns' in order, then the
//   warp's lanes are summed once per 8 ranks); a thread adds its column's dB_c terms for the
//   first FG_REG_RANK ranks in registers and the rest in place in the block's terms. At ranks
//   of register_rank a thread holds its column's B_c in registers (the register path).
//
// Either way each row's sums go onto its sums of the earlier tiles (row_sums, the block's own
// rows). Every order of additions is fixed, there are no atomics, and a block reads back only
// what it wrote itself. A thread issues the dẐ and Z loads of FG_BACK_CHUNK rows before it
// computes them (8 rows: 16 warps an SM × 8 × 6 bytes a lane, 24 KB in flight). ptxas
// (bench/kernel_resources.py): 128 registers under the 2-blocks-an-SM bound, 16 warps an SM.
#define FG_BACK_THREADS 256
#define FG_BACK_WARPS (FG_BACK_THREADS / 32)
#define FG_BACK_TILE FG_BACK_THREADS
#define FG_BACK_ROWS 16
#define FG_BACK_CHUNK 8
static_assert(FG_BACK_CHUNK == FG_BACK_WARPS, "tile_row_sums gives each row of a chunk a warp");
static_assert(FG_BACK_ROWS % FG_BACK_CHUNK == 0, "a row block is whole chunks");
static_assert(FG_BACK_CHUNK % 8 == 0, "the tensor-core stage swizzles row c0 + k of a chunk by (k / 2) % 4");
static_assert(FG_BACK_ROWS == 16 && FG_BK == 32,
              "the tensor-core path's stage is one 16-row block of a warp's 32 columns");
// The terms a thread stages per element of a chunk for the row sums off the tensor-core path:
// dL_c, d/dγ_s's and dα_c's.
#define FG_BACK_STAGED 3
// The per-block sums of the summaries: r dU values, dα_c, dα_s, d/dl_s, then rs d/dl_s·H_s.
#define FG_BACK_TERMS (FG_MAX_RANK + 3 + FG_MAX_RANK)
// A row's sums on the tensor-core path, as a warp leaves its share: dH_c's FG_REG_RANK ranks,
// d/dγ_s, dα_c.
#define FG_BACK_ROW_TERMS (FG_REG_RANK + 2)
// The tensor-core path needs mma.sync (compute capability 8.0); below, every rank takes the
// other path.
#if defined(__CUDA_EMULATOR__) || __CUDA_ARCH__ >= 800
#define FG_BACK_TENSOR_CORES 1
#else
#define FG_BACK_TENSOR_CORES 0
#endif

// A warp's stage on the tensor-core path (gate_backward_rows_mma), in the kernel's dynamic
// shared memory: its 32 columns' dL_c for the row block's 16 rows, hi and lo parts
// (dl[part][row·32 + column], each row's four 16-byte chunks swizzled by fg_swizzled so that
// ldmatrix's 8 rows, read straight or transposed, touch every bank once), a chunk's d/dγ_s and
// dα_c terms ([row][term][column], rows padded to 36 floats so that the lanes' 16-byte reads
// of 16 different rows fall in different banks), and the warp's share of each row's sums.
struct BackwardWarpStage {
    bf16_t dl[2][FG_BACK_ROWS * FG_BK];
    float terms[FG_BACK_CHUNK][2][36];
    float row_terms[FG_BACK_ROWS][FG_BACK_ROW_TERMS];
};

// Sums each of v[0..8) over the warp's 32 lanes in 9 shuffles rather than 8 butterflies' 40:
// each step hands half of a lane's values to its partner and keeps the other half, so lane l
// ends with value (l >> 2) & 7's total (every lane returns one; the four lanes of a quad,
// l & ~3 to l | 3, the same). The order of additions is fixed.
__device__ __forceinline__ float warp_sum_eight(float (&v)[8]) {
    const int lane = threadIdx.x & 31;
    const bool up16 = lane & 16, up8 = lane & 8, up4 = lane & 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float give = up16 ? v[k] : v[k + 4], keep = up16 ? v[k + 4] : v[k];
        v[k] = keep + __shfl_xor_sync(FULL_MASK, give, 16);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const float give = up8 ? v[k] : v[k + 2], keep = up8 ? v[k + 2] : v[k];
        v[k] = keep + __shfl_xor_sync(FULL_MASK, give, 8);
    }
    const float give = up4 ? v[0] : v[1], keep = up4 ? v[1] : v[0];
    float total = keep + __shfl_xor_sync(FULL_MASK, give, 4);
    total += __shfl_xor_sync(FULL_MASK, total, 2);
    total += __shfl_xor_sync(FULL_MASK, total, 1);
    return total;
}

// a and b each summed over the warp in 5 shuffles (warp_sum_eight's first step, then a
// butterfly): lanes 0-15 get a's total, lanes 16-31 b's.
__device__ __forceinline__ float warp_sum_two(float a, float b) {
    const bool up16 = threadIdx.x & 16;
    float total = (up16 ? b : a) + __shfl_xor_sync(FULL_MASK, up16 ? a : b, 16);
    for (int o = 8; o > 0; o >>= 1) total += __shfl_xor_sync(FULL_MASK, total, o);
    return total;
}

// Off the tensor-core path, one row of a chunk's stage summed over the tile's columns by one
// warp: the row's dH_c[t] = Σ_c dL_c[c]·B_c[tile + c, t] (t < rc), d/dγ_s = Σ_c and
// dα_c = Σ_c of their terms, set into the row's sums (sums[t], sums[rc], sums[rc + 1]) on the
// first tile and added onto them after. Lane l takes columns l, l + 32, ... (conflict-free
// shared reads), adds its eight in order, then warp_sum_eight sums 8 ranks at once and
// warp_sum_two the two scalars: a fixed order. B_c is read from global memory (L1: the tile's
// rows of it are read by every row), as 16-byte vectors on the register path (REGS:
// register_rank).
template <bool REGS>
__device__ __forceinline__ void tile_row_sums(const float (*staged)[FG_BACK_TILE], const GateGroup& g, i64 tile,
                                              int rc, float* sums, bool first_tile) {
    constexpr int PER_LANE = FG_BACK_TILE / 32;
    const int lane = threadIdx.x & 31;
    const int columns = g.d_out - tile < FG_BACK_TILE ? (int)(g.d_out - tile) : FG_BACK_TILE;
    for (int t0 = 0; t0 < rc; t0 += 8) {
        float part[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) part[e] = 0.0f;
        const float* weights = g.b_cw + (tile + lane) * rc + t0;  // column c's, then 32 columns on
#pragma unroll 4  // four columns' loads in flight; all eight take the function past 128 registers
        for (int i = 0; i < PER_LANE; ++i, weights += 32 * rc) {
            const int c = lane + 32 * i;
            const bool column = c < columns;
            const float dl = staged[0][c];
            float b[8];
#pragma unroll
            for (int e = 0; e < 8; e += 4) {
                if (REGS) {
                    f32x4 b4 = f32x4{};
                    if (column && t0 + e < rc) b4 = *reinterpret_cast<const f32x4*>(weights + e);
#pragma unroll
                    for (int k = 0; k < 4; ++k) b[e + k] = b4.v[k];
                } else {
#pragma unroll
                    for (int k = 0; k < 4; ++k) b[e + k] = column && t0 + e + k < rc ? weights[e + k] : 0.0f;
                }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) part[e] += dl * b[e];
        }
        const float total = warp_sum_eight(part);
        const int t = t0 + ((lane >> 2) & 7);
        if ((lane & 3) == 0 && t < rc) sums[t] = first_tile ? total : sums[t] + total;
    }
    float dgate_s = 0.0f, dalpha_c = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        dgate_s += staged[1][lane + 32 * i];
        dalpha_c += staged[2][lane + 32 * i];
    }
    const float total = warp_sum_two(dgate_s, dalpha_c);
    const int v = lane == 0 ? rc : rc + 1;
    if (lane == 0 || lane == 16) sums[v] = first_tile ? total : sums[v] + total;
}


// γ = 2σ(x) (the same bits as 2·sigmoid_f(x)) and its slope dγ/dx = 2σ(x)(1 − σ(x)) = 2e·r²
// (sigmoid_parts' e and r): one exponential and one reciprocal for both.
struct GateSlope {
    float gate, slope;
};
__device__ __forceinline__ GateSlope gate_and_slope(float x) {
    const SigmoidParts p = sigmoid_parts(x);
    const float er = p.e * p.r;
    return GateSlope{2.0f * (x >= 0.0f ? p.r : er), 2.0f * er * p.r};
}

// The backward of the gate at one element (Ẑ = γ_c ⊙ γ_s ⊙ Z, γ = 2σ(αl), l the logit with
// its bias), from dẐ (dy), Z, the channel logit, the row's γ_s and α_c:
//   dz = d/dZ = dẐ·γ_c·γ_s;  d/dγ_c = dẐ·Z·γ_s;  dl = dL_c = d/dγ_c·γ_c'·α_c (γ_c' = dγ/dx);
//   dgate_s = dẐ·Z·γ_c (its row's d/dγ_s term);  dalpha_c = d/dγ_c·γ_c'·l.
struct ElementGrads {
    float dz, dl, dgate_s, dalpha_c;
};
__device__ __forceinline__ ElementGrads element_backward(float dy, float z, float logit, float gate_s,
                                                         float alpha_c) {
    const GateSlope c = gate_and_slope(alpha_c * logit);
    const float dyz = dy * z;
    const float dslope = dyz * gate_s * c.slope;  // d/dγ_c·γ_c'
    return ElementGrads{dy * c.gate * gate_s, dslope * alpha_c, dyz * c.gate, dslope * logit};
}

// dZ of one element into dzu (f32 products) or dzu_bf16 (bf16 products: its only readers are
// the products; rounded to nearest even).
__device__ __forceinline__ void store_dz(float* dzu, bf16_t* dzu_bf16, i64 element, float dz) {
    if (dzu_bf16) {
        dzu_bf16[element] = f32_to_bf16(dz);
    } else {
        dzu[element] = dz;
    }
}

// The dẐ and Z of rows row0 + c0 .. + FG_BACK_CHUNK of column j (zeros past `count` rows of
// the row block or past the last column), all loads issued before any is used, each row's by
// a pointer a row stride on from the last. dẐ is read from dout ([N, out_width], the outputs'
// layout), or under SWIGLU computed from SwiGLU's output gradient dout ([N, d_out]) and the
// group's gated output `gated` ([N, 2·d_out]: the gate projection's columns, then up's; column
// j's gate value at j, its up value at d_out + j, for either projection of the pair), with
// swiglu.cu's arithmetic and rounded to bf16 as swiglu_backward stores it under bf16 products:
// the same bits as the two launches this replaces. WHOLE: the caller knows that every row of the
// chunk is read (a live column, a whole row block), so no load is tested.
template <class Z, class D, bool SWIGLU, bool WHOLE = false>
__device__ __forceinline__ void load_chunk_grads(const Z* zu, const D* dout, const bf16_t* gated, const GateGroup& g,
                                                 i64 row0, int c0, int count, i64 j, bool live, i64 zu_width,
                                                 i64 out_width, float (&z)[FG_BACK_CHUNK],
                                                 float (&dy)[FG_BACK_CHUNK]) {
    const i64 n = row0 + c0, dout_width = SWIGLU ? g.d_out : out_width;
    const Z* zp = zu + n * zu_width + g.zu_at + j;
    const D* dp = dout + n * dout_width + (SWIGLU ? 0 : g.out_at) + j;
    const bf16_t* gp = SWIGLU ? gated + n * out_width + j : nullptr;
#pragma unroll
    for (int k = 0; k < FG_BACK_CHUNK; ++k, zp += zu_width, dp += dout_width) {
        const bool read = WHOLE || (live && c0 + k < count);
        z[k] = read ? as_f32(*zp) : 0.0f;
        if (!SWIGLU) {
            dy[k] = read ? as_f32(*dp) : 0.0f;
            continue;
        }
        float grad = 0.0f;
        if (read) {
            const float gate = as_f32(gp[0]), up_grad = as_f32(*dp);
            grad = g.out_at == 0 ? swiglu_gate_grad(gate, as_f32(gp[g.d_out]), up_grad) : swiglu_up_grad(gate, up_grad);
        }
        dy[k] = as_f32(f32_to_bf16(grad));
        gp += out_width;
    }
}

// Two values as the hi and lo parts of a bf16x2 mma operand (v0 in the low halves): hi = v
// rounded to bf16, lo = v − hi rounded; hi + lo is v to about 2⁻¹⁶ of it.
__device__ __forceinline__ void split_bf16x2(float v0, float v1, unsigned int& hi, unsigned int& lo) {
    hi = bf16x2(v0, v1);
    float h0, h1;
    bf16x2_to_f32(hi, h0, h1);
    lo = bf16x2(v0 - h0, v1 - h1);
}

// d += A·B in f32 from split operands: hi·hi + hi·lo + lo·hi, in that order (lo·lo, about
// 2⁻¹⁸ of each product, left out).
__device__ __forceinline__ void mma_split(float* d, const unsigned int* a_hi, const unsigned int* a_lo,
                                          const unsigned int* b_hi, const unsigned int* b_lo) {
    mma_bf16(d, a_hi, b_hi);
    mma_bf16(d, a_hi, b_lo);
    mma_bf16(d, a_lo, b_hi);
}

// The summaries after a block's row passes: one warp per row, its H again in the warp's
// shared row; each lane sums its own terms over the warp's rows (lane t's dU[t], dU[t + 32]
// and d/dl_s·H_s), then the warps' sums are added in warp order into the block's terms:
//   d/dl_s = dγ_s·α_s·γ_s(1 − γ_s/2),  dα_s term = dγ_s·l_s·γ_s(1 − γ_s/2),
//   d/dU_c = dH_c ⊙ φ'(U_c + a_c),  d/dU_s = d/dl_s·B_s ⊙ φ'(U_s + a_s),
// whose sums over the block's rows (dU for da, dα_c, dα_s, d/dl_s for db_s, d/dl_s·H_s for
// dB_s) are the block's terms of those cross-row sums. dU goes into dZU's U columns (dzu, f32
// or bf16), as dZ.
template <class Z, class DZ>
__device__ __forceinline__ void backward_summaries(const Z* zu, const GateGroup& g, int phi, float phi_p,
                                                   float alpha_s, i64 first, i64 end, i64 zu_width, int rc, int rs,
                                                   const float* sums_of, DZ* dzu, float* h_rows,
                                                   float (*warp_terms)[FG_BACK_TERMS], float* du_terms,
                                                   float* row_terms) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = rc + rs, sums = rc + 2;
    const i64 d_out = g.d_out, groups = gridDim.y;
    float* h = h_rows + warp * FG_MAX_RANK;
    float du_sum[2] = {0.0f, 0.0f}, hs_sum[2] = {0.0f, 0.0f}, dalpha_c_sum = 0.0f, dalpha_s_sum = 0.0f,
          dlogit_s_sum = 0.0f;
    for (i64 n = first + warp; n < end; n += FG_BACK_WARPS) {
        const i64 zu_row = n * zu_width + g.zu_at;
        float pre[2];  // U + a of this lane's ranks t = lane, lane + 32
        __syncwarp();  // every lane is done with the previous row's h
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int t = lane + 32 * q;
            if (t >= r) break;
            pre[q] = as_f32(zu[zu_row + d_out + t]) + (t < rc ? g.a_c[t] : g.a_s[t - rc]);
            h[t] = unary_f(phi, pre[q], phi_p);
        }
        __syncwarp();
        const float logit_s = scalar_logit(h, g.b_sw, g.b_sb, rc, rs);
        const float gate_s = 2.0f * sigmoid_f(alpha_s * logit_s);  // scalar_gate's
        const float* row = sums_of + n * groups * sums;
        const float dgate_s = row[rc];
        const float slope_s = gate_s * (1.0f - 0.5f * gate_s);
        const float dlogit_s = dgate_s * alpha_s * slope_s;
        dalpha_c_sum += row[rc + 1];
        dalpha_s_sum += dgate_s * logit_s * slope_s;
        dlogit_s_sum += dlogit_s;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int t = lane + 32 * q;
            if (t >= r) break;
            const bool channel = t < rc;
            const float dphi = unary_df(phi, pre[q], h[t], phi_p);
            const float du = channel ? row[t] * dphi : dlogit_s * g.b_sw[t - rc] * dphi;
            du_sum[q] += du;
            if (!channel) hs_sum[q] += dlogit_s * h[t];
            store_as(dzu + zu_row + d_out + t, du);
        }
    }
    // The block's terms: each warp's sums, added in warp order.
    float* mine = warp_terms[warp];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int t = lane + 32 * q;
        if (t >= r) break;
        mine[t] = du_sum[q];
        if (t >= rc) mine[r + 3 + t - rc] = hs_sum[q];
    }
    if (lane == 0) {
        mine[r] = dalpha_c_sum;
        mine[r + 1] = dalpha_s_sum;
        mine[r + 2] = dlogit_s_sum;
    }
    __syncthreads();
    const int terms = 3 + rs;
    for (int v = threadIdx.x; v < r + terms; v += FG_BACK_THREADS) {
        float total = 0.0f;
        for (int u = 0; u < FG_BACK_WARPS; ++u) total += warp_terms[u][v];
        if (v < r) {
            du_terms[(i64)blockIdx.x * groups * r + (i64)blockIdx.y * r + v] = total;
        } else {
            row_terms[(i64)blockIdx.x * groups * terms + (i64)blockIdx.y * terms + v - r] = total;
        }
    }
}

// The kernel's dynamic shared memory (BACKWARD_SHARED_BYTES in cuda/fused_gate/mod.rs), one
// allocation for both paths: each row's H (16-byte aligned), each row's γ_s, each warp's sums
// of the summaries' terms, then the row sums' stage (a path's own layout).
struct BackwardShared {
    f32x4 (*h_quads)[FG_MAX_RANK / 4];
    float* gate_rows;
    float (*warp_terms)[FG_BACK_TERMS];
    void* stage;
};
__device__ __forceinline__ BackwardShared backward_shared_memory() {
    DYNAMIC_SHARED(f32x4, backward_shared);
    BackwardShared s;
    s.h_quads = reinterpret_cast<f32x4(*)[FG_MAX_RANK / 4]>(backward_shared);
    s.gate_rows = reinterpret_cast<float*>(backward_shared + FG_BACK_ROWS * (FG_MAX_RANK / 4));
    s.warp_terms = reinterpret_cast<float(*)[FG_BACK_TERMS]>(s.gate_rows + FG_BACK_ROWS);
    s.stage = s.warp_terms[FG_BACK_WARPS];
    return s;
}

// Block (x, g)'s rows [first, end) and where its terms go: each row's sums (row n's rc + 2 at
// sums_of[n·groups·(rc + 2)]), its columns' dB_c terms (column j's rank t at
// weight_row[j·rc + t]) and db_c terms (bias_row[j]).
struct BackwardBlock {
    i64 first, end;
    float *sums_of, *weight_row, *bias_row;
};
__device__ __forceinline__ BackwardBlock backward_block(const GateGroup& g, i64 rows, i64 rows_per_block,
                                                        i64 out_width, int rc, float* row_sums, float* weight_terms,
                                                        float* bias_terms) {
    BackwardBlock b;
    b.first = (i64)blockIdx.x * rows_per_block;
    b.end = b.first + rows_per_block < rows ? b.first + rows_per_block : rows;
    b.sums_of = row_sums + (i64)blockIdx.y * (rc + 2);
    b.weight_row = weight_terms + ((i64)blockIdx.x * out_width + g.out_at) * rc;
    b.bias_row = bias_terms + (i64)blockIdx.x * out_width + g.out_at;
    return b;
}

// Rows row0 .. row0 + count of the row block: their H into shared memory, then each row's γ_s
// (one thread a row), between barriers (the previous rows' H, γ_s and stage are free). The
// rows past count get h_c = 0 and γ_s = 0, so that the tensor-core path, which computes all
// FG_BACK_ROWS rows and stores only the first count, computes finite zeros there.
template <class Z>
__device__ __forceinline__ void backward_row_block(const BackwardShared& s, const Z* zu, const GateGroup& g, int phi,
                                                   float phi_p, float alpha_s, i64 row0, int count, i64 zu_width,
                                                   int rc, int rs) {
    __syncthreads();  // every thread is done with the previous rows' H, γ_s and stage
    block_hidden(s.h_quads, zu, g, phi, phi_p, row0, count, zu_width, rc, rs);
    for (int e = count * FG_REG_RANK + threadIdx.x; e < FG_BACK_ROWS * FG_REG_RANK; e += FG_BACK_THREADS) {
        reinterpret_cast<float*>(s.h_quads[e / FG_REG_RANK])[e % FG_REG_RANK] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x < FG_BACK_ROWS) {
        const float* h = reinterpret_cast<const float*>(s.h_quads[threadIdx.x]);
        s.gate_rows[threadIdx.x] = threadIdx.x < count ? scalar_gate(h, g.b_sw, g.b_sb, alpha_s, rc, rs) : 0.0f;
    }
    __syncthreads();
}

// The row pass of the backward off the tensor-core path (any rank, any device): dZ, the
// block's db_c and dB_c terms and each row's sums (tile_row_sums), then the summaries. On the
// register path (REGS: register_rank) a thread keeps its column's B_c in registers and reads a
// row's h_c 16 bytes at a time; off it, B_c is read from L1 per logit. dout has the outputs'
// layout (f32, or bf16 when Ẑ's consumer wrote its gradient so), dzu ZU's.
// The block terms, each a row x of a matrix with one row per block: weight_terms
// [x][out_at + j][t] (`[blocks, out_width·rc]`, dB_c's packed layout), bias_terms
// [x][out_at + j] (`[blocks, out_width]`), du_terms [x][g·r + t] (`[blocks, groups·r]`) and
// row_terms [x][g·(3 + rs) + k] (`[blocks, groups·(3 + rs)]`: dα_c, dα_s, d/dl_s, d/dl_s·H_s).
// row_sums (`[rows, groups, rc + 2]`) is the kernel's own scratch. Under SWIGLU (the FFN's
// gate and up group, whose output SwiGLU read: fused_gate_apply_swiglu) dout is SwiGLU's
// output gradient and dẐ is computed from it (load_chunk_grads, above): no dẐ is stored.
template <class Z, class D, bool SWIGLU, bool REGS>
__device__ __noinline__ void gate_backward_rows(const Z* zu, const D* dout, const bf16_t* gated, const GateGroup g,
                                               int phi, float phi_p, i64 rows, i64 rows_per_block, i64 zu_width,
                                               i64 out_width, int rc, int rs, float* dzu, bf16_t* dzu_bf16,
                                               float* row_sums, float* weight_terms, float* bias_terms,
                                               float* du_terms, float* row_terms) {
    const float* parameters[] = {g.a_c, g.b_cw, g.b_cb, g.alpha_c, g.a_s, g.b_sw, g.b_sb, g.alpha_s};
    for (const float* p : parameters) ASSUME_GLOBAL(p);
    const float alpha_c = *g.alpha_c, alpha_s = *g.alpha_s;
    const BackwardShared s = backward_shared_memory();
    // staged[k][s][c] is term s (dL_c, d/dγ_s's, dα_c's) of row k of the chunk, column c of the tile.
    float(*staged)[FG_BACK_STAGED][FG_BACK_TILE] = reinterpret_cast<float(*)[FG_BACK_STAGED][FG_BACK_TILE]>(s.stage);
    const int warp = threadIdx.x >> 5;
    const int sums = rc + 2;
    const i64 d_out = g.d_out, groups = gridDim.y;
    const BackwardBlock b = backward_block(g, rows, rows_per_block, out_width, rc, row_sums, weight_terms, bias_terms);

    for (i64 tile = 0; tile < d_out; tile += FG_BACK_TILE) {
        const i64 j = tile + threadIdx.x;
        const bool live = j < d_out;
        float w[FG_REG_RANK], bias, dw[FG_REG_RANK], db = 0.0f;
        column_weight(g.b_cw, g.b_cb, j, live, rc, REGS, w, bias);
#pragma unroll
        for (int t = 0; t < FG_REG_RANK; ++t) dw[t] = 0.0f;
        if (!REGS && live) {
            // Ranks past FG_REG_RANK sum in place, each thread its own column's.
            for (int t = FG_REG_RANK; t < rc; ++t) b.weight_row[j * rc + t] = 0.0f;
        }
        for (i64 row0 = b.first; row0 < b.end; row0 += FG_BACK_ROWS) {
            const int count = (int)(b.end - row0 < FG_BACK_ROWS ? b.end - row0 : FG_BACK_ROWS);
            backward_row_block(s, zu, g, phi, phi_p, alpha_s, row0, count, zu_width, rc, rs);
            for (int c0 = 0; c0 < count; c0 += FG_BACK_CHUNK) {
                if (c0 > 0) __syncthreads();  // the previous chunk's stage is summed
                float z[FG_BACK_CHUNK], dy[FG_BACK_CHUNK];
                load_chunk_grads<Z, D, SWIGLU>(zu, dout, gated, g, row0, c0, count, j, live, zu_width, out_width, z,
                                               dy);
                i64 element = (row0 + c0) * zu_width + g.zu_at + j;
#pragma unroll
                for (int k = 0; k < FG_BACK_CHUNK; ++k, element += zu_width) {
                    if (c0 + k >= count) break;
                    const float* h = reinterpret_cast<const float*>(s.h_quads[c0 + k]);
                    float hc[FG_REG_RANK];  // the row's h_c[0..FG_REG_RANK), zeros past rc
                    if (REGS) {
                        register_hidden(h, rc, hc);
                    } else {
#pragma unroll
                        for (int t = 0; t < FG_REG_RANK; ++t) hc[t] = t < rc ? h[t] : 0.0f;
                    }
                    ElementGrads e = {0.0f, 0.0f, 0.0f, 0.0f};
                    if (live) {
                        const float logit = REGS ? register_logit(hc, w, rc) : column_logit(h, g.b_cw, j, rc);
                        e = element_backward(dy[k], z[k], logit + bias, s.gate_rows[c0 + k], alpha_c);
                        store_dz(dzu, dzu_bf16, element, e.dz);
                        db += e.dl;
#pragma unroll
                        for (int t = 0; t < FG_REG_RANK; ++t) dw[t] += e.dl * hc[t];
                        if (!REGS) {
                            for (int t = FG_REG_RANK; t < rc; ++t) b.weight_row[j * rc + t] += e.dl * h[t];
                        }
                    }
                    staged[k][0][threadIdx.x] = e.dl;
                    staged[k][1][threadIdx.x] = e.dgate_s;
                    staged[k][2][threadIdx.x] = e.dalpha_c;
                }
                __syncthreads();  // the chunk's stage is written
                if (c0 + warp < count) {
                    float* sums_row = b.sums_of + (row0 + c0 + warp) * groups * sums;
                    tile_row_sums<REGS>(staged[warp], g, tile, rc, sums_row, tile == 0);
                }
            }
        }
        if (live) {
            for (int t = 0; t < rc && t < FG_REG_RANK; ++t) b.weight_row[j * rc + t] = dw[t];
            b.bias_row[j] = db;
        }
    }
    __syncthreads();  // every row's sums are in row_sums (this block's own writes)
    if (dzu_bf16) {
        backward_summaries(zu, g, phi, phi_p, alpha_s, b.first, b.end, zu_width, rc, rs, b.sums_of, dzu_bf16,
                           reinterpret_cast<float*>(s.h_quads), s.warp_terms, du_terms, row_terms);
    } else {
        backward_summaries(zu, g, phi, phi_p, alpha_s, b.first, b.end, zu_width, rc, rs, b.sums_of, dzu,
                           reinterpret_cast<float*>(s.h_quads), s.warp_terms, du_terms, row_terms);
    }
}

// The row pass on the tensor-core path (bf16 products, channel rank FG_REG_RANK, compute
// capability 8.0): gate_backward_rows's results, its row sums and dB_c terms by mma from each
// warp's stage (BackwardWarpStage), its logits from the column's B_c in registers, dZ and dU
// into dzu in bf16.
template <class Z, class D, bool SWIGLU>
__device__ __noinline__ void gate_backward_rows_mma(const Z* zu, const D* dout, const bf16_t* gated,
                                                   const GateGroup g, int phi, float phi_p, i64 rows,
                                                   i64 rows_per_block, i64 zu_width, i64 out_width, int rs,
                                                   bf16_t* dzu, float* row_sums, float* weight_terms,
                                                   float* bias_terms, float* du_terms, float* row_terms) {
    constexpr int rc = FG_REG_RANK;
    const float* parameters[] = {g.a_c, g.b_cw, g.b_cb, g.alpha_c, g.a_s, g.b_sw, g.b_sb, g.alpha_s};
    for (const float* p : parameters) ASSUME_GLOBAL(p);
    const float alpha_c = *g.alpha_c, alpha_s = *g.alpha_s;
    const BackwardShared s = backward_shared_memory();
    BackwardWarpStage* stages = static_cast<BackwardWarpStage*>(s.stage);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int quad_row = lane >> 2, quad_col = lane & 3;  // g and t of the mma fragments' layout
    BackwardWarpStage& stage = stages[warp];
    const int sums = rc + 2;
    const i64 d_out = g.d_out, groups = gridDim.y;
    const BackwardBlock b = backward_block(g, rows, rows_per_block, out_width, rc, row_sums, weight_terms, bias_terms);

    for (i64 tile = 0; tile < d_out; tile += FG_BACK_TILE) {
        const i64 j = tile + threadIdx.x, warp_column = tile + 32 * warp;
        const bool live = j < d_out;
        float w[FG_REG_RANK], bias;
        column_weight(g.b_cw, g.b_cb, j, live, rc, true, w, bias);
        // dL·B_c's B fragments, split: B[k][n] = B_c[warp_column + 16·step + k, n] (zeros past
        // the last column).
        unsigned int bc_hi[2][2], bc_lo[2][2];
#pragma unroll
        for (int step = 0; step < 2; ++step) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const i64 c = warp_column + 16 * step + 8 * half + 2 * quad_col;
                const float v0 = c < d_out ? g.b_cw[c * rc + quad_row] : 0.0f;
                const float v1 = c + 1 < d_out ? g.b_cw[(c + 1) * rc + quad_row] : 0.0f;
                split_bf16x2(v0, v1, bc_hi[step][half], bc_lo[step][half]);
            }
        }
        // dLᵀ·H_c's accumulators: the warp's columns warp_column + 16·m + (0..15) by ranks 0..7.
        float dw[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}}, db = 0.0f;
        for (i64 row0 = b.first; row0 < b.end; row0 += FG_BACK_ROWS) {
            const int count = (int)(b.end - row0 < FG_BACK_ROWS ? b.end - row0 : FG_BACK_ROWS);
            backward_row_block(s, zu, g, phi, phi_p, alpha_s, row0, count, zu_width, rc, rs);
            // Both chunks, every row: past count (and past the last column) dẐ, Z, h_c and γ_s
            // are zeros, so every term is a zero, staged for the products; only dZ's store is
            // left out.
            const bool whole = live && count == FG_BACK_ROWS;
#pragma unroll 1
            for (int c0 = 0; c0 < FG_BACK_ROWS; c0 += FG_BACK_CHUNK) {
                float z[FG_BACK_CHUNK], dy[FG_BACK_CHUNK];
                if (whole) {
                    load_chunk_grads<Z, D, SWIGLU, true>(zu, dout, gated, g, row0, c0, count, j, live, zu_width,
                                                         out_width, z, dy);
                } else {
                    load_chunk_grads<Z, D, SWIGLU>(zu, dout, gated, g, row0, c0, count, j, live, zu_width, out_width,
                                                   z, dy);
                }
                bf16_t* dz = dzu + (row0 + c0) * zu_width + g.zu_at + j;
#pragma unroll
                for (int k = 0; k < FG_BACK_CHUNK; ++k, dz += zu_width) {
                    const int row = c0 + k;
                    float hc[FG_REG_RANK];
                    register_hidden(reinterpret_cast<const float*>(s.h_quads[row]), rc, hc);
                    const ElementGrads e =
                        element_backward(dy[k], z[k], register_logit(hc, w, rc) + bias, s.gate_rows[row], alpha_c);
                    if (live && row < count) store_as(dz, e.dz);
                    db += e.dl;
                    const bf16_t hi = f32_to_bf16(e.dl);
                    // fg_swizzled(row, lane / 8) + lane % 8, which for c0 a multiple of 8 is c0 rows
                    // on from row k's (whose swizzle is known while compiling).
                    const int at = c0 * FG_BK + fg_swizzled(k, lane >> 3) + (lane & 7);
                    stage.dl[0][at] = hi;
                    stage.dl[1][at] = f32_to_bf16(e.dl - bf16_to_f32(hi));
                    stage.terms[k][0][lane] = e.dgate_s;
                    stage.terms[k][1][lane] = e.dalpha_c;
                }
                __syncwarp();
                // The chunk's d/dγ_s and dα_c over the warp's columns: lanes 2s and 2s + 1 add
                // half the columns each of sum s (row s / 2, term s % 2), in order, then each other's.
                {
                    const int sum = lane >> 1, half = lane & 1;
                    const float* terms = stage.terms[sum >> 1][sum & 1] + 16 * half;
                    float part = 0.0f;
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const f32x4 v = reinterpret_cast<const f32x4*>(terms)[q];
                        part = part + v.v[0] + v.v[1] + v.v[2] + v.v[3];
                    }
                    const float total = part + __shfl_xor_sync(FULL_MASK, part, 1);
                    if (half == 0) stage.row_terms[c0 + (sum >> 1)][FG_REG_RANK + (sum & 1)] = total;
                }
                __syncwarp();  // the terms are summed: the next chunk may stage its own
            }
            // The warp's share of dH_c = dL·B_c (16 rows × 8 ranks, over its 32 columns) into
            // its row terms, and its columns' dB_c terms dLᵀ·H_c (over the 16 rows) onto dw.
            float dh[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int step = 0; step < 2; ++step) {
                unsigned int a_hi[4], a_lo[4];
                const int at = fg_swizzled((lane & 7) + 8 * ((lane >> 3) & 1), 2 * step + (lane >> 4));
                ldmatrix_x4(a_hi, stage.dl[0] + at);
                ldmatrix_x4(a_lo, stage.dl[1] + at);
                mma_split(dh, a_hi, a_lo, bc_hi[step], bc_lo[step]);
            }
            stage.row_terms[quad_row][2 * quad_col] = dh[0];
            stage.row_terms[quad_row][2 * quad_col + 1] = dh[1];
            stage.row_terms[quad_row + 8][2 * quad_col] = dh[2];
            stage.row_terms[quad_row + 8][2 * quad_col + 1] = dh[3];
            // H_c's B fragments, split: B[k][n] = H_c[row k, rank n] (zeros past count).
            unsigned int hc_hi[2], hc_lo[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = 2 * quad_col + 8 * half;
                const float v0 = row < count ? reinterpret_cast<const float*>(s.h_quads[row])[quad_row] : 0.0f;
                const float v1 =
                    row + 1 < count ? reinterpret_cast<const float*>(s.h_quads[row + 1])[quad_row] : 0.0f;
                split_bf16x2(v0, v1, hc_hi[half], hc_lo[half]);
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                unsigned int a_hi[4], a_lo[4];
                const int at = fg_swizzled((lane & 7) + 8 * (lane >> 4), 2 * m + ((lane >> 3) & 1));
                ldmatrix_x4_trans(a_hi, stage.dl[0] + at);
                ldmatrix_x4_trans(a_lo, stage.dl[1] + at);
                mma_split(dw[m], a_hi, a_lo, hc_hi, hc_lo);
            }
            __syncthreads();  // every warp's row terms are staged
            // The rows' sums over the tile (the row_sums layout: rc ranks of dH_c, d/dγ_s, dα_c):
            // the warps' shares added in warp order.
            static_assert(FG_BACK_ROW_TERMS == rc + 2, "a warp's row terms are a row's sums");
            for (int v = threadIdx.x; v < count * sums; v += FG_BACK_THREADS) {
                const int row = v / sums, term = v % sums;
                float total = 0.0f;
                for (int u = 0; u < FG_BACK_WARPS; ++u) total += stages[u].row_terms[row][term];
                float* sum = b.sums_of + (row0 + row) * groups * sums + term;
                *sum = tile == 0 ? total : *sum + total;
            }
        }
        // dw[m][2·half + e] is column warp_column + 16·m + quad_row + 8·half, rank 2·quad_col + e.
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const i64 c = warp_column + 16 * m + quad_row + 8 * half;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (c < d_out) b.weight_row[c * rc + 2 * quad_col + e] = dw[m][2 * half + e];
                }
            }
        }
        if (live) b.bias_row[j] = db;
    }
    __syncthreads();  // every row's sums are in row_sums (this block's own writes)
    backward_summaries(zu, g, phi, phi_p, alpha_s, b.first, b.end, zu_width, rc, rs, b.sums_of, dzu,
                       reinterpret_cast<float*>(s.h_quads), s.warp_terms, du_terms, row_terms);
}

// gate_backward_rows on the tensor-core path, or off it on the register path or not: three
// functions, each not inlined, so that ptxas allocates each one's registers alone: inlined side
// by side, the paths' live ranges spilled. The group's parameters go by value, in registers:
// the kernel's lists by reference would be copied to the stack first.
template <class Z, class D, bool SWIGLU = false>
__device__ __forceinline__ void gate_backward_rows_any_rank(const Z* zu, const D* dout, const bf16_t* gated,
                                                            const TensorList& params, const TensorList& layout,
                                                            int phi, float phi_p, i64 rows, i64 rows_per_block,
                                                            i64 zu_width, i64 out_width, int rc, int rs, float* dzu,
                                                            bf16_t* dzu_bf16, float* row_sums, float* weight_terms,
                                                            float* bias_terms, float* du_terms, float* row_terms) {
    const GateGroup g = gate_group(params, layout, blockIdx.y);
    if (FG_BACK_TENSOR_CORES && rc == FG_REG_RANK && dzu_bf16) {
        gate_backward_rows_mma<Z, D, SWIGLU>(zu, dout, gated, g, phi, phi_p, rows, rows_per_block, zu_width,
                                             out_width, rs, dzu_bf16, row_sums, weight_terms, bias_terms, du_terms,
                                             row_terms);
    } else if (register_rank(rc)) {
        gate_backward_rows<Z, D, SWIGLU, true>(zu, dout, gated, g, phi, phi_p, rows, rows_per_block, zu_width,
                                               out_width, rc, rs, dzu, dzu_bf16, row_sums, weight_terms, bias_terms,
                                               du_terms, row_terms);
    } else {
        gate_backward_rows<Z, D, SWIGLU, false>(zu, dout, gated, g, phi, phi_p, rows, rows_per_block, zu_width,
                                                out_width, rc, rs, dzu, dzu_bf16, row_sums, weight_terms, bias_terms,
                                                du_terms, row_terms);
    }
}

extern "C" __global__ void __launch_bounds__(FG_BACK_THREADS, 2)
    fused_gate_backward_rows(const float* zu, const float* dout, TensorList params, TensorList layout, int phi,
                             float phi_p, i64 rows, i64 rows_per_block, i64 zu_width, i64 out_width, int rc, int rs,
                             float* dzu, bf16_t* dzu_bf16, float* row_sums, float* weight_terms, float* bias_terms,
                             float* du_terms, float* row_terms) {
    gate_backward_rows_any_rank(zu, dout, nullptr, params, layout, phi, phi_p, rows, rows_per_block, zu_width,
                                out_width, rc, rs, dzu, dzu_bf16, row_sums, weight_terms, bias_terms, du_terms,
                                row_terms);
}

// fused_gate_backward_rows from a bf16 ZU (bf16 products).
extern "C" __global__ void __launch_bounds__(FG_BACK_THREADS, 2)
    fused_gate_backward_rows_bf16(const bf16_t* zu, const float* dout, TensorList params, TensorList layout, int phi,
                                  float phi_p, i64 rows, i64 rows_per_block, i64 zu_width, i64 out_width, int rc,
                                  int rs, float* dzu, bf16_t* dzu_bf16, float* row_sums, float* weight_terms,
                                  float* bias_terms, float* du_terms, float* row_terms) {
    gate_backward_rows_any_rank(zu, dout, nullptr, params, layout, phi, phi_p, rows, rows_per_block, zu_width,
                                out_width, rc, rs, dzu, dzu_bf16, row_sums, weight_terms, bias_terms, du_terms,
                                row_terms);
}

// fused_gate_backward_rows from a bf16 ZU and a bf16 dẐ (bf16 products, the consumer of Ẑ
// writing its gradient in bf16: SwiGLU's backward, RoPE's).
extern "C" __global__ void __launch_bounds__(FG_BACK_THREADS, 2)
    fused_gate_backward_rows_bf16_dout_bf16(const bf16_t* zu, const bf16_t* dout, TensorList params,
                                            TensorList layout, int phi, float phi_p, i64 rows, i64 rows_per_block,
                                            i64 zu_width, i64 out_width, int rc, int rs, float* dzu,
                                            bf16_t* dzu_bf16, float* row_sums, float* weight_terms,
                                            float* bias_terms, float* du_terms, float* row_terms) {
    gate_backward_rows_any_rank(zu, dout, nullptr, params, layout, phi, phi_p, rows, rows_per_block, zu_width,
                                out_width, rc, rs, dzu, dzu_bf16, row_sums, weight_terms, bias_terms, du_terms,
                                row_terms);
}

// fused_gate_backward_rows of the FFN's gate and up group (bf16 products) from SwiGLU's output
// gradient dout ([N, d_out], bf16) and the group's gated output ([N, 2·d_out], bf16, as
// fused_gate_apply_swiglu wrote it): SwiGLU's backward inside the gate's (output_grad).
extern "C" __global__ void __launch_bounds__(FG_BACK_THREADS, 2)
    fused_gate_backward_rows_swiglu(const bf16_t* zu, const bf16_t* dout, const bf16_t* gated, TensorList params,
                                    TensorList layout, int phi, float phi_p, i64 rows, i64 rows_per_block,
                                    i64 zu_width, i64 out_width, int rc, int rs, float* dzu, bf16_t* dzu_bf16,
                                    float* row_sums, float* weight_terms, float* bias_terms, float* du_terms,
                                    float* row_terms) {
    gate_backward_rows_any_rank<bf16_t, bf16_t, true>(zu, dout, gated, params, layout, phi, phi_p, rows,
                                                      rows_per_block, zu_width, out_width, rc, rs, dzu, dzu_bf16,
                                                      row_sums, weight_terms, bias_terms, du_terms, row_terms);
}
