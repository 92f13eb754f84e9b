//! Embedding lookup (a gather of rows) and its backward (a scatter-add of rows).
//!
//! weight `[V, C]`, ids `[N]`, out `[N, C]`: out[i, :] = weight[ids[i], :].
//!
//! PyTorch equivalent: `F.embedding(ids, weight)`, also `weight.index_select(0, ids)`.
//! Nothing is saved but the ids. The backward writes `dweight[v, :] = Σ_{i : ids[i] = v} dy[i, :]`
//! (zeros for ids that never occur; the crate's contract, see `lib.rs`). Since ids repeat,
//! the parallel version first groups positions by id (a counting sort) and then gives each
//! thread whole rows of `dweight`: no two threads touch the same row, and every row receives
//! its updates in increasing `i`, exactly as the sequential loop does.

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
/// CPU backward and the CUDA launcher both sum in that order, and agree bit for bit).
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
