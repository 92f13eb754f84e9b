// Batch normalisation over N and H·W for each channel of x [N, C, S] (cpu/batch_norm.rs):
// y = (x − mean[c])·rstd[c]·w[c] + b[c], rstd = 1/√(var + eps). One block per channel for
// the training passes (statistics summed in f64, two passes for a stable variance); the
// eval pass is elementwise. Gradients are written, not added (kernels/src/lib.rs):
// dx = ..., dweight = ..., dbias = ...

__device__ __forceinline__ i64 bn_index(i64 e, i64 c, i64 channels, i64 spatial) {
    return ((e / spatial) * channels + c) * spatial + e % spatial;
}

// Training mode: batch statistics (biased variance to normalise); saves mean and rstd,
// updates the running statistics with the unbiased variance (n/(n − 1)), like PyTorch.
// w, b may be null (no affine).
extern "C" __global__ void batch_norm_train_forward(const float* x, const float* w, const float* b, float* y,
                                                    float* mean, float* rstd, float* running_mean,
                                                    float* running_var, i64 batch, i64 channels, i64 spatial,
                                                    float eps, float momentum) {
    i64 count = batch * spatial;
    for (i64 c = blockIdx.x; c < channels; c += gridDim.x) {
        double s = 0.0;
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) s += (double)x[bn_index(e, c, channels, spatial)];
        double mu = block_sum_d(s) / (double)count;
        float mu32 = (float)mu;
        double ss = 0.0;
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) {
            float d = x[bn_index(e, c, channels, spatial)] - mu32;
            ss += (double)(d * d);
        }
        double var = block_sum_d(ss) / (double)count;
        double r = 1.0 / sqrt(var + (double)eps);
        float scale = (float)(r * (w ? (double)w[c] : 1.0));
        float shift = (b ? b[c] : 0.0f) - mu32 * scale;
        if (threadIdx.x == 0) {
            mean[c] = mu32;
            rstd[c] = (float)r;
            float unbiased = (float)(var * (double)count / (double)(count - 1));
            running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mu32;
            running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
        }
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) {
            i64 at = bn_index(e, c, channels, spatial);
            y[at] = x[at] * scale + shift;
        }
    }
}

// Eval mode: normalise with the running statistics.
extern "C" __global__ void batch_norm_eval_forward(const float* x, const float* w, const float* b,
                                                   const float* running_mean, const float* running_var, float* y,
                                                   i64 n, i64 channels, i64 spatial, float eps) {
    GRID_STRIDE(i, n) {
        i64 c = (i / spatial) % channels;
        float scale = (w ? w[c] : 1.0f) / sqrtf(running_var[c] + eps);
        float shift = (b ? b[c] : 0.0f) - running_mean[c] * scale;
        y[i] = x[i] * scale + shift;
    }
}

// d/dx = w·rstd/n · (n·dy − Σdy − x̂·Σ(dy·x̂)),  d/dw = Σ dy·x̂,  d/db = Σ dy
// (sums over the n = N·S values of a channel), expanded to dx = k·dy + slope·x + offset.
extern "C" __global__ void batch_norm_train_backward(const float* x, const float* w, const float* mean,
                                                     const float* rstd, const float* dy, float* dx, float* dweight,
                                                     float* dbias, i64 batch, i64 channels, i64 spatial) {
    i64 count = batch * spatial;
    for (i64 c = blockIdx.x; c < channels; c += gridDim.x) {
        float m = mean[c];
        double s = 0.0, sd = 0.0;
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) {
            i64 at = bn_index(e, c, channels, spatial);
            float g = dy[at];
            s += (double)g;
            sd += (double)(g * (x[at] - m));
        }
        double dy_sum = block_sum_d(s);
        double dy_xhat = block_sum_d(sd) * (double)rstd[c];
        if (threadIdx.x == 0) {
            if (dweight) dweight[c] = (float)dy_xhat;
            if (dbias) dbias[c] = (float)dy_sum;
        }
        double r = (double)rstd[c];
        double k = r * (w ? (double)w[c] : 1.0);
        double slope = -k * r * dy_xhat / (double)count;
        double offset = -k * dy_sum / (double)count - slope * (double)m;
        float k32 = (float)k, slope32 = (float)slope, offset32 = (float)offset;
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) {
            i64 at = bn_index(e, c, channels, spatial);
            dx[at] = k32 * dy[at] + slope32 * x[at] + offset32;
        }
    }
}
