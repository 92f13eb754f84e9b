// Fused optimizer updates (cpu/optim.rs), one thread per element, in place.
//
// Adam/AdamW with PyTorch's arrangement of the bias corrections:
//   p ← p·decay;  g ← g + l2·p
//   m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//   p ← p − step_size·m / (√v·inv_sqrt_correction2 + eps)
// AdamW passes decay = 1 − lr·wd, l2 = 0; Adam passes decay = 1, l2 = wd. The per-step
// scalars (step_size = lr/(1 − β1ᵗ), 1/√(1 − β2ᵗ), decay, l2) are computed on the host in
// f64 and read from device memory (`constants`), where the host writes each step's before
// the update runs: a CUDA graph that captured the update reads the step's own.
//
// One launch updates up to TABLE_LEN tensors that share these scalars (PyTorch's
// multi-tensor apply): their addresses and lengths come by value in TensorTable structs
// (common.cuh); each tensor has blocks for its own length along grid.x (first_block,
// list_entry_of_block), none idle beside a longer tensor, and walks its elements with them.
// Each thread updates 4 consecutive elements per step with 16-byte loads and stores (8-byte
// for the bf16 copy) when the tensor's pointers allow it, then the n % 4 last one at a time
// (all of them when a pointer is not aligned): the same arithmetic per element either way.
// A tensor with a bf16 copy (bf16s.v[t] != 0: bf16 products read it) gets the copy rewritten
// from the updated parameter, rounded to nearest even as f32_to_bf16_kernel does, so the
// next step's products read it without a conversion launch.
//
// With a step guard (`guard` not null, written by step_guard below) the update reads its
// verdict on the device: no update at all when guard[GUARD_UPDATE] is 0 (a non-finite loss or
// gradient norm), otherwise every gradient times guard[GUARD_SCALE] (gradient clipping), as
// if the gradients had been scaled in place first: g·s is the same f32 product.

#define GUARD_UPDATE 0  // 1: apply the update; 0: skip it
#define GUARD_SCALE 1   // the clipping factor of every gradient (1: no clipping)
#define GUARD_NORM 2    // the global gradient norm before clipping
#define GUARD_LOSS 3    // the step's mean loss

// The per-step scalars of adam_step, and the gradients' clipping factor.
struct AdamScalars {
    float beta1, beta2, eps, step_size, inv_sqrt_correction2, decay, l2, scale;
};

// The update of one element, in place: p, m, v point at it in global memory (the
// one-at-a-time path) or in registers (the 4-wide path, which loaded 4 elements first).
// Written as the one-element kernel was, loads inside the expressions included: NVRTC picks
// which product of β1·m + g·(1 − β1) to fuse into an fma by the code around it (loading m
// before g is computed made NVRTC 13 fuse β1·m instead: other bits), and the PTX of both
// paths fuses the same products as before.
__device__ __forceinline__ float adam_element(float* p, const float* g, float* m, float* v, const AdamScalars& a) {
    float pd = *p * a.decay;
    float gs = fmaf(pd, a.l2, *g * a.scale);
    float mi = a.beta1 * *m + gs * (1.0f - a.beta1);
    float vi = a.beta2 * *v + gs * gs * (1.0f - a.beta2);
    float denom = fmaf(sqrtf(vi), a.inv_sqrt_correction2, a.eps);
    float updated = pd - mi * a.step_size / denom;
    *p = updated;
    *m = mi;
    *v = vi;
    return updated;
}

// Elements [i, i + 4) of one tensor, 16-byte loads and stores (8-byte for the bf16 copy).
__device__ __forceinline__ void adam_quad(float* param, bf16_t* copy, const float* grad, float* m, float* v, i64 i,
                                          const AdamScalars& a) {
    float p[4], g[4], mi[4], vi[4];
    load_f32(p, param + i);
    load_f32(g, grad + i);
    load_f32(mi, m + i);
    load_f32(vi, v + i);
    for (int k = 0; k < 4; ++k) adam_element(&p[k], &g[k], &mi[k], &vi[k], a);
    store_f32(param + i, p);
    if (copy) store_bf16(copy + i, p);
    store_f32(m + i, mi);
    store_f32(v + i, vi);
}

// constants: [step_size, inv_sqrt_correction2, decay, l2]
extern "C" __global__ void adam_step(TensorTable params, TensorTable bf16s, TensorTable grads, TensorTable ms,
                                     TensorTable vs, TensorTable lens, TensorTable first_block, i64 count,
                                     const float* guard, float beta1, float beta2, float eps,
                                     const float* constants) {
    if (guard && guard[GUARD_UPDATE] == 0.0f) return;
    const AdamScalars a = {beta1,        beta2,        eps,          constants[0], constants[1],
                           constants[2], constants[3], guard ? guard[GUARD_SCALE] : 1.0f};
    const int t = list_entry_of_block(first_block, count);
    float* param = (float*)params.v[t];
    const float* grad = (const float*)grads.v[t];
    float* m = (float*)ms.v[t];
    float* v = (float*)vs.v[t];
    bf16_t* copy = (bf16_t*)bf16s.v[t];
    const i64 n = lens.v[t];
    // This tensor's own grid-stride loop over its blocks.
    const i64 first = ((i64)blockIdx.x - first_block.v[t]) * blockDim.x + threadIdx.x;
    const i64 stride = list_entry_blocks(first_block, count, t) * blockDim.x;
    const bool wide =
        is_aligned(param, 16) && is_aligned(grad, 16) && is_aligned(m, 16) && is_aligned(v, 16) && is_aligned(copy, 8);
    const i64 quads = wide ? n / 4 : 0;
    for (i64 q = first; q < quads; q += stride) adam_quad(param, copy, grad, m, v, 4 * q, a);
    for (i64 i = 4 * quads + first; i < n; i += stride) {
        float updated = adam_element(param + i, grad + i, m + i, v + i, a);
        if (copy) copy[i] = f32_to_bf16(updated);
    }
}

// The step guard, one thread: the global gradient norm ‖g‖ = √(Σ partial) (the f64 partials
// of sum_squares_partial, summed in order as the host would), the mean loss
// loss_sum / loss_divisor, and the verdict: update only when both are finite, with the
// gradients scaled by max_norm / (‖g‖ + 1e-6) when ‖g‖ > max_norm (PyTorch's
// clip_grad_norm_). The host reads the four values once the step is queued.
// With the previous step's guard (`previous` not null) the verdict is also "no update" when
// that step's was: the host reads a guard one step late, after it has queued the next step,
// and a run stopped by a non-finite step must not move its weights afterwards. `previous`
// may be `guard` itself (a CUDA graph's step rewrites one guard): it is read before any write.
extern "C" __global__ void step_guard(const double* partial, i64 count, const float* loss_sum, float loss_divisor,
                                      float max_norm, const float* previous, float* guard) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (i64 i = 0; i < count; ++i) total += partial[i];
    const float norm = (float)sqrt(total);
    const float loss = loss_sum[0] / loss_divisor;
    const bool finite = is_finite(loss) && is_finite(norm);
    const bool allowed = previous == nullptr || previous[GUARD_UPDATE] != 0.0f;
    guard[GUARD_UPDATE] = finite && allowed ? 1.0f : 0.0f;
    guard[GUARD_SCALE] = finite && norm > max_norm ? max_norm / (norm + 1e-6f) : 1.0f;
    guard[GUARD_NORM] = norm;
    guard[GUARD_LOSS] = loss;
}

// torch.optim.SGD with dampening 0: d = g + wd·p; buf ← momentum·buf + d;
// p ← p − lr·(nesterov ? d + momentum·buf : buf). With momentum == 0 (use_buffer = 0) the
// buffer is not touched: p ← p − lr·d. The learning rate is read from device memory
// (learning_rate[0]), where the host writes each step's before the update.
extern "C" __global__ void sgd_step(float* param, const float* grad, float* buf, i64 n, const float* learning_rate,
                                    float momentum, float weight_decay, int nesterov, int use_buffer) {
    const float lr = learning_rate[0];
    GRID_STRIDE(i, n) {
        float p = param[i];
        float d = grad[i] + weight_decay * p;
        if (use_buffer) {
            float b = momentum * buf[i] + d;
            buf[i] = b;
            param[i] = p - lr * (nesterov ? d + momentum * b : b);
        } else {
            param[i] = p - lr * d;
        }
    }
}
