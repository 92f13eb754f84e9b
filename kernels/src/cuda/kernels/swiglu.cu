// SwiGLU gating y = silu(g)·u = g·σ(g)·u, forward and backward (cpu/swiglu.rs), one thread
// per element in a grid-stride loop. The backward recomputes σ(g) from g and writes
// (gradients are written, not added: kernels/src/lib.rs):
//   dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),   du = dy·g·σ(g)

// out[i] = g·σ(g)·u
extern "C" __global__ void swiglu_forward(const float* gate, const float* up, float* out, i64 n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        out[i] = g * sigmoid_f(g) * up[i];
    }
}

// dgate[i] = dout[i]·up[i]·silu'(gate[i]),  dup[i] = dout[i]·silu(gate[i])
extern "C" __global__ void swiglu_backward(const float* gate, const float* up, const float* dout, float* dgate,
                                           float* dup, i64 n) {
    GRID_STRIDE(i, n) {
        float g = gate[i], dy = dout[i];
        float s = sigmoid_f(g);
        // d/dg silu(g) = σ(g)·(1 + g·(1 − σ(g)))
        float dsilu = s * (1.0f + g * (1.0f - s));
        dgate[i] = dy * up[i] * dsilu;
        dup[i] = dy * (g * s);
    }
}
