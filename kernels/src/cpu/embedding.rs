//! Embedding lookup (a gather of rows) and its backward (a scatter-add of rows).
//!
//! weight `[V, C]`, ids `[N]`, out `[N, C]`: out[i, :] = weight[ids[i], :].
//!
//! PyTorch equivalent: `F.embedding(ids, weight)`, also `weight.index_select(0, ids)`.
//! Nothing is saved but the ids. The backward writes `dweight[v, :] = Σ_{i : ids[i] = v} dy[i, :]`
//! (zeros for ids that never occur; the crate's contract, see `lib.rs`). Since ids repeat,
//! the parallel version first groups positions by id (a counting sort) and then gives each
//! thread whole rows of `dweight`: no two threads touch the same row, and every row receives
//! its updates in increasing `i`, exactly as the sequential loop does. [`grouping_table`] is
//! the same grouping for the CUDA backward, as one `u32` table over the distinct ids
//! (`tensor::Tokens` uploads it with the ids, once per batch).

use super::binary::add_assign;
use super::parallel;

/// out[i, :] = weight[ids[i], :]   (weight [V, dim]); also serves index_select over rows.
pub fn embedding_forward(weight: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    check(weight.len(), dim, ids, out.len(), "embedding_forward");
    parallel::for_each_row_block_mut(out, dim, dim, |first, block| {
        for (row, &id) in block.chunks_mut(dim).zip(&ids[first..]) {
            row.copy_from_slice(&weight[id as usize * dim..][..dim]);
        }
    });
}

/// `dweight[v, :] = Σ_{i : ids[i] = v} dy[i, :]`: a scatter-add of rows over a zeroed table
/// (ids repeat, so the parallel path groups positions by id first).
pub fn embedding_backward(ids: &[u32], dy: &[f32], dim: usize, dweight: &mut [f32]) {
    check(dweight.len(), dim, ids, dy.len(), "embedding_backward");
    // d/dweight[v] Σ_i dy_i · weight[ids_i] = Σ_{i : ids_i = v} dy_i
    if dim == 0 {
        return;
    }
    if !parallel::should_parallelise(dy.len()) {
        dweight.fill(0.0);
        for (&id, row) in ids.iter().zip(dy.chunks(dim)) {
            add_assign(&mut dweight[id as usize * dim..][..dim], row);
        }
        return;
    }
    let vocab = dweight.len() / dim;
    let PositionsById { starts, positions } = positions_by_id(ids, vocab);
    // Rows with no updates cost one comparison, so a row's work is counted as 1 + its share.
    let work_per_row = 1 + dy.len() / vocab;
    parallel::for_each_row_block_mut(dweight, dim, work_per_row, |first, block| {
        for (v, row) in (first..).zip(block.chunks_mut(dim)) {
            row.fill(0.0);
            for &i in &positions[starts[v]..starts[v + 1]] {
                add_assign(row, &dy[i * dim..][..dim]);
            }
        }
    });
}

/// The positions of each id in CSR form: `positions[starts[v]..starts[v + 1]]` are the `i`
/// with `ids[i] == v`, in increasing order, so a row's additions run in position order (the
/// CPU backward sums in that order, and the CUDA kernel over [`grouping_table`]'s positions:
/// the two agree bit for bit).
pub struct PositionsById {
    /// `V + 1` offsets into `positions`.
    pub starts: Vec<usize>,
    /// Every position whose id is below `V`, grouped by id.
    pub positions: Vec<usize>,
}

/// Counting sort of the positions of `ids` by id (ids ≥ `vocab` are dropped).
pub fn positions_by_id(ids: &[u32], vocab: usize) -> PositionsById {
    let mut starts = vec![0usize; vocab + 1];
    for &id in ids.iter().filter(|&&id| (id as usize) < vocab) {
        starts[id as usize + 1] += 1;
    }
    for v in 0..vocab {
        starts[v + 1] += starts[v];
    }
    let mut next = starts.clone();
    let mut positions = vec![0usize; starts[vocab]];
    for (i, &id) in ids.iter().enumerate().filter(|&(_, &id)| (id as usize) < vocab) {
        positions[next[id as usize]] = i;
        next[id as usize] += 1;
    }
    PositionsById { starts, positions }
}

/// Elements of the [`grouping_table`] of `n` ids: `3n + 2`.
pub fn grouping_table_len(n: usize) -> usize {
    3 * n + 2
}

/// The positions of `ids` grouped by id, as the one `u32` table the CUDA backward
/// (`cuda::embedding::embedding_backward`) reads from device memory, laid out as
/// `[rows: N | starts: N + 1 | positions: N | distinct: 1]` ([`grouping_table_len`]):
/// the distinct ids ascend in `rows[..distinct]`, id `rows[u]` sits at
/// `positions[starts[u]..starts[u + 1]]`, positions increasing, and `rows` and `starts` are
/// zero past `distinct` (and `distinct + 1`). Every id is kept, whatever its value: the
/// table is built without knowing the vocabulary (a batch's `Tokens` are), and the kernel
/// drops ids ≥ V itself. A sort of `(id, position)` pairs rather than [`positions_by_id`]'s
/// counting sort, whose counts would span every value up to the largest id (an ignore index
/// such as `u32::MAX` among targets). `ids.len()` must fit a `u32` (the tensor layer checks).
pub fn grouping_table(ids: &[u32]) -> Vec<u32> {
    let n = ids.len();
    assert!(u32::try_from(n).is_ok(), "grouping_table: {n} ids do not fit u32 positions");
    // (id, position) packed in one u64 sorts by id, then by position: an unstable sort of
    // distinct keys gives the stable order.
    let mut keys: Vec<u64> = ids.iter().enumerate().map(|(i, &id)| (u64::from(id) << 32) | i as u64).collect();
    keys.sort_unstable();
    let mut table = vec![0u32; grouping_table_len(n)];
    let (rows, rest) = table.split_at_mut(n);
    let (starts, rest) = rest.split_at_mut(n + 1);
    let (positions, distinct) = rest.split_at_mut(n);
    let mut groups = 0;
    for (p, &key) in keys.iter().enumerate() {
        let id = (key >> 32) as u32;
        if groups == 0 || rows[groups - 1] != id {
            rows[groups] = id;
            starts[groups] = p as u32;
            groups += 1;
        }
        positions[p] = key as u32;
    }
    starts[groups] = n as u32;
    distinct[0] = groups as u32;
    table
}

/// Scalar reference gather (tests and benches).
pub fn embedding_reference(weight: &[f32], dim: usize, ids: &[u32]) -> Vec<f32> {
    ids.iter().flat_map(|&id| weight[id as usize * dim..][..dim].iter().copied()).collect()
}

fn check(table_len: usize, dim: usize, ids: &[u32], rows_len: usize, what: &str) {
    assert_eq!(rows_len, ids.len() * dim, "{what}: rows have the wrong length");
    assert!(dim > 0 || table_len == 0, "{what}: zero dim with a non-empty table");
    let vocab = table_len.checked_div(dim).unwrap_or(0);
    assert!(table_len.is_multiple_of(dim), "{what}: table length is not a multiple of dim");
    assert!(dim == 0 || ids.iter().all(|&id| (id as usize) < vocab), "{what}: id out of range");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scatter_reference(ids: &[u32], dy: &[f32], dim: usize, mut dweight: Vec<f32>) -> Vec<f32> {
        for (i, &id) in ids.iter().enumerate() {
            for j in 0..dim {
                dweight[id as usize * dim + j] += dy[i * dim + j];
            }
        }
        dweight
    }

    proptest! {
        #[test]
        fn gather_and_scatter_match_reference(
            ids in prop::collection::vec(0u32..7, 0..40),
            dim in 1usize..20,
        ) {
            let vocab = 7;
            let weight: Vec<f32> = (0..vocab * dim).map(|i| i as f32 * 0.5).collect();
            let mut out = vec![0.0; ids.len() * dim];
            embedding_forward(&weight, dim, &ids, &mut out);
            prop_assert_eq!(&out, &embedding_reference(&weight, dim, &ids));
            let dy: Vec<f32> = (0..out.len()).map(|i| (i % 9) as f32 - 4.0).collect();
            // Stale (NaN) contents: every row is written, unused ids with zeros.
            let mut dweight = vec![f32::NAN; vocab * dim];
            embedding_backward(&ids, &dy, dim, &mut dweight);
            prop_assert_eq!(dweight, scatter_reference(&ids, &dy, dim, vec![0.0; vocab * dim]));
        }
    }

    #[test]
    fn grouping_table_lists_each_id_once_with_its_positions_in_order() {
        let ids = [5, 2, 5, u32::MAX, 2, 5];
        let table = grouping_table(&ids);
        let n = ids.len();
        assert_eq!(table.len(), grouping_table_len(n));
        let (rows, starts, positions, distinct) =
            (&table[..n], &table[n..2 * n + 1], &table[2 * n + 1..3 * n + 1], table[3 * n + 1]);
        assert_eq!(distinct, 3);
        assert_eq!(rows, [2, 5, u32::MAX, 0, 0, 0], "ascending, zero padding");
        assert_eq!(starts, [0, 2, 5, 6, 0, 0, 0], "offsets, zero padding");
        assert_eq!(positions, [1, 4, 0, 2, 5, 3], "each id's positions increasing");
        // No ids: starts [0] and distinct 0.
        assert_eq!(grouping_table(&[]), [0, 0]);
    }

    #[test]
    fn parallel_scatter_is_exact_with_repeats() {
        let (vocab, dim, n) = (1000, 64, 4096);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * i + 3 * i) % 97).collect();
        let dy: Vec<f32> = (0..n * dim).map(|i| ((i * 7) % 13) as f32 * 0.37 - 2.0).collect();
        let mut dweight = vec![f32::NAN; vocab * dim];
        embedding_backward(&ids, &dy, dim, &mut dweight);
        let want = scatter_reference(&ids, &dy, dim, vec![0.0; vocab * dim]);
        // Same order of additions per row as the sequential loop: bit-identical.
        assert_eq!(dweight, want);
        let mut out = vec![0.0; n * dim];
        embedding_forward(&want, dim, &ids, &mut out);
        assert_eq!(out, embedding_reference(&want, dim, &ids));
    }
}
