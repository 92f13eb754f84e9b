// Rotary position embedding, Hugging Face "rotate_half" layout (cpu/rope.rs): within a
// head of D dims, element i < D/2 pairs with i + D/2 and the pair at position p rotates by
// the angle of table row p:
//   y[i]       = x[i]·cos − x[i + D/2]·sin
//   y[i + D/2] = x[i + D/2]·cos + x[i]·sin
// The backward is the inverse rotation (sign = −1) written into dx (gradients are written,
// not added: kernels/src/lib.rs). One thread per pair.
//
// One launch rotates several tensors (attention's q and k): part p = blockIdx.y rotates
// xs.v[p] into outs.v[p], [tokens = B·T, head_counts.v[p], D]; token t of a sequence uses
// table row pos_offset + t % seq. out_bf16s.v[p] (when not 0) gets the output rounded to
// nearest even, for the bf16 products reading it.
extern "C" __global__ void rope_rotate(TensorList xs, TensorList outs, TensorList out_bf16s, TensorList head_counts,
                                       const float* cos_table, const float* sin_table, i64 tokens, i64 seq,
                                       i64 head_dim, i64 pos_offset, float sign) {
    const int p = blockIdx.y;
    const float* x = (const float*)xs.v[p];
    float* out = (float*)outs.v[p];
    bf16_t* out_bf16 = (bf16_t*)out_bf16s.v[p];
    const i64 heads = head_counts.v[p];
    i64 half = head_dim / 2;
    GRID_STRIDE(idx, tokens * heads * half) {
        i64 i = idx % half;
        i64 token_head = idx / half;  // token·H + h
        i64 token = token_head / heads;
        i64 row = (pos_offset + token % seq) * half + i;
        float c = cos_table[row], s = sin_table[row] * sign;
        i64 at = token_head * head_dim + i;
        float a = x[at], b = x[at + half];
        float lo = a * c - b * s, hi = b * c + a * s;
        out[at] = lo;
        out[at + half] = hi;
        if (out_bf16) {
            out_bf16[at] = f32_to_bf16(lo);
            out_bf16[at + half] = f32_to_bf16(hi);
        }
    }
}
