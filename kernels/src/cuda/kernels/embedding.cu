// Embedding lookup and its backward (cpu/embedding.rs): weight [V, C], ids [N], out [N, C].
// The forward gathers rows; the backward scatter-adds rows of dy into dweight with
// atomicAdd (ids repeat), so the order of additions into a repeated row is not fixed.
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

// d/dweight[v] Σ_i dy_i·weight[ids_i] = Σ_{i : ids_i = v} dy_i:  dweight[ids[i], :] += dy[i, :]
extern "C" __global__ void embedding_backward(const unsigned int* ids, const float* dy, float* dweight, i64 n, i64 dim,
                                              i64 vocab) {
    GRID_STRIDE(e, n * dim) {
        i64 i = e / dim, j = e % dim;
        i64 id = (i64)ids[i];
        if (id < vocab) atomicAdd(&dweight[id * dim + j], dy[e]);
    }
}
