// SwiGLU gating y = silu(g)·u = g·σ(g)·u, forward and backward (cpu/swiglu.rs), one thread
// per element in a grid-stride loop. The backward recomputes σ(g) from g and writes
// (gradients are written, not added: kernels/src/lib.rs):
//   dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),   du = dy·g·σ(g)
// Each f32 output may have a bf16 twin (non-null pointer): the same values rounded to nearest
// even, as f32_to_bf16_kernel writes them, for the bf16 products that read the output.

// out[i] = g·σ(g)·u
extern "C" __global__ void swiglu_forward(const float* gate, const float* up, float* out, bf16_t* out_bf16, i64 n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        float y = g * sigmoid_f(g) * up[i];
        out[i] = y;
        if (out_bf16) out_bf16[i] = f32_to_bf16(y);
    }
}

// dgate[i] = dout[i]·up[i]·silu'(gate[i]),  dup[i] = dout[i]·silu(gate[i])
extern "C" __global__ void swiglu_backward(const float* gate, const float* up, const float* dout, float* dgate,
                                           float* dup, bf16_t* dgate_bf16, bf16_t* dup_bf16, i64 n) {
    GRID_STRIDE(i, n) {
        float g = gate[i], dy = dout[i];
        float s = sigmoid_f(g);
        // d/dg silu(g) = σ(g)·(1 + g·(1 − σ(g)))
        float dsilu = s * (1.0f + g * (1.0f - s));
        float dg = dy * up[i] * dsilu, du = dy * (g * s);
        dgate[i] = dg;
        dup[i] = du;
        if (dgate_bf16) dgate_bf16[i] = f32_to_bf16(dg);
        if (dup_bf16) dup_bf16[i] = f32_to_bf16(du);
    }
}
