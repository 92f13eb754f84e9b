//! Launchers of `embedding.cu`: the row gather and its scatter-add backward.
//!
//! Mirrors `cpu::embedding` with `ids` as a `u32` device buffer. The backward adds with
//! `atomicAdd`, so the order of additions into a repeated row is not fixed (the CPU's is):
//! results agree to rounding, not bit for bit. Ids are not range-checked on the device
//! (that would need a wait): an id ≥ V reads as a zero row and its gradient is dropped.

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

/// `dweight[ids[i], :] += dy[i, :]` (scatter-add; ids may repeat).
pub fn embedding_backward(
    dev: &CudaDevice,
    ids: &DeviceBuffer<u32>,
    dy: &DeviceBuffer<f32>,
    dim: usize,
    dweight: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_owners(dev, OP, &[dy, dweight])?;
    dev.check_owner(OP, ids)?;
    let vocab = check(OP, dweight.len(), dim, ids.len(), dy.len())?;
    let args = [ptr(ids), ptr(dy), ptr(dweight), size(ids.len()), size(dim), size(vocab)];
    dev.launch(KernelFamily::Embedding, "embedding_backward", elementwise(dy.len()), &args)
}
