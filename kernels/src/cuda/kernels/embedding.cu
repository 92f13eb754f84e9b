// Embedding lookup and its backward (cpu/embedding.rs): weight [V, C], ids [N], out [N, C].
// The forward gathers rows; the backward sums the rows of dy of each distinct id in
// increasing position order (the positions grouped by id on the host once per batch, read
// here from device memory), with no atomics: the result is the same on every run, and the
// CPU's bit for bit.
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

// d/dweight[v] Σ_i dy_i·weight[ids_i] = Σ_{i : ids_i = v} dy_i. `table` is the grouping of the
// n ids (cpu/embedding.rs grouping_table): [rows: n | starts: n + 1 | positions: n | distinct: 1].
// Distinct id u is rows[u]; its positions are positions[starts[u] .. starts[u + 1]], increasing.
// One thread per (u, column), u < distinct (read here: the grid is sized for n, whatever the
// ids): dweight[rows[u], j] = Σ_p dy[positions[p], j], summed in that order; ids ≥ vocab are
// dropped. The launcher zeroes dweight first, so rows of ids that never occur are 0 (gradients
// are written, not added).
extern "C" __global__ void embedding_backward(const unsigned int* table, i64 n, const float* dy, float* dweight,
                                              i64 dim, i64 vocab) {
    const unsigned int* rows = table;
    const unsigned int* starts = table + n;
    const unsigned int* positions = table + 2 * n + 1;
    i64 distinct = (i64)table[3 * n + 1];
    GRID_STRIDE(e, distinct * dim) {
        i64 u = e / dim, j = e % dim;
        i64 row = (i64)rows[u];
        if (row >= vocab) continue;
        float sum = 0.0f;
        for (unsigned int p = starts[u]; p < starts[u + 1]; ++p) sum += dy[(i64)positions[p] * dim + j];
        dweight[row * dim + j] = sum;
    }
}
