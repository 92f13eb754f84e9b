// Rotary position embedding, Hugging Face "rotate_half" layout (cpu/rope.rs): within a
// head of D dims, element i < D/2 pairs with i + D/2 and the pair at position p rotates by
// the angle of table row p:
//   y[i]       = x[i]·cos − x[i + D/2]·sin
//   y[i + D/2] = x[i + D/2]·cos + x[i]·sin
// The backward is the inverse rotation (sign = −1) written into dx (gradients are written,
// not added: kernels/src/lib.rs). One thread per pair, or per 4 adjacent pairs (below).
//
// One launch rotates several tensors (attention's q and k): part p = blockIdx.y rotates
// xs.v[p] into outs.v[p], each [tokens = B·T, head_counts.v[p], D] with token rows
// x_strides.v[p] and out_strides.v[p] elements apart (H·D when dense; 3·H·D where q, k and v
// sit side by side in one row, the packed QKV product); token t of a sequence uses table row
// pos_offset + t % seq. A part whose rotates.v[p] is 0 is copied, not rotated (v, moved
// beside q and k in the same launch). out_bf16s.v[p] (when not 0) gets the output rounded to
// nearest even, for the bf16 products reading it, with out's layout; outs.v[p] may then be 0
// (no f32 output: q, k and v for the tensor-core attention, which reads bf16). With
// x_is_bf16 every xs.v[p] holds bf16 values (the packed QKV product stored in bf16, as
// autocast stores a product), widened to f32 for the rotation.
// A thread rotates W adjacent pairs per step: W = 4 when the halves split into 16-byte groups
// (D/2 % 4 == 0, strides multiples of 4 and every pointer aligned): 16-byte loads of x (8-byte
// when bf16) and the tables, 16-byte stores of out and 8-byte of out_bf16; else W = 1. Index type I: unsigned int
// when every index fits (the usual case), since a 64-bit division or modulo costs dozens of
// instructions on the GPU (it is emulated) and each step needs four; i64 for larger tensors.
// The arithmetic per pair is the same on every path, so the bits are too.
template <int W, typename I, typename X>
__device__ __forceinline__ void rope_rotate_part(const X* x, float* out, bf16_t* out_bf16, const float* cos_table,
                                                 const float* sin_table, I tokens, I heads, I seq, I head_dim,
                                                 I x_stride, I out_stride, I pos_offset, float sign, bool rotate) {
    const I half = head_dim / 2, groups = half / W;  // groups of W pairs per head
    const I n = tokens * heads * groups;
    for (I g = (I)blockIdx.x * blockDim.x + threadIdx.x; g < n; g += (I)gridDim.x * blockDim.x) {
        I i = g % groups * W;       // the group's first pair in its head
        I token_head = g / groups;  // token·H + h
        I token = token_head / heads;
        I head_at = (token_head - token * heads) * head_dim + i;
        I row = (pos_offset + token % seq) * half + i;
        I at_x = token * x_stride + head_at;
        I at = token * out_stride + head_at;
        float a[W], b[W], lo[W], hi[W];
        load_f32(a, x + at_x);
        load_f32(b, x + at_x + half);
        if (rotate) {
            float c[W], s[W];
            load_f32(c, cos_table + row);
            load_f32(s, sin_table + row);
            // The arithmetic of common.cuh's rope_rotate_pair, shared with attention's backward.
            for (int k = 0; k < W; ++k) rope_rotate_pair(a[k], b[k], c[k], s[k], sign, lo[k], hi[k]);
        } else {
            for (int k = 0; k < W; ++k) {
                lo[k] = a[k];
                hi[k] = b[k];
            }
        }
        if (out) {
            store_f32(out + at, lo);
            store_f32(out + at + half, hi);
        }
        if (out_bf16) {
            store_bf16(out_bf16 + at, lo);
            store_bf16(out_bf16 + at + half, hi);
        }
    }
}

// Part blockIdx.y with its input of element type X.
template <typename X>
__device__ __forceinline__ void rope_rotate_lane(const TensorList& xs, const TensorList& outs,
                                                 const TensorList& out_bf16s, const TensorList& head_counts,
                                                 const TensorList& x_strides, const TensorList& out_strides,
                                                 const TensorList& rotates, const float* cos_table,
                                                 const float* sin_table, i64 tokens, i64 seq, i64 head_dim,
                                                 i64 pos_offset, float sign) {
    const int p = blockIdx.y;
    const X* x = (const X*)xs.v[p];
    float* out = (float*)outs.v[p];
    bf16_t* out_bf16 = (bf16_t*)out_bf16s.v[p];
    const i64 heads = head_counts.v[p], x_stride = x_strides.v[p], out_stride = out_strides.v[p];
    const bool rotate = rotates.v[p] != 0;
    // The launcher's grid covers groups of 4 pairs (rope.rs); any grid is correct.
    const bool wide = (head_dim / 2) % 4 == 0 && x_stride % 4 == 0 && out_stride % 4 == 0 &&
                      is_aligned(x, 4 * sizeof(X)) && is_aligned(out, 16) && is_aligned(cos_table, 16) &&
                      is_aligned(sin_table, 16) && is_aligned(out_bf16, 8);
    // Every element and table index below 2³¹, so neither they nor the grid stride (< 2³¹) wrap
    // an unsigned int.
    const i64 limit = 1LL << 31;
    const i64 widest = x_stride > out_stride ? x_stride : out_stride;
    const bool small = tokens * widest < limit && tokens * heads * head_dim < limit &&
                       (pos_offset + seq) * (head_dim / 2) < limit;
    if (small && wide) {
        rope_rotate_part<4, unsigned int>(x, out, out_bf16, cos_table, sin_table, tokens, heads, seq, head_dim,
                                          x_stride, out_stride, pos_offset, sign, rotate);
    } else if (small) {
        rope_rotate_part<1, unsigned int>(x, out, out_bf16, cos_table, sin_table, tokens, heads, seq, head_dim,
                                          x_stride, out_stride, pos_offset, sign, rotate);
    } else {
        rope_rotate_part<1, i64>(x, out, out_bf16, cos_table, sin_table, tokens, heads, seq, head_dim, x_stride,
                                 out_stride, pos_offset, sign, rotate);
    }
}

extern "C" __global__ void rope_rotate(TensorList xs, TensorList outs, TensorList out_bf16s, TensorList head_counts,
                                       TensorList x_strides, TensorList out_strides, TensorList rotates,
                                       const float* cos_table, const float* sin_table, i64 tokens, i64 seq,
                                       i64 head_dim, i64 pos_offset, float sign, int x_is_bf16) {
    if (x_is_bf16) {
        rope_rotate_lane<bf16_t>(xs, outs, out_bf16s, head_counts, x_strides, out_strides, rotates, cos_table,
                                 sin_table, tokens, seq, head_dim, pos_offset, sign);
    } else {
        rope_rotate_lane<float>(xs, outs, out_bf16s, head_counts, x_strides, out_strides, rotates, cos_table,
                                sin_table, tokens, seq, head_dim, pos_offset, sign);
    }
}
