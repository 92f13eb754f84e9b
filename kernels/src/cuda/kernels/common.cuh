// Helpers shared by every kernel family; module.rs prepends this file to each .cu file.
// No system headers: NVRTC's built-ins (expf, erfcf, __shfl_xor_sync, ...) are enough, so
// compiling needs no CUDA toolkit headers on the machine.
//
// Conventions: sizes and flat indices are `long long` (i64); kernels walk their elements
// with grid-stride loops; backward kernels write their gradients (`dx[i] = ...`, never
// reading them) like the CPU ones: the gradient contract of kernels/src/lib.rs.

typedef long long i64;
typedef unsigned short bf16_t;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// The launch's dynamic shared memory (LaunchConfig::shared_mem_bytes) as `T* name`. The CUDA
// emulator (emu/cuda_emu.h) hands out a per-block buffer of exactly that size instead.
#ifdef __CUDA_EMULATOR__
#define DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(tp_emu::dynamic_shared())
#else
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// Tells the compiler that `p` points to global memory, so that loads through it are global
// loads (LDG) rather than generic ones (LD). A function that is not inlined cannot see that its
// pointer arguments came from the kernel's, and a pointer made from a TensorList's integers
// carries no address space either. Nothing to say on the emulator.
#ifdef __CUDA_EMULATOR__
#define ASSUME_GLOBAL(p) ((void)(p))
#else
#define ASSUME_GLOBAL(p) __builtin_assume(__isGlobal(p))
#endif

// 2^x by the hardware's exp2 alone (ex2.approx.ftz: MUFU.EX2, as exp2f's within 2 ulp), a
// result below 2^−126 flushed to zero: exp2f adds a test and two scalings a value to keep
// those. For attention's softmax, where such a value is below 2^−126 of its row's largest,
// and sigmoid_f, where it is below 2^−126 of 1.
//
// 1/x by the hardware's reciprocal alone (rcp.approx.ftz: MUFU.RCP, within 1 ulp), where
// `1.0f / x` adds a Newton step and a call for huge or tiny x to round it exactly. For x
// between 2^−126 and 2^126 (sigmoid_f's 1 + e^−|x| in [1, 2]).
#ifdef __CUDA_EMULATOR__
__device__ __forceinline__ float exp2_ftz(float x) {
    const float r = exp2f(x);
    return r < 1.17549435e-38f ? 0.0f : r;
}
__device__ __forceinline__ float rcp_approx(float x) { return 1.0f / x; }
#else
__device__ __forceinline__ float exp2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
#endif

// d += A·B for one warp: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with the PTX
// ISA's fragment layout (see fused_gate.cu), `d` float[4], `a` u32[4], `b` u32[2] per lane.
// Inline assembly, as cp_async below is; the emulator runs a C++ version of both.
#if defined(__CUDA_EMULATOR__)
#define MMA_M16N8K16_BF16(d, a, b) tp_emu::mma_m16n8k16_bf16((d), (a), (b))
#elif __CUDA_ARCH__ >= 800
#define MMA_M16N8K16_BF16(d, a, b)                                                                   \
    asm volatile(                                                                                    \
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
        "{%0,%1,%2,%3};\n"                                                                           \
        : "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3])                                     \
        : "r"((a)[0]), "r"((a)[1]), "r"((a)[2]), "r"((a)[3]), "r"((b)[0]), "r"((b)[1]))
#else
#define MMA_M16N8K16_BF16(d, a, b) __trap()  // the launcher refuses devices below compute capability 8.0
#endif

// Asynchronous copies global → shared (cp.async, compute capability 8.0): a thread issues
// copies of `bytes` (4 or 16; both addresses multiples of it) that go straight into shared
// memory, no registers on the way, while the thread goes on computing; `src_bytes` 0 copies
// nothing and fills the destination with zeros (a row past the end). cp_async_commit closes the
// thread's copies issued since the last commit into a group; cp_async_wait<n> waits until at
// most the n most recent groups are still in flight. A copy is visible to the thread that
// issued it once waited for, to the rest of the block after a barrier that follows the wait.
// The emulator performs each copy only when the wait covers it (emu/cuda_emu.h), so a read
// before the wait sees the old contents there as it may on a GPU; below 8.0 the copy is plain.
#if defined(__CUDA_EMULATOR__)
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    tp_emu::cp_async(dst, src, bytes, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { tp_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    tp_emu::cp_async_wait(N);
}
#elif __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    const unsigned int to = (unsigned int)__cvta_generic_to_shared(dst);
    if (bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(src_bytes));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(to), "l"(src), "r"(src_bytes));
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#else
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    unsigned char* to = static_cast<unsigned char*>(dst);
    const unsigned char* from = static_cast<const unsigned char*>(src);
    for (int i = 0; i < bytes; ++i) to[i] = i < src_bytes ? from[i] : 0;
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#endif

// Fragments from shared memory (ldmatrix, compute capability 7.5): one warp instruction loads
// four 8 × 8 matrices of 16-bit values, where one LDS per register would take four. Lane l
// gives the address of row l % 8 of matrix l / 8 (8 values, 16 bytes, 16-byte aligned), and
// receives in d[j], of matrix j, the values (l / 4, 2·(l % 4)) and (l / 4, 2·(l % 4) + 1),
// the first in the low half: with matrices (rows 0-7, columns 0-7), (8-15, 0-7), (0-7, 8-15),
// (8-15, 8-15) of a row-major 16 × 16 tile that is an mma.m16n8k16 A fragment, and with the
// rows of a tile that holds B's columns (B[k][n] = tile[n][k]) two B fragments. ldmatrix_x4_trans
// gives (2·(l % 4), l / 4) and (2·(l % 4) + 1, l / 4) instead: B fragments of a tile that holds
// B's rows (B[k][n] = tile[k][n]). The emulator runs a C++ version as a warp collective.
#if defined(__CUDA_EMULATOR__)
__device__ __forceinline__ void ldmatrix_x4(unsigned int* d, const bf16_t* row) { tp_emu::ldmatrix_x4(d, row, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* d, const bf16_t* row) {
    tp_emu::ldmatrix_x4(d, row, true);
}
#elif __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldmatrix_x4(unsigned int* d, const bf16_t* row) {
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(at));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* d, const bf16_t* row) {
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(at));
}
#else
// Below 8.0 the mma kernels trap and their launchers refuse the device.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* d, const bf16_t*) {
    d[0] = d[1] = d[2] = d[3] = 0u;
    __trap();
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* d, const bf16_t*) {
    d[0] = d[1] = d[2] = d[3] = 0u;
    __trap();
}
#endif

// Up to 64 device addresses or lengths, passed by value: the tensors of a multi-tensor
// launch (RoPE's parts, several column sums at once); unused entries are 0. A kernel's lists
// stay inside the 4 KB of kernel parameters every CUDA version accepts.
#define LIST_LEN 64
struct TensorList {
    i64 v[LIST_LEN];
};

// Up to 512 device addresses or lengths, passed by value: the parameters of a model's whole
// decay group in one optimizer launch (llama-60m Transponder: 282 matrices, 353 vectors and
// scalars), and the gradients of one squared-norm launch. adam_step's seven tables are 28 KB
// of arguments: kernel parameters past 4 KB need CUDA 12.1 (a 32,764-byte limit on every
// architecture since Volta), which the CUDA 13 driver the engine loads has.
#define TABLE_LEN 512
struct TensorTable {
    i64 v[TABLE_LEN];
};

// The entry whose blocks this block is among, in a multi-tensor launch that gives entry e of
// `count` the blocks first_block.v[e] ≤ blockIdx.x < first_block.v[e + 1] (the last one's run
// to gridDim.x; an entry with no blocks repeats the next one's first): the last entry whose
// first block is at most blockIdx.x, by binary search (first_block never decreases; a table
// has up to TABLE_LEN entries). Each entry gets blocks for its own size, none that would find
// nothing to do beside a larger one. `List` is a TensorList or a TensorTable.
template <class List>
__device__ __forceinline__ int list_entry_of_block(const List& first_block, i64 count) {
    int lo = 0, hi = (int)count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_block.v[mid] <= (i64)blockIdx.x) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// The number of blocks of entry e (list_entry_of_block).
template <class List>
__device__ __forceinline__ i64 list_entry_blocks(const List& first_block, i64 count, int e) {
    return (e + 1 < count ? first_block.v[e + 1] : (i64)gridDim.x) - first_block.v[e];
}

// Chunks a column-sum finish adds side by side: its block is (32, ≤ FINISH_CHUNKS), 32 columns.
#define FINISH_CHUNKS 32

// Σ_c value(c) for c in 0..chunks, in chunk order, in f64, for this thread's column (thread x of
// a (32, blockDim.y) block; `valid` false past the last column): the finish of a two-pass column
// sum (reduce.cu's column sums, norm.cu's weight gradient). The chunks go in steps of
// blockDim.y: thread (x, y) computes the step's chunk y (loads that do not wait on each other),
// then row y = 0 adds the step's values to its f64 total in chunk order, the additions of one
// thread walking every chunk alone, which left the GPU nearly idle (a long chain of loads per
// column, few threads). Every thread of the block calls it (it holds barriers); row 0 gets the
// total. `tile`: a [FINISH_CHUNKS][32] shared array.
template <class ChunkValue>
__device__ __forceinline__ float chunk_total(i64 chunks, bool valid, float (*tile)[32], ChunkValue value) {
    double total = 0.0;
    for (i64 c0 = 0; c0 < chunks; c0 += blockDim.y) {
        const i64 chunk = c0 + threadIdx.y;
        __syncthreads();  // row 0 is done with the previous step's values
        tile[threadIdx.y][threadIdx.x] = valid && chunk < chunks ? value(chunk) : 0.0f;
        __syncthreads();
        if (threadIdx.y == 0) {
            for (int k = 0; k < (int)blockDim.y && c0 + k < chunks; ++k) total += (double)tile[k][threadIdx.x];
        }
    }
    return (float)total;
}

// The "last block finishes" pattern (as CUB's and PyTorch's reductions do it), for a kernel
// whose blocks write partial sums that `blocks` of them share: every block of the group calls
// this after writing its partials (every thread of the block: it holds barriers), and it
// returns true, to the whole block, in the group's one block that arrives last, which then
// reads the group's partials and finishes. Nothing waits for another block, so any block
// order (and the emulator's) is fine. Memory order: each thread fences its writes before
// thread 0 counts the block (release); the last block fences after seeing the count (acquire)
// and reads the partials through volatile loads (coherent at the device level, not an SM's
// stale L1 line, not moved before the fence). `arrival` is the group's counter
// (CudaDevice::arrival_counters): 0 before the launch, and reset to 0 here by the last block,
// after every block of the group has counted, so the next launch needs no memset.
__device__ bool last_block_to_arrive(unsigned int* arrival, unsigned int blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        last = atomicAdd(arrival, 1u) == blocks - 1;
        if (last) atomicExch(arrival, 0u);  // every block of the group has counted: none will again
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Grid-stride loop over [0, n).
#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
// Grid-stride loop over [first, n) (the scalar tail after a vectorized loop).
#define GRID_STRIDE_FROM(i, first, n)                                                      \
    for (i64 i = (first) + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (i64)gridDim.x * blockDim.x)

// ---------------------------------------------------------------------------------------
// Wide loads and stores for the memory-bound elementwise kernels: one 16-byte access moves 4
// floats (4 bf16 in 8 bytes) with one instruction instead of four, so fewer instructions and
// more bytes in flight per thread. Our own types rather than CUDA's float4, so that NVRTC and
// the emulator (the host's C++ compiler) see the same definitions. The address must be a
// multiple of the type's size: callers check it with is_aligned and fall back to single elements.
struct alignas(16) f32x4 {
    float v[4];
};
struct alignas(8) f32x2 {
    float v[2];
};
struct alignas(8) u32x2 {  // 4 bf16 as two packed pairs (bf16x2)
    unsigned int v[2];
};

// Whether p is a multiple of `bytes` (a power of two); a null pointer is.
__device__ __forceinline__ bool is_aligned(const void* p, unsigned int bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// v[0..W) = p[0..W): W = 4 in one 16-byte load (p 16-byte aligned), else element by element.
template <int W>
__device__ __forceinline__ void load_f32(float (&v)[W], const float* p) {
    if (W == 4) {
        f32x4 q = *reinterpret_cast<const f32x4*>(p);
        for (int k = 0; k < W; ++k) v[k] = q.v[k];
    } else {
        for (int k = 0; k < W; ++k) v[k] = p[k];
    }
}

// p[0..W) = v[0..W), as load_f32.
template <int W>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[W]) {
    if (W == 4) {
        f32x4 q;
        for (int k = 0; k < W; ++k) q.v[k] = v[k];
        *reinterpret_cast<f32x4*>(p) = q;
    } else {
        for (int k = 0; k < W; ++k) p[k] = v[k];
    }
}

// Constants built from their formula, as on the CPU (unary.rs).
#define FRAC_1_SQRT_2 0.70710678118654752440f   // 1/√2
#define LOG2E 1.44269504088896340736f  // log₂e
#define LN2 0.69314718055994530942f    // ln 2
#define FRAC_1_SQRT_2PI 0.39894228040143267794f // 1/√(2π)
#define SQRT_2_OVER_PI 0.79788456080286535588f  // √(2/π)
#define GELU_TANH_CUBIC 0.044715f               // the cubic coefficient of the tanh GELU

__device__ __forceinline__ bool is_nan(float x) { return x != x; }
// Neither infinite nor NaN (a NaN compares false).
__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) < POS_INF; }

// bf16 stored as its 16 bits; conversion rounds to nearest even: for every number the same
// bits as half::bf16::from_f32 on the host. On a GPU (compute capability 8.0 and up) the
// conversion is one instruction (cvt.rn.bf16.f32; two values at once, bf16x2), where the
// integer rounding below takes six; a NaN becomes the canonical quiet NaN there, and keeps
// its payload, quieted, in the integer rounding (the emulator's, as half's).
__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((unsigned int)v) << 16); }

// Two bf16 packed in 32 bits (`lo` in the low half, as bf16x2 packs them) as f32: lo by a
// shift, hi by a mask, one instruction each (widening each 16-bit half on its own takes two).
__device__ __forceinline__ void bf16x2_to_f32(unsigned int packed, float& lo, float& hi) {
    lo = __uint_as_float(packed << 16);
    hi = __uint_as_float(packed & 0xffff0000u);
}

// A stored f32 or bf16 value as f32: kernels templated over their input's element type.
__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(bf16_t v) { return bf16_to_f32(v); }

#if !defined(__CUDA_EMULATOR__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

// Two floats rounded to bf16 in one 32-bit word, `lo` in the low half.
__device__ __forceinline__ unsigned int bf16x2(float lo, float hi) {
    unsigned int packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}
#else
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Two floats rounded to bf16 in one 32-bit word, `lo` in the low half.
__device__ __forceinline__ unsigned int bf16x2(float lo, float hi) {
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
}
#endif

// *p = v in p's element type: f32 as it is, bf16 rounded to nearest even (as_f32's inverse).
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(bf16_t* p, float v) { *p = f32_to_bf16(v); }

// v[0..W) = p[0..W) widened from bf16: W = 4 in one 8-byte load (p 8-byte aligned), else one
// by one. The same name as the f32 load, so kernels templated over their input's element type
// load either.
template <int W>
__device__ __forceinline__ void load_f32(float (&v)[W], const bf16_t* p) {
    if (W == 4) {
        const u32x2 q = *reinterpret_cast<const u32x2*>(p);
        for (int k = 0; k < 2; ++k) bf16x2_to_f32(q.v[k], v[2 * k], v[2 * k + 1]);
    } else {
        for (int k = 0; k < W; ++k) v[k] = bf16_to_f32(p[k]);
    }
}

// p[0..W) = v[0..W) rounded to bf16: W = 4 in one 8-byte store (p 8-byte aligned), else one by one.
template <int W>
__device__ __forceinline__ void store_bf16(bf16_t* p, const float (&v)[W]) {
    if (W == 4) {
        *reinterpret_cast<u32x2*>(p) = u32x2{{bf16x2(v[0], v[1]), bf16x2(v[2], v[3])}};
    } else {
        for (int k = 0; k < W; ++k) p[k] = f32_to_bf16(v[k]);
    }
}

// RoPE's rotation of one pair (a, b) = (x[i], x[i + D/2]) by the angle whose cosine is c and
// sine s·sign (sign −1: the inverse rotation, RoPE's backward): lo = a·c − b·s', hi = a·s' + b·c.
// rope.cu, attention's backward (which rotates its dq and dk rows back as it stores them) and
// the fused gate's rotary epilogue (fused_gate.cu) all call it, so that the same f32 inputs give
// the same bits in each. hi is written a·s' + b·c (not b·c + a·s') so that NVRTC fuses the
// same product into an fma in every caller.
__device__ __forceinline__ void rope_rotate_pair(float a, float b, float c, float s, float sign, float& lo,
                                                 float& hi) {
    const float sk = s * sign;
    lo = a * c - b * sk;
    hi = a * sk + b * c;
}

// σ(x) through e^-|x| ≤ 1, so it never overflows (unary.rs `sigmoid`). e^-|x| as
// 2^(−|x|·log₂e) by exp2_ftz and 1/(1 + e) by rcp_approx: 6 instructions where expf and an
// exact division take about 25 (the gate kernels take one or two a gated element), within a
// few ulp of the CPU's σ (the argument's rounding adds |x|·2^−24 relative to e^−|x|);
// below −87, where e^−|x| < 2^−126, σ is 0 (the CPU's is a subnormal).
//
// sigmoid_parts gives the two values it is made of, e = e^−|x| and r = 1/(1 + e): σ(x) is r for
// x ≥ 0 and e·r below, 1 − σ(x) the other; kernels that also want σ's slope σ(1 − σ) = e·r²
// take them from here (the same bits of σ).
struct SigmoidParts {
    float e, r;
};
__device__ __forceinline__ SigmoidParts sigmoid_parts(float x) {
    const float e = exp2_ftz(-fabsf(x) * LOG2E);
    return SigmoidParts{e, rcp_approx(1.0f + e)};
}
__device__ __forceinline__ float sigmoid_f(float x) {
    const SigmoidParts p = sigmoid_parts(x);
    return x >= 0.0f ? p.r : p.e * p.r;
}

// SwiGLU of one gate value g and one up value u, silu(g)·u = g·σ(g)·u: swiglu.cu's forward
// and the fused gate's SwiGLU epilogue (fused_gate.cu) both call it, so they give the same bits.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid_f(g) * u; }

// SwiGLU's backward at one element for its output gradient dy: d/dg = dy·u·silu'(g) with
// silu'(g) = σ(g)·(1 + g·(1 − σ(g))), and d/du = dy·silu(g). swiglu.cu's backward and the fused
// gate's SwiGLU backward (fused_gate.cu) both call them, so they give the same bits.
__device__ __forceinline__ float swiglu_gate_grad(float g, float u, float dy) {
    const float s = sigmoid_f(g);
    const float dsilu = s * (1.0f + g * (1.0f - s));
    return dy * u * dsilu;
}
__device__ __forceinline__ float swiglu_up_grad(float g, float dy) { return dy * (g * sigmoid_f(g)); }

// Unary op codes: the order of `cpu::unary::Unary` (Powf's exponent travels as `p`).
#define OP_NEG 0
#define OP_EXP 1
#define OP_LOG 2
#define OP_SQRT 3
#define OP_RSQRT 4
#define OP_ABS 5
#define OP_SIGMOID 6
#define OP_TANH 7
#define OP_RELU 8
#define OP_SILU 9
#define OP_GELU 10
#define OP_GELU_TANH 11
#define OP_POWF 12
#define OP_SQUARE 13

// f(x), as unary.rs `unary_reference`.
__device__ __forceinline__ float unary_f(int op, float x, float p) {
    switch (op) {
        case OP_NEG: return -x;
        case OP_EXP: return expf(x);
        case OP_LOG: return logf(x);
        case OP_SQRT: return sqrtf(x);
        case OP_RSQRT: return 1.0f / sqrtf(x);
        case OP_ABS: return fabsf(x);
        case OP_SIGMOID: return sigmoid_f(x);
        case OP_TANH: return tanhf(x);
        case OP_RELU: return x < 0.0f ? 0.0f : x;
        case OP_SILU: return x * sigmoid_f(x);
        case OP_GELU: return x * (0.5f * erfcf(-x * FRAC_1_SQRT_2));
        case OP_GELU_TANH: {
            float u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
            return 0.5f * x * (1.0f + tanhf(u));
        }
        case OP_POWF: return powf(x, p);
        case OP_SQUARE: return x * x;
        default: return x;
    }
}

// f'(x) given y = f(x), as unary.rs `unary_derivative_reference`.
__device__ __forceinline__ float unary_df(int op, float x, float y, float p) {
    switch (op) {
        case OP_NEG: return -1.0f;
        case OP_EXP: return y;
        case OP_LOG: return 1.0f / x;
        case OP_SQRT: return 0.5f / y;
        case OP_RSQRT: return -0.5f * y * y * y;
        // Relu'(0) = Abs'(0) = 0, as in PyTorch.
        case OP_ABS: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
        case OP_SIGMOID: return y * (1.0f - y);
        case OP_TANH: return 1.0f - y * y;
        case OP_RELU: return x > 0.0f ? 1.0f : 0.0f;
        // d/dx x·σ(x) = σ(x)·(1 + x·(1 − σ(x)))
        case OP_SILU: {
            float s = sigmoid_f(x);
            return s * (1.0f + x * (1.0f - s));
        }
        // d/dx x·Φ(x) = Φ(x) + x·φ(x)
        case OP_GELU: return 0.5f * erfcf(-x * FRAC_1_SQRT_2) + x * expf(-0.5f * x * x) * FRAC_1_SQRT_2PI;
        case OP_GELU_TANH: {
            float t = tanhf(SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x));
            float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_TANH_CUBIC * x * x);
            return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
        }
        // PyTorch masks p == 0 so that 0·x^-1 at x = 0 gives 0, not NaN.
        case OP_POWF: return p == 0.0f ? 0.0f : p * powf(x, p - 1.0f);
        case OP_SQUARE: return 2.0f * x;
        default: return 1.0f;
    }
}

// ---------------------------------------------------------------------------------------
// Warp and block reductions. The block versions need blockDim.x a multiple of 32 (≤ 1024)
// and must be reached by every thread of the block; they return the total to every thread.
// The order of additions is fixed by the launch shape, so results are run-to-run identical.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ float block_sum(float v) {
    __shared__ float partials[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading partials[0]
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? partials[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) partials[0] = v;
    }
    __syncthreads();
    return partials[0];
}

__device__ double block_sum_d(double v) {
    __shared__ double partials_d[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) partials_d[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? partials_d[lane] : 0.0;
        v = warp_sum_d(v);
        if (lane == 0) partials_d[0] = v;
    }
    __syncthreads();
    return partials_d[0];
}

__device__ float block_max(float v) {
    __shared__ float partials_m[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partials_m[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? partials_m[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) partials_m[0] = v;
    }
    __syncthreads();
    return partials_m[0];
}

// ---------------------------------------------------------------------------------------
// RMSNorm rows, one warp per row (norm.cu's forward and backward kernels, and the fused gate's
// residual add and norm in fused_gate.cu, so that all compute the same bits). Lane l holds
// the row's chunks of 4 columns l, l + 32, l + 64, ... (columns 4·(l + 32k) .. 4·(l + 32k) + 3),
// sums its share of a row's reduction over its chunks in that order, and the warp then adds
// the lanes' shares (warp_sum: every lane gets the same bits). No block barrier and no shared
// memory per row, where a block per row waited at two barriers for every row. A chunk moves as
// one 16-byte access of f32 (8 bytes of bf16) where `quads` says the row's width is a multiple
// of 4 and every row pointer is aligned so, else element by element: the same columns in the
// same order either way, so `quads` never changes a bit.
#define ROW_QUADS 8  // chunks a lane keeps in registers between a row's passes: rows up to 1,024 wide
// Warps a block of the RMSNorm row kernels (norm.cu, fused_gate.cu): a row each, or in the
// backward a row lane of its chunk (norm.rs's ROW_LANES).
#define NORM_ROW_LANES 8

// v = chunk j..j+3 of `row` (f32, or bf16 widened), zero past `cols`.
template <typename T>
__device__ __forceinline__ void load_chunk(float (&v)[4], const T* row, i64 j, i64 cols, bool quads) {
    if (quads) {
        load_f32(v, row + j);
        return;
    }
    for (int e = 0; e < 4; ++e) v[e] = j + e < cols ? as_f32(row[j + e]) : 0.0f;
}

// Chunk j..j+3 of `row` = v (f32, or rounded to bf16), the columns below `cols`.
__device__ __forceinline__ void store_chunk(float* row, const float (&v)[4], i64 j, i64 cols, bool quads) {
    if (quads) {
        store_f32(row + j, v);
        return;
    }
    for (int e = 0; e < 4 && j + e < cols; ++e) row[j + e] = v[e];
}
__device__ __forceinline__ void store_chunk(bf16_t* row, const float (&v)[4], i64 j, i64 cols, bool quads) {
    if (quads) {
        store_bf16(row + j, v);
        return;
    }
    for (int e = 0; e < 4 && j + e < cols; ++e) row[j + e] = f32_to_bf16(v[e]);
}

// One row's RMSNorm by the calling warp: in(j, v) sets v to the row's input at chunk j (x, or
// a residual sum x + delta; loads and arithmetic only), which is stored into `sr` when not null
// (the sum), then rstd = 1/√(mean(x²) + eps) into *rstd and y = x·rstd·w into yr and its bf16
// rounding into yr_bf16, each when not null (under bf16 products y may go in bf16 alone). A
// lane keeps its first ROW_QUADS chunks in registers, and each pass issues all their loads
// before its first store (a store may alias a later load, so a load after it waits for it):
// a row's loads are in flight together. Past those chunks (rows wider than 1,024) a lane goes
// chunk by chunk and reads `back` again in the second pass: the input row as stored (x, or the
// sum in `sr`, which may be x's own buffer).
template <class ChunkIn>
__device__ __forceinline__ void warp_rms_norm_row(ChunkIn in, float* sr, const float* back, const float* w, float* yr,
                                                  bf16_t* yr_bf16, float* rstd, i64 cols, float eps, bool quads) {
    const int lane = threadIdx.x & 31;
    float kept[ROW_QUADS][4];
#pragma unroll
    for (int k = 0; k < ROW_QUADS; ++k) {
        const i64 j = 4 * (lane + 32 * k);
        kept[k][0] = kept[k][1] = kept[k][2] = kept[k][3] = 0.0f;
        if (j < cols) in(j, kept[k]);
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < ROW_QUADS; ++k) {
        const i64 j = 4 * (lane + 32 * k);
        if (sr && j < cols) store_chunk(sr, kept[k], j, cols, quads);
        for (int e = 0; e < 4; ++e) ss += kept[k][e] * kept[k][e];
    }
    for (i64 j = 4 * (lane + 32 * ROW_QUADS); j < cols; j += 128) {
        float v[4];
        in(j, v);
        if (sr) store_chunk(sr, v, j, cols, quads);
        for (int e = 0; e < 4; ++e) ss += v[e] * v[e];
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)cols + eps);
    // y = v·rs·w, in place of v
    const auto scale = [&](i64 j, float (&v)[4]) {
        float wj[4];
        load_chunk(wj, w, j, cols, quads);
        for (int e = 0; e < 4; ++e) v[e] = v[e] * rs * wj[e];
    };
    const auto out = [&](i64 j, const float (&y)[4]) {
        if (yr) store_chunk(yr, y, j, cols, quads);
        if (yr_bf16) store_chunk(yr_bf16, y, j, cols, quads);
    };
#pragma unroll
    for (int k = 0; k < ROW_QUADS; ++k) {
        const i64 j = 4 * (lane + 32 * k);
        if (j < cols) scale(j, kept[k]);
    }
#pragma unroll
    for (int k = 0; k < ROW_QUADS; ++k) {
        const i64 j = 4 * (lane + 32 * k);
        if (j < cols) out(j, kept[k]);
    }
    for (i64 j = 4 * (lane + 32 * ROW_QUADS); j < cols; j += 128) {
        float v[4];
        load_chunk(v, back, j, cols, quads);
        scale(j, v);
        out(j, v);
    }
    if (lane == 0) *rstd = rs;
}

// One row of a residual add and the next RMSNorm by the calling warp (norm.cu's
// add_rms_norm_forward; the fused gate's, fused_gate.cu): sr = xr + delta, then
// warp_rms_norm_row of the sum, where delta(j, d) sets d to chunk j of the delta (zero past
// cols): the add's and the norm's arithmetic, so bit-identical to the two launched apart.
template <class DeltaChunk>
__device__ __forceinline__ void warp_add_rms_norm_row(const float* xr, DeltaChunk delta, const float* w, float* sr,
                                                      float* yr, bf16_t* yr_bf16, float* rstd, i64 cols, float eps,
                                                      bool quads) {
    const auto in = [&](i64 j, float (&v)[4]) {
        float x[4], d[4];
        load_chunk(x, xr, j, cols, quads);
        delta(j, d);
        for (int e = 0; e < 4; ++e) v[e] = x[e] + d[e];
    };
    warp_rms_norm_row(in, sr, sr, w, yr, yr_bf16, rstd, cols, eps, quads);
}
