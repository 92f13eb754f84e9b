// Pooling over the H×W planes of x [N, C, H, W] (cpu/pool.rs): max pooling with a square
// window (−∞ padding, floor mode, argmax saved as the winner's index in its plane) and
// global average pooling. Backward kernels write their gradients (dx = ...; not added:
// kernels/src/lib.rs).

// One output per thread: the window's maximum, scanned row by row like the CPU (a later
// value wins only when larger, or when it is NaN), and its index in the plane.
extern "C" __global__ void max_pool2d_forward(const float* x, i64 planes, i64 height, i64 width, i64 kernel,
                                              i64 stride, i64 padding, i64 out_h, i64 out_w, float* y,
                                              unsigned int* argmax) {
    GRID_STRIDE(i, planes * out_h * out_w) {
        const i64 plane = i / (out_h * out_w), o = i % (out_h * out_w);
        const i64 oh = o / out_w, ow = o % out_w;
        const i64 h_end = min(max(oh * stride + kernel - padding, (i64)0), height);
        const i64 w_end = min(max(ow * stride + kernel - padding, (i64)0), width);
        const i64 h_lo = min(max(oh * stride - padding, (i64)0), h_end);
        const i64 w_lo = min(max(ow * stride - padding, (i64)0), w_end);
        const float* xp = x + plane * height * width;
        float best = NEG_INF;
        i64 best_at = h_lo * width + w_lo;
        for (i64 ih = h_lo; ih < h_end; ++ih) {
            for (i64 iw = w_lo; iw < w_end; ++iw) {
                const i64 at = ih * width + iw;
                const float v = xp[at];
                if (v > best || is_nan(v)) {
                    best = v;
                    best_at = at;
                }
            }
        }
        y[i] = best;
        argmax[i] = (unsigned int)best_at;
    }
}

// One input per thread, gathering dy from every window that can hold it and chose it, in
// increasing output order (the order of the CPU's scatter): dx[n, c, a] = Σ dy[n, c, o]
// over the o with argmax[n, c, o] = a (0 when no window chose it).
extern "C" __global__ void max_pool2d_backward(const unsigned int* argmax, const float* dy, i64 planes, i64 height,
                                               i64 width, i64 kernel, i64 stride, i64 padding, i64 out_h,
                                               i64 out_w, float* dx) {
    GRID_STRIDE(i, planes * height * width) {
        const i64 plane = i / (height * width), at = i % (height * width);
        const i64 ih = at / width, iw = at % width;
        // Windows oh·stride − padding ≤ ih < oh·stride − padding + kernel.
        const i64 oh_lo = max(ih + padding - kernel + stride, (i64)0) / stride;
        const i64 oh_hi = min((ih + padding) / stride, out_h - 1);
        const i64 ow_lo = max(iw + padding - kernel + stride, (i64)0) / stride;
        const i64 ow_hi = min((iw + padding) / stride, out_w - 1);
        const i64 base = plane * out_h * out_w;
        float acc = 0.0f;
        for (i64 oh = oh_lo; oh <= oh_hi; ++oh) {
            for (i64 ow = ow_lo; ow <= ow_hi; ++ow) {
                const i64 o = base + oh * out_w + ow;
                if ((i64)argmax[o] == at) acc += dy[o];
            }
        }
        dx[i] = acc;
    }
}

// y[p] = mean of plane p, one plane per thread summed in order in f64 (as the CPU).
extern "C" __global__ void global_avg_pool_forward(const float* x, i64 planes, i64 spatial, float* y) {
    GRID_STRIDE(p, planes) {
        const float* xp = x + p * spatial;
        double sum = 0.0;
        for (i64 s = 0; s < spatial; ++s) sum += (double)xp[s];
        y[p] = (float)(sum / (double)spatial);
    }
}

// dx[p, s] = dy[p] / S
extern "C" __global__ void global_avg_pool_backward(const float* dy, i64 planes, i64 spatial, float* dx) {
    const float inv = 1.0f / (float)spatial;
    GRID_STRIDE(i, planes * spatial) { dx[i] = dy[i / spatial] * inv; }
}
