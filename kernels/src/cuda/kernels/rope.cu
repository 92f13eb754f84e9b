// Rotary position embedding, Hugging Face "rotate_half" layout (cpu/rope.rs): within a
// head of D dims, element i < D/2 pairs with i + D/2 and the pair at position p rotates by
// the angle of table row p:
//   y[i]       = x[i]·cos − x[i + D/2]·sin
//   y[i + D/2] = x[i + D/2]·cos + x[i]·sin
// The backward is the inverse rotation (sign = −1) written into dx (gradients are written,
// not added: kernels/src/lib.rs). One thread per pair.

// x, out: [tokens = B·T, H, D]; token t of a sequence uses table row pos_offset + t % seq.
// out_bf16 (when not null) gets out rounded to nearest even, for the bf16 products reading it.
extern "C" __global__ void rope_rotate(const float* x, const float* cos_table, const float* sin_table, float* out,
                                       bf16_t* out_bf16, i64 tokens, i64 seq, i64 heads, i64 head_dim, i64 pos_offset,
                                       float sign) {
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
