// Embedding lookup and its backward (cpu/embedding.rs): weight [V, C], ids [N], out [N, C].
// The forward gathers rows; the backward sums the rows of dy of each distinct id in
// increasing position order (the launcher groups the positions on the host), with no
// atomics: the result is the same on every run, and the CPU's bit for bit.
// Ids ≥ V are not read: their output rows are zero and their gradients are dropped (the
// launcher cannot check ids on the device without waiting for it).

// out[i, :] = weight[ids[i], :]
extern "C" __global__ void embedding_forward(const float* weight, const unsigned int* ids, float* out, i64 n, i64 dim,
                                             i64 vocab) {
    GRID_STRIDE(e, n * dim) {
        i64 i = e / dim, j = e % dim;
        i64 id = (i64)ids[i];
        out[e] = id < vocab ? weight[id * dim + j] : 0.0f;
    }
}

// d/dweight[v] Σ_i dy_i·weight[ids_i] = Σ_{i : ids_i = v} dy_i. Distinct id u is rows[u]; its
// positions are positions[starts[u] .. starts[u + 1]], increasing. One thread per (u, column):
// dweight[rows[u], j] = Σ_p dy[positions[p], j], summed in that order. The launcher zeroes
// dweight first, so rows of ids that never occur are 0 (gradients are written, not added).
extern "C" __global__ void embedding_backward(const unsigned int* rows, const unsigned int* starts,
                                              const unsigned int* positions, const float* dy, float* dweight,
                                              i64 distinct, i64 dim) {
    GRID_STRIDE(e, distinct * dim) {
        i64 u = e / dim, j = e % dim;
        float sum = 0.0f;
        for (unsigned int p = starts[u]; p < starts[u + 1]; ++p) sum += dy[(i64)positions[p] * dim + j];
        dweight[(i64)rows[u] * dim + j] = sum;
    }
}
