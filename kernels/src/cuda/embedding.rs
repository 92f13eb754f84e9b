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
use super::launch::{check_owners, elementwise, ptr, size};
use super::module::KernelFamily;

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

/// `dweight[ids[i], :] += dy[i, :]` for every `i` (ids may repeat; host `ids`), each id's
/// rows summed in increasing `i` (see the module doc).
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
    let grouped = group_positions(ids, vocab);
    if grouped.rows.is_empty() || dim == 0 {
        return Ok(());
    }
    let (rows, starts, positions) =
        (dev.upload(&grouped.rows)?, dev.upload(&grouped.starts)?, dev.upload(&grouped.positions)?);
    let distinct = grouped.rows.len();
    let args = [ptr(&rows), ptr(&starts), ptr(&positions), ptr(dy), ptr(dweight), size(distinct), size(dim)];
    // The three index buffers go back to the pool on return; later users queue after this kernel.
    dev.launch(KernelFamily::Embedding, "embedding_backward", elementwise(distinct * dim), &args)
}

/// The positions of each distinct id in CSR form: id `rows[u]` sits at
/// `positions[starts[u]..starts[u + 1]]`, in increasing order.
struct GroupedPositions {
    rows: Vec<u32>,
    starts: Vec<u32>,
    positions: Vec<u32>,
}

/// Groups the positions of `ids` by id (ids ≥ `vocab` dropped), keeping each id's positions
/// in increasing order (a stable sort).
fn group_positions(ids: &[u32], vocab: usize) -> GroupedPositions {
    let mut positions: Vec<u32> = (0..ids.len() as u32).filter(|&i| (ids[i as usize] as usize) < vocab).collect();
    positions.sort_by_key(|&i| ids[i as usize]);
    let (mut rows, mut starts) = (Vec::new(), Vec::new());
    for (p, &i) in positions.iter().enumerate() {
        let id = ids[i as usize];
        if rows.last() != Some(&id) {
            rows.push(id);
            starts.push(p as u32);
        }
    }
    starts.push(positions.len() as u32);
    GroupedPositions { rows, starts, positions }
}
