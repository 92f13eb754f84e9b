//! Launch geometry and argument helpers shared by the launchers.

use cudarc::driver::LaunchConfig;

use super::allocator::{DeviceBuffer, DeviceRun, DeviceScalar};
use super::device::CudaDevice;
use super::error::{CudaError, Result};
use super::module::Arg;

/// Entries of a `TensorList` (common.cuh): the tensors one multi-tensor launch takes.
pub(crate) const LIST_LEN: usize = 64;

/// The device addresses of up to [`LIST_LEN`] buffers as a `TensorList` argument.
pub(crate) fn address_list(addresses: impl Iterator<Item = u64>) -> Arg {
    Arg::Ptrs(filled(addresses))
}

/// Up to [`LIST_LEN`] sizes as a `TensorList` argument.
pub(crate) fn length_list(lengths: impl Iterator<Item = usize>) -> Arg {
    Arg::Lengths(filled(lengths.map(|len| len as i64)))
}

/// Entries of a `TensorTable` (common.cuh): the tensors of one optimizer or squared-norm
/// launch, a model's whole parameter group.
pub(crate) const TABLE_LEN: usize = 512;

/// The device addresses of up to [`TABLE_LEN`] buffers as a `TensorTable` argument.
pub(crate) fn address_table(addresses: impl Iterator<Item = u64>) -> Arg {
    Arg::PtrTable(Box::new(filled(addresses)))
}

/// Up to [`TABLE_LEN`] sizes as a `TensorTable` argument.
pub(crate) fn length_table(lengths: impl Iterator<Item = usize>) -> Arg {
    Arg::LengthTable(Box::new(filled(lengths.map(|len| len as i64))))
}

/// The first `N` of `values`, then zeros: a list's or table's entries (unused ones 0).
fn filled<const N: usize, T: Copy + Default>(values: impl Iterator<Item = T>) -> [T; N] {
    let mut v = [T::default(); N];
    for (slot, value) in v.iter_mut().zip(values) {
        *slot = value;
    }
    v
}

/// The blocks of a multi-tensor launch laid end to end along grid.x, `blocks[e]` for entry e
/// (`list_entry_of_block` in common.cuh): each entry's first block as a `TensorList`
/// argument, and the total (the grid's x).
pub(crate) fn block_list(blocks: impl Iterator<Item = usize>) -> (Arg, usize) {
    let (first, total) = first_blocks(blocks);
    (length_list(first.into_iter()), total)
}

/// [`block_list`] as a `TensorTable` argument (`table_entry_of_block` in common.cuh).
pub(crate) fn block_table(blocks: impl Iterator<Item = usize>) -> (Arg, usize) {
    let (first, total) = first_blocks(blocks);
    (length_table(first.into_iter()), total)
}

/// Each entry's first block when `blocks[e]` are laid end to end, and their total.
fn first_blocks(blocks: impl Iterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut total = 0;
    let first = blocks
        .map(|b| {
            total += b;
            total - b
        })
        .collect();
    (first, total)
}

/// Threads per block of the elementwise and row kernels.
pub(crate) const THREADS: u32 = 256;
/// Cap on the blocks of a grid-stride launch (the kernels loop over the rest).
const MAX_BLOCKS: usize = 1 << 16;

/// A grid-stride launch over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).min(MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Cap on the blocks of a row launch (the kernels loop over the rest).
const MAX_ROW_BLOCKS: usize = 1 << 20;

/// One block per row (row kernels loop `r += gridDim.x` past the cap), `threads` each.
pub(crate) fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.min(MAX_ROW_BLOCKS) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// One warp per row, `warps` rows a block (row kernels loop `r += gridDim.x·warps` past the cap).
pub(crate) fn warp_per_row(rows: usize, warps: usize) -> LaunchConfig {
    let blocks = rows.div_ceil(warps).clamp(1, MAX_ROW_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * warps as u32, 1, 1), shared_mem_bytes: 0 }
}

/// Threads for a block that walks a row of `cols`: a warp multiple between 32 and 256.
pub(crate) fn row_threads(cols: usize) -> u32 {
    cols.next_power_of_two().clamp(32, THREADS as usize) as u32
}

/// The device address of `buffer` as a kernel argument.
pub(crate) fn ptr<T: DeviceScalar>(buffer: &DeviceBuffer<T>) -> Arg {
    Arg::Ptr(buffer.device_ptr())
}

/// The device address of element `offset` of `buffer`.
pub(crate) fn ptr_at<T: DeviceScalar>(buffer: &DeviceBuffer<T>, offset: usize) -> Arg {
    Arg::Ptr(buffer.ptr_at(offset))
}

/// The device address of element `offset` of `run` (`offset ≤ len`): indices read in place
/// from a part of a larger buffer (a batch's token ids).
pub(crate) fn run_ptr_at<T: DeviceScalar>(run: &DeviceRun<T>, offset: usize) -> Arg {
    debug_assert!(offset <= run.len(), "run_ptr_at: offset past the end");
    Arg::Ptr(run.device_ptr() + (offset * std::mem::size_of::<T>()) as u64)
}

/// An optional buffer's address, or a null pointer.
pub(crate) fn opt_ptr<T: DeviceScalar>(buffer: Option<&DeviceBuffer<T>>) -> Arg {
    Arg::Ptr(buffer.map_or(0, DeviceBuffer::device_ptr))
}

/// A size or index as `long long`.
pub(crate) fn size(v: usize) -> Arg {
    Arg::I64(v as i64)
}

/// A small integer (op code, flag, rank) as `int`.
pub(crate) fn int(v: i32) -> Arg {
    Arg::I32(v)
}

/// Checks that every buffer belongs to `dev` (launching on another device's memory would
/// be undefined behaviour).
pub(crate) fn check_owners(dev: &CudaDevice, op: &'static str, buffers: &[&DeviceBuffer<f32>]) -> Result<()> {
    buffers.iter().try_for_each(|b| dev.check_owner(op, b))
}

/// Errors with `op`'s name unless `value` fits an `int` (cuBLAS and some kernel indices).
pub(crate) fn to_i32(op: &'static str, name: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| CudaError::shape(op, format!("{name} = {value} exceeds 2^31 − 1")))
}
