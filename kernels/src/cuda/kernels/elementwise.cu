// Elementwise kernels: unary ops and their backward, broadcasting binary ops, axpy,
// select, strided copy, scaled copies and f32 <-> bf16 conversion. CPU counterparts:
// cpu/unary.rs, cpu/binary.rs, cpu/copy.rs. Every kernel is a grid-stride loop over its n
// outputs.

#define MAX_RANK 8

// Binary op codes: the order of `cpu::binary::Binary`.
#define BIN_ADD 0
#define BIN_SUB 1
#define BIN_MUL 2
#define BIN_DIV 3
#define BIN_MAXIMUM 4
#define BIN_MINIMUM 5

// maximum/minimum propagate NaN (a + b is NaN when either is), as PyTorch does.
__device__ __forceinline__ float binary_f(int op, float a, float b) {
    switch (op) {
        case BIN_ADD: return a + b;
        case BIN_SUB: return a - b;
        case BIN_MUL: return a * b;
        case BIN_DIV: return a / b;
        case BIN_MAXIMUM: return (is_nan(a) || is_nan(b)) ? a + b : fmaxf(a, b);
        case BIN_MINIMUM: return (is_nan(a) || is_nan(b)) ? a + b : fminf(a, b);
        default: return a;
    }
}

// Three runs of MAX_RANK values, passed by value: sizes, then two stride runs.
struct Dims24 {
    i64 v[3 * MAX_RANK];
};

// y[i] = f(x[i])
extern "C" __global__ void unary_forward(int op, float p, const float* x, float* y, i64 n) {
    GRID_STRIDE(i, n) { y[i] = unary_f(op, x[i], p); }
}

// dx[i] = dy[i]·f'(x[i]), with y = f(x) saved by the forward (gradients are written, not
// added: kernels/src/lib.rs)
extern "C" __global__ void unary_backward(int op, float p, const float* x, const float* y, const float* dy,
                                          float* dx, i64 n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * unary_df(op, x[i], y[i], p); }
}

// out[idx] = a[Σ idx_d·sa_d] op b[Σ idx_d·sb_d] over a (coalesced) shape of `rank` dims:
// dims.v[0..8) sizes, [8..16) a's strides, [16..24) b's strides; stride 0 broadcasts.
// `a` and `b` already point at their offsets.
extern "C" __global__ void binary_forward(int op, const float* a, const float* b, Dims24 dims, int rank, float* out,
                                          i64 n) {
    GRID_STRIDE(i, n) {
        i64 rest = i, ia = 0, ib = 0;
        for (int d = rank - 1; d >= 0; --d) {
            i64 size = dims.v[d];
            i64 index = rest % size;
            rest /= size;
            ia += index * dims.v[MAX_RANK + d];
            ib += index * dims.v[2 * MAX_RANK + d];
        }
        out[i] = binary_f(op, a[ia], b[ib]);
    }
}

// out[i] = x[i] op s
extern "C" __global__ void scalar_forward(int op, const float* x, float s, float* out, i64 n) {
    GRID_STRIDE(i, n) { out[i] = binary_f(op, x[i], s); }
}

// y[i] = value (a constant tensor without a host upload: the seed of a backward pass)
extern "C" __global__ void fill(float value, float* y, i64 n) {
    GRID_STRIDE(i, n) { y[i] = value; }
}

// dst[i] += alpha·src[i]; dst_bf16 (when not null) gets the new dst rounded to nearest even,
// for the bf16 products that read a sum of gradients.
extern "C" __global__ void axpy(float alpha, const float* src, float* dst, bf16_t* dst_bf16, i64 n) {
    GRID_STRIDE(i, n) {
        float y = fmaf(src[i], alpha, dst[i]);
        dst[i] = y;
        if (dst_bf16) dst_bf16[i] = f32_to_bf16(y);
    }
}

// out[i] = cond[i] != 0 ? a[i] : b[i]
extern "C" __global__ void select_where(const float* cond, const float* a, const float* b, float* out, i64 n) {
    GRID_STRIDE(i, n) { out[i] = cond[i] != 0.0f ? a[i] : b[i]; }
}

// dst (row-major over dims.v[0..rank)) [idx] = src[Σ idx_d·dims.v[8 + d]]; `src` points
// at the view's offset.
extern "C" __global__ void copy_strided(const float* src, Dims24 dims, int rank, float* dst, i64 n) {
    GRID_STRIDE(i, n) {
        i64 rest = i, at = 0;
        for (int d = rank - 1; d >= 0; --d) {
            i64 size = dims.v[d];
            at += (rest % size) * dims.v[MAX_RANK + d];
            rest /= size;
        }
        dst[i] = src[at];
    }
}

// dst[i] = bf16(src[i]), rounding to nearest even
extern "C" __global__ void f32_to_bf16_kernel(const float* src, bf16_t* dst, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = f32_to_bf16(src[i]); }
}

// dst[offsets.v[s] + i] = bf16(srcs.v[s][i]) for i < lens.v[s]: several f32 buffers rounded
// to nearest even into their places of one bf16 buffer in one launch. Part s = blockIdx.y.
extern "C" __global__ void f32_to_bf16_packed(TensorList srcs, TensorList lens, TensorList offsets, bf16_t* dst) {
    const int s = blockIdx.y;
    const float* src = (const float*)srcs.v[s];
    bf16_t* out = dst + offsets.v[s];
    GRID_STRIDE(i, lens.v[s]) { out[i] = f32_to_bf16(src[i]); }
}

// dsts.v[p][i] = s[0]·srcs.v[p][i] for i < lens.v[p]: several buffers times one scalar that
// stays on the device (a loss's upstream gradient: the host never waits for it), in one
// launch. Part p = blockIdx.y.
extern "C" __global__ void scaled_copies(const float* s, TensorList srcs, TensorList dsts, TensorList lens) {
    const int p = blockIdx.y;
    const float* src = (const float*)srcs.v[p];
    float* dst = (float*)dsts.v[p];
    const float scale = s[0];
    GRID_STRIDE(i, lens.v[p]) { dst[i] = scale * src[i]; }
}

// dst[i] = f32(src[i]) (exact)
extern "C" __global__ void bf16_to_f32_kernel(const bf16_t* src, float* dst, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = bf16_to_f32(src[i]); }
}
