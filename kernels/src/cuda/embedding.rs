//! Launchers of `embedding.cu`: the row gather and its scatter-add backward.
//!
//! Mirrors `cpu::embedding`. Both read their indices from device memory, so neither copies
//! anything from the host and neither's grid depends on the ids (a step of them can be
//! replayed as a CUDA graph once the buffers are refilled): the forward reads `ids` as a
//! `u32` run, the backward the grouping of the ids' positions by id
//! ([`crate::cpu::embedding::grouping_table`], built on the host when the batch's ids are
//! uploaded: `tensor::Tokens`), and sums each id's rows in increasing position order, without
//! atomics: deterministic, and equal to the CPU's bit for bit. Ids are not range-checked on
//! the device (that would need a wait): an id ≥ V reads as a zero row and its gradient is
//! dropped.

use super::allocator::{DeviceBuffer, DeviceRun};
use super::device::CudaDevice;
use super::error::{ensure, Result};
use super::launch::{check_owners, elementwise, ptr, run_ptr_at, size};
use super::module::KernelFamily;
use crate::cpu::embedding::grouping_table_len;

/// Checks the table is whole rows of `dim` and `rows` holds one row per id; returns V.
fn check(op: &'static str, table: usize, dim: usize, ids: usize, rows: usize) -> Result<usize> {
    ensure(rows == ids * dim, op, || format!("rows have {rows} elements, expected {} ids × {dim}", ids))?;
    ensure(dim > 0 || table == 0, op, || "zero dim with a non-empty table".to_string())?;
    ensure(dim == 0 || table.is_multiple_of(dim), op, || "table length is not a multiple of dim".to_string())?;
    Ok(table.checked_div(dim).unwrap_or(0))
}

/// `out[i, :] = weight[ids[i], :]` (weight `[V, dim]`, `ids` a run of `N` device ids).
pub fn embedding_forward(
    dev: &CudaDevice,
    weight: &DeviceBuffer<f32>,
    dim: usize,
    ids: DeviceRun<'_, u32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "embedding_forward";
    check_owners(dev, OP, &[weight, out])?;
    dev.check_owner(OP, ids.buffer())?;
    let vocab = check(OP, weight.len(), dim, ids.len(), out.len())?;
    let args = [ptr(weight), run_ptr_at(&ids, 0), ptr(out), size(ids.len()), size(dim), size(vocab)];
    dev.launch(KernelFamily::Embedding, "embedding_forward", elementwise(out.len()), &args)
}

/// `dweight[v, :] = Σ_{i : ids[i] = v} dy[i, :]` (zeros for ids that never occur), each
/// id's rows summed in increasing `i`, for the `N` ids whose
/// [`grouping_table`](crate::cpu::embedding::grouping_table) is `grouping` (`3N + 2` device
/// elements: `N` comes from its length). The kernel reads the number of distinct ids from the
/// table, so the grid is sized for `N` of them (its threads past the distinct ids do nothing).
pub fn embedding_backward(
    dev: &CudaDevice,
    grouping: DeviceRun<'_, u32>,
    dy: &DeviceBuffer<f32>,
    dim: usize,
    dweight: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_owners(dev, OP, &[dy, dweight])?;
    dev.check_owner(OP, grouping.buffer())?;
    let n = grouping.len().saturating_sub(2) / 3;
    ensure(grouping_table_len(n) == grouping.len(), OP, || {
        format!("a grouping table of {} elements is not 3N + 2 for any N", grouping.len())
    })?;
    let vocab = check(OP, dweight.len(), dim, n, dy.len())?;
    dev.fill_zero(dweight)?;
    if n == 0 || dim == 0 {
        return Ok(());
    }
    let args = [run_ptr_at(&grouping, 0), size(n), ptr(dy), ptr(dweight), size(dim), size(vocab)];
    dev.launch(KernelFamily::Embedding, "embedding_backward", elementwise(n * dim), &args)
}
