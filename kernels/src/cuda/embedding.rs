//! Launchers of `embedding.cu`: the row gather and its scatter-add backward.
//!
//! Mirrors `cpu::embedding`. The forward reads `ids` from a `u32` device buffer; the
//! backward takes them on the host, groups the positions of each distinct id there and sums
//! each id's rows in increasing position order, without atomics: deterministic, and equal to
//! the CPU's bit for bit when `dweight` starts at zero. Ids are not range-checked on the
//! device (that would need a wait): an id ≥ V reads as a zero row and its gradient is
//! dropped.

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, ptr, ptr_at, size};
use super::module::KernelFamily;
use crate::cpu::embedding::{positions_by_id, PositionsById};

/// Checks the table is whole rows of `dim` and `rows` holds one row per id; returns V.
fn check(op: &'static str, table: usize, dim: usize, ids: usize, rows: usize) -> Result<usize> {
    ensure(rows == ids * dim, op, || format!("rows have {rows} elements, expected {} ids × {dim}", ids))?;
    ensure(dim > 0 || table == 0, op, || "zero dim with a non-empty table".to_string())?;
    ensure(dim == 0 || table.is_multiple_of(dim), op, || "table length is not a multiple of dim".to_string())?;
    Ok(table.checked_div(dim).unwrap_or(0))
}

/// `out[i, :] = weight[ids[i], :]` (weight `[V, dim]`).
pub fn embedding_forward(
    dev: &CudaDevice,
    weight: &DeviceBuffer<f32>,
    dim: usize,
    ids: &DeviceBuffer<u32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "embedding_forward";
    check_owners(dev, OP, &[weight, out])?;
    dev.check_owner(OP, ids)?;
    let vocab = check(OP, weight.len(), dim, ids.len(), out.len())?;
    let args = [ptr(weight), ptr(ids), ptr(out), size(ids.len()), size(dim), size(vocab)];
    dev.launch(KernelFamily::Embedding, "embedding_forward", elementwise(out.len()), &args)
}

/// `dweight[v, :] = Σ_{i : ids[i] = v} dy[i, :]` (zeros for ids that never occur; host
/// `ids`), each id's rows summed in increasing `i` (see the module doc).
pub fn embedding_backward(
    dev: &CudaDevice,
    ids: &[u32],
    dy: &DeviceBuffer<f32>,
    dim: usize,
    dweight: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_owners(dev, OP, &[dy, dweight])?;
    let vocab = check(OP, dweight.len(), dim, ids.len(), dy.len())?;
    dev.fill_zero(dweight)?;
    let grouped = group_positions(ids, vocab);
    if grouped.rows.is_empty() || dim == 0 {
        return Ok(());
    }
    // One upload of the three index arrays, back to back: rows | starts | positions.
    let distinct = grouped.rows.len();
    let table: Vec<u32> = [grouped.rows, grouped.starts, grouped.positions].concat();
    let table = dev.upload(&table)?;
    let (rows, starts, positions) = (ptr_at(&table, 0), ptr_at(&table, distinct), ptr_at(&table, 2 * distinct + 1));
    let args = [rows, starts, positions, ptr(dy), ptr(dweight), size(distinct), size(dim)];
    // The index table goes back to the pool on return; later users queue after this kernel.
    dev.launch(KernelFamily::Embedding, "embedding_backward", elementwise(distinct * dim), &args)
}

/// The distinct ids (`rows`) of [`positions_by_id`]'s grouping, with `starts` compacted to
/// them, as the kernel reads them: id `rows[u]` sits at `positions[starts[u]..starts[u + 1]]`.
struct GroupedPositions {
    rows: Vec<u32>,
    starts: Vec<u32>,
    positions: Vec<u32>,
}

fn group_positions(ids: &[u32], vocab: usize) -> GroupedPositions {
    let PositionsById { starts: by_id, positions } = positions_by_id(ids, vocab);
    let (mut rows, mut starts) = (Vec::new(), Vec::new());
    for (v, bounds) in by_id.windows(2).enumerate().filter(|(_, b)| b[1] > b[0]) {
        rows.push(v as u32);
        starts.push(bounds[0] as u32);
    }
    starts.push(positions.len() as u32);
    GroupedPositions { rows, starts, positions: positions.into_iter().map(|i| i as u32).collect() }
}
