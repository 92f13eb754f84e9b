// 2-D convolution helpers (cpu/conv.rs): im2col and its adjoint col2im for a chunk of
// images, the bias broadcast and the bias gradient. The products themselves are cuBLAS
// GEMMs (conv.rs): y_n[O, P] = w[O, K]·col_n[K, P] with K = C·KH·KW, P = OH·OW.
// Layouts: x [n, C, H, W], col [n, K, P] with row (c·KH + kh)·KW + kw, y [n, O, P].

// col[n, (c·KH + ky)·KW + kx, oh·OW + ow] = x[n, c, oh·s + ky − p, ow·s + kx − p], 0 in the padding
extern "C" __global__ void im2col(const float* x, float* col, i64 images, i64 channels, i64 height, i64 width,
                                  i64 kernel_h, i64 kernel_w, i64 stride, i64 pad, i64 out_h, i64 out_w) {
    i64 positions = out_h * out_w, taps = kernel_h * kernel_w, depth = channels * taps;
    GRID_STRIDE(i, images * depth * positions) {
        i64 p = i % positions;
        i64 r = (i / positions) % depth;
        i64 n = i / (positions * depth);
        i64 c = r / taps, ky = (r % taps) / kernel_w, kx = r % kernel_w;
        i64 ih = (p / out_w) * stride + ky - pad;
        i64 iw = (p % out_w) * stride + kx - pad;
        bool inside = ih >= 0 && ih < height && iw >= 0 && iw < width;
        col[i] = inside ? x[((n * channels + c) * height + ih) * width + iw] : 0.0f;
    }
}

// The adjoint of im2col: dx[n, c, ih, iw] = Σ of the col entries that read it (taps in
// increasing (ky, kx) order, as the CPU adds them). One thread per input element: a
// gather, so no two threads write the same element.
extern "C" __global__ void col2im(const float* col, float* dx, i64 images, i64 channels, i64 height, i64 width,
                                  i64 kernel_h, i64 kernel_w, i64 stride, i64 pad, i64 out_h, i64 out_w) {
    i64 positions = out_h * out_w, depth = channels * kernel_h * kernel_w;
    GRID_STRIDE(i, images * channels * height * width) {
        i64 iw = i % width;
        i64 ih = (i / width) % height;
        i64 c = (i / (width * height)) % channels;
        i64 n = i / (width * height * channels);
        const float* col_n = col + n * depth * positions;
        float acc = 0.0f;
        for (i64 ky = 0; ky < kernel_h; ++ky) {
            i64 y = ih + pad - ky;
            if (y < 0 || y % stride != 0 || y / stride >= out_h) continue;
            for (i64 kx = 0; kx < kernel_w; ++kx) {
                i64 xx = iw + pad - kx;
                if (xx < 0 || xx % stride != 0 || xx / stride >= out_w) continue;
                i64 row = (c * kernel_h + ky) * kernel_w + kx;
                acc += col_n[row * positions + (y / stride) * out_w + xx / stride];
            }
        }
        dx[i] = acc;
    }
}

// y[n, o, p] = bias[o] (the product is then accumulated onto it)
extern "C" __global__ void fill_bias(const float* bias, float* y, i64 n, i64 out_channels, i64 positions) {
    GRID_STRIDE(i, n) { y[i] = bias[(i / positions) % out_channels]; }
}

// d/dbias[o] = Σ_{n,p} dy[n, o, p]: one block per output channel, f64, dbias = ... (gradients
// are written, not added: kernels/src/lib.rs)
extern "C" __global__ void conv_bias_grad(const float* dy, float* dbias, i64 batch, i64 out_channels, i64 positions) {
    i64 count = batch * positions;
    for (i64 o = blockIdx.x; o < out_channels; o += gridDim.x) {
        double s = 0.0;
        for (i64 e = threadIdx.x; e < count; e += blockDim.x) {
            s += (double)dy[((e / positions) * out_channels + o) * positions + e % positions];
        }
        s = block_sum_d(s);
        if (threadIdx.x == 0) dbias[o] = (float)s;
    }
}
