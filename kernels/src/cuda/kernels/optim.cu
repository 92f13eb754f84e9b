// Fused optimizer updates (cpu/optim.rs), one thread per element, in place.
//
// Adam/AdamW with PyTorch's arrangement of the bias corrections:
//   p ← p·decay;  g ← g + l2·p
//   m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//   p ← p − step_size·m / (√v·inv_sqrt_correction2 + eps)
// AdamW passes decay = 1 − lr·wd, l2 = 0; Adam passes decay = 1, l2 = wd. The per-step
// scalars (step_size = lr/(1 − β1ᵗ), 1/√(1 − β2ᵗ)) are computed on the host in f64.
//
// One launch updates up to LIST_LEN tensors that share these scalars (PyTorch's
// multi-tensor apply): their addresses and lengths come by value in TensorList structs
// (common.cuh), tensor t = blockIdx.y, its elements spread over the grid's x dimension.
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

extern "C" __global__ void adam_step(TensorList params, TensorList bf16s, TensorList grads, TensorList ms,
                                     TensorList vs, TensorList lens, const float* guard, float beta1, float beta2,
                                     float eps, float step_size, float inv_sqrt_correction2, float decay, float l2) {
    if (guard && guard[GUARD_UPDATE] == 0.0f) return;
    const float scale = guard ? guard[GUARD_SCALE] : 1.0f;
    const int t = blockIdx.y;
    float* param = (float*)params.v[t];
    const float* grad = (const float*)grads.v[t];
    float* m = (float*)ms.v[t];
    float* v = (float*)vs.v[t];
    bf16_t* copy = (bf16_t*)bf16s.v[t];
    GRID_STRIDE(i, lens.v[t]) {
        float p = param[i] * decay;
        float g = fmaf(p, l2, grad[i] * scale);
        float mi = beta1 * m[i] + g * (1.0f - beta1);
        float vi = beta2 * v[i] + g * g * (1.0f - beta2);
        float denom = fmaf(sqrtf(vi), inv_sqrt_correction2, eps);
        float updated = p - mi * step_size / denom;
        param[i] = updated;
        if (copy) copy[i] = f32_to_bf16(updated);
        m[i] = mi;
        v[i] = vi;
    }
}

// The step guard, one thread: the global gradient norm ‖g‖ = √(Σ partial) (the f64 partials
// of sum_squares_partial, summed in order as the host would), the mean loss
// loss_sum / loss_divisor, and the verdict: update only when both are finite, with the
// gradients scaled by max_norm / (‖g‖ + 1e-6) when ‖g‖ > max_norm (PyTorch's
// clip_grad_norm_). The host reads the four values once the step is queued.
extern "C" __global__ void step_guard(const double* partial, i64 count, const float* loss_sum, float loss_divisor,
                                      float max_norm, float* guard) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (i64 i = 0; i < count; ++i) total += partial[i];
    const float norm = (float)sqrt(total);
    const float loss = loss_sum[0] / loss_divisor;
    const bool finite = is_finite(loss) && is_finite(norm);
    guard[GUARD_UPDATE] = finite ? 1.0f : 0.0f;
    guard[GUARD_SCALE] = finite && norm > max_norm ? max_norm / (norm + 1e-6f) : 1.0f;
    guard[GUARD_NORM] = norm;
    guard[GUARD_LOSS] = loss;
}

// torch.optim.SGD with dampening 0: d = g + wd·p; buf ← momentum·buf + d;
// p ← p − lr·(nesterov ? d + momentum·buf : buf). With momentum == 0 (use_buffer = 0) the
// buffer is not touched: p ← p − lr·d.
extern "C" __global__ void sgd_step(float* param, const float* grad, float* buf, i64 n, float lr, float momentum,
                                    float weight_decay, int nesterov, int use_buffer) {
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
