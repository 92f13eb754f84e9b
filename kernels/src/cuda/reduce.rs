//! Launchers of `reduce.cu`: sums and max/argmax over one axis of `x` viewed as
//! `[outer, n, inner]`, the squared norm, and the column sums the backward kernels use.
//!
//! Mirrors `cpu::reduce`. Differences: `argmax` is a `u32` buffer (the axis must be shorter
//! than 2³²), and [`sum_squares`] waits for the device to return its `f64`. Every sum runs
//! in an order fixed by the shape (no atomics), so results repeat bit for bit.

use cudarc::driver::LaunchConfig;

use super::allocator::{DeviceBuffer, DeviceRun};
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, Result};
use super::launch::{
    address_list, address_table, block_list, block_table, check_owners, elementwise, length_list, length_table,
    per_row, ptr, ptr_at, size, LIST_LEN, TABLE_LEN, THREADS,
};
use super::module::{Arg, KernelFamily};

const FAMILY: KernelFamily = KernelFamily::Reduce;
/// Most chunks a column sum is cut into (the partial buffer is `chunks × cols`).
const MAX_CHUNKS: usize = 1024;
/// Fewest rows per chunk: 8 row lanes × 8 rows each.
const MIN_CHUNK_ROWS: usize = 64;
/// Blocks of the squared-norm reduction (each one partial).
const SQUARE_BLOCKS: usize = 1024;
/// grid.y and grid.z limit of the column-sum kernels (they loop over the rest of `outer`).
const MAX_GRID_YZ: usize = 65_535;
/// Chunks a column-sum finish adds side by side (`FINISH_CHUNKS` in common.cuh).
const FINISH_CHUNKS: usize = 32;

/// The block of a column-sum finish (`chunk_total` in common.cuh: reduce.cu's finishes and
/// norm.cu's weight gradient): 32 columns × up to [`FINISH_CHUNKS`] chunks side by side.
pub(crate) fn finish_block(chunks: usize) -> (u32, u32, u32) {
    (32, chunks.clamp(1, FINISH_CHUNKS) as u32, 1)
}

/// `(rows_per_chunk, chunks)` for `outer` column sums over `rows` each: about
/// [`MAX_CHUNKS`] chunks in all, so the partial buffer stays near `MAX_CHUNKS × cols`. At
/// least one chunk, so that a sum over no rows still launches and writes its zeros.
pub(crate) fn chunking(rows: usize, outer: usize) -> (usize, usize) {
    let target = (MAX_CHUNKS / outer.max(1)).max(1);
    let per_chunk = rows.div_ceil(target).max(MIN_CHUNK_ROWS);
    (per_chunk, rows.div_ceil(per_chunk).max(1))
}

/// `dst[o·cols + c] = Σ_r src[o·outer_stride + r·ld + c]` for `r < rows`, from raw
/// addresses; the caller has checked that every address is inside its buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn column_sums(
    dev: &CudaDevice,
    src: u64,
    outer: usize,
    rows: usize,
    cols: usize,
    ld: usize,
    outer_stride: usize,
    dst: u64,
) -> Result<()> {
    if outer == 0 || cols == 0 {
        return Ok(());
    }
    let (per_chunk, chunks) = chunking(rows, outer);
    let partial = dev.alloc::<f32>(outer * chunks * cols)?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, outer.min(MAX_GRID_YZ) as u32),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(src),
        size(outer),
        size(rows),
        size(cols),
        size(ld),
        size(outer_stride),
        size(per_chunk),
        ptr(&partial),
    ];
    dev.launch(FAMILY, "column_sums_partial", cfg, &args)?;
    finish_column_sums(dev, &partial, outer, chunks, cols, dst)
}

/// `dst[o·cols + c] = Σ_chunk partial[(o·chunks + chunk)·cols + c]`.
pub(crate) fn finish_column_sums(
    dev: &CudaDevice,
    partial: &DeviceBuffer<f32>,
    outer: usize,
    chunks: usize,
    cols: usize,
    dst: u64,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, outer.min(MAX_GRID_YZ) as u32, 1),
        block_dim: finish_block(chunks),
        shared_mem_bytes: 0,
    };
    let args = [ptr(partial), size(outer), size(chunks), size(cols), Arg::Ptr(dst)];
    dev.launch(FAMILY, "column_sums_finish", cfg, &args)
}

/// One sum of [`column_sums_many`] over `rows` rows of `src` (row stride `ld`), from raw
/// addresses the caller has checked against their buffers: `dst[c] = Σ_r src[r·ld + c]` for
/// `c < cols`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ColumnSum {
    /// Element (0, 0) of the summed matrix (f32).
    pub src: u64,
    /// Columns summed.
    pub cols: usize,
    /// Row stride of `src`.
    pub ld: usize,
    /// Where the `cols` sums go.
    pub dst: u64,
    /// `Some((rows, rows_per_chunk))`: this sum's own rows and chunks (partial sums written
    /// already chunked, as RMSNorm's backward writes its weight gradient's: `rows_per_chunk`
    /// of them a chunk); `None`: the launch's rows, chunked as [`column_sums`] chunks them.
    pub own_rows: Option<(usize, usize)>,
}

/// Several column sums over `rows` rows (or a sum's [`ColumnSum::own_rows`]): one launch per
/// [`LIST_LEN`] sums instead of two per sum. Each sum has [`column_sums`]' chunks and order
/// (f32 within a chunk, f64 across chunks), so it gives the same bits. The last block of each
/// 32 columns to finish its chunk adds up their chunks (no finish kernel).
pub(crate) fn column_sums_many(dev: &CudaDevice, rows: usize, sums: &[ColumnSum]) -> Result<()> {
    const OP: &str = "column_sums_many";
    for group in sums.chunks(LIST_LEN) {
        // Each sum's rows and rows per chunk; the grid's chunks are the most any sum has.
        let chunked: Vec<(usize, usize)> =
            group.iter().map(|s| s.own_rows.unwrap_or_else(|| (rows, chunking(rows, 1).0))).collect();
        let chunks_of = |(rows, per_chunk): (usize, usize)| rows.div_ceil(per_chunk).max(1);
        let chunks = chunked.iter().map(|&c| chunks_of(c)).max().unwrap_or(1);
        let mut partial_at = Vec::with_capacity(group.len());
        let mut partial_len = 0;
        for (s, &c) in group.iter().zip(&chunked) {
            partial_at.push(partial_len);
            partial_len += chunks_of(c) * s.cols;
        }
        // One block per 32 of each sum's own columns, the sums' blocks end to end; one arrival
        // counter per such block column.
        let (first_block, blocks) = block_list(group.iter().map(|s| s.cols.div_ceil(32)));
        if blocks == 0 {
            continue;
        }
        let partial = dev.alloc::<f32>(partial_len)?;
        let cfg =
            LaunchConfig { grid_dim: (blocks as u32, chunks as u32, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 };
        let args = [
            address_list(group.iter().map(|s| s.src)),
            length_list(group.iter().map(|s| s.cols)),
            length_list(group.iter().map(|s| s.ld)),
            first_block,
            size(group.len()),
            length_list(chunked.iter().map(|c| c.0)),
            length_list(chunked.iter().map(|c| c.1)),
            length_list(partial_at.into_iter()),
            ptr(&partial),
            address_list(group.iter().map(|s| s.dst)),
            Arg::Ptr(dev.arrival_counters(blocks)?),
        ];
        dev.launch(FAMILY, OP, cfg, &args)?;
    }
    Ok(())
}

/// `x` viewed as `[outer, n, inner]`: `out[o·inner + i] = Σ_j x[(o·n + j)·inner + i]`.
pub fn sum_axis(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    outer: usize,
    n: usize,
    inner: usize,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "sum_axis";
    check_owners(dev, OP, &[x, out])?;
    ensure_len(OP, "x", x.len(), outer * n * inner)?;
    ensure_len(OP, "out", out.len(), outer * inner)?;
    if out.is_empty() {
        return Ok(());
    }
    if inner == 1 {
        let args = [ptr(x), size(outer), size(n), ptr(out)];
        return dev.launch(FAMILY, "sum_rows", per_row(outer, THREADS), &args);
    }
    column_sums(dev, x.device_ptr(), outer, n, inner, inner, n * inner, out.device_ptr())
}

/// Same layout: the maximum over `j` and the index of its first occurrence (NaN counts as
/// the maximum, the first NaN wins), as `cpu::reduce::max_axis`.
pub fn max_axis(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    outer: usize,
    n: usize,
    inner: usize,
    out: &mut DeviceBuffer<f32>,
    argmax: &mut DeviceBuffer<u32>,
) -> Result<()> {
    const OP: &str = "max_axis";
    check_owners(dev, OP, &[x, out])?;
    dev.check_owner(OP, argmax)?;
    ensure_len(OP, "x", x.len(), outer * n * inner)?;
    ensure_len(OP, "out", out.len(), outer * inner)?;
    ensure_len(OP, "argmax", argmax.len(), outer * inner)?;
    ensure(n > 0 || out.is_empty(), OP, || "empty axis".to_string())?;
    ensure(n <= u32::MAX as usize, OP, || format!("axis of {n} does not fit a u32 index"))?;
    if out.is_empty() {
        return Ok(());
    }
    if inner == 1 {
        let args = [ptr(x), size(outer), size(n), ptr(out), ptr(argmax)];
        return dev.launch(FAMILY, "max_rows", per_row(outer, THREADS), &args);
    }
    let args = [ptr(x), size(outer), size(n), size(inner), ptr(out), ptr(argmax)];
    dev.launch(FAMILY, "max_inner", elementwise(outer * inner), &args)
}

/// `Σ x[i]²` accumulated in f64 (for global gradient-norm clipping); waits for the device.
pub fn sum_squares(dev: &CudaDevice, x: &DeviceBuffer<f32>) -> Result<f64> {
    sum_squares_all(dev, &[x.into()])
}

/// `Σ_t Σ_i x_t[i]²` over several buffers in f64, waiting for the device once: the block
/// partials of [`sum_squares_partials`] downloaded and summed on the host in their order
/// (the global gradient norm of all parameters in one synchronisation).
pub fn sum_squares_all(dev: &CudaDevice, xs: &[DeviceRun<f32>]) -> Result<f64> {
    let partial = sum_squares_partials(dev, xs)?;
    Ok(dev.download(&partial)?.iter().sum())
}

/// The f64 partial sums of `Σ x_t[i]²` over several runs of buffers, left on the device: each
/// run's blocks (at most [`SQUARE_BLOCKS`]) in buffer order, one launch per [`TABLE_LEN`]
/// buffers, each buffer's blocks end to end along the grid (none idle beside a longer
/// buffer). Summed in their order (on the host by [`sum_squares_all`], on the device by the
/// optimizers' step guard) they give the same f64, bit for bit.
pub fn sum_squares_partials(dev: &CudaDevice, xs: &[DeviceRun<f32>]) -> Result<DeviceBuffer<f64>> {
    for x in xs {
        dev.check_owner("sum_squares", x.buffer())?;
    }
    let blocks = |x: &DeviceRun<f32>| x.len().div_ceil(THREADS as usize).min(SQUARE_BLOCKS);
    let partial = dev.alloc::<f64>(xs.iter().map(blocks).sum())?;
    let mut written = 0;
    for chunk in xs.chunks(TABLE_LEN) {
        let (first_block, chunk_blocks) = block_table(chunk.iter().map(blocks));
        if chunk_blocks == 0 {
            continue;
        }
        let cfg =
            LaunchConfig { grid_dim: (chunk_blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let args = [
            address_table(chunk.iter().map(|x| x.device_ptr())),
            length_table(chunk.iter().map(|x| x.len())),
            first_block,
            size(chunk.len()),
            ptr_at(&partial, written),
        ];
        dev.launch(FAMILY, "sum_squares_partial", cfg, &args)?;
        written += chunk_blocks;
    }
    Ok(partial)
}

#[cfg(all(test, feature = "cuda-emu"))]
pub(super) mod tests {
    use super::*;

    /// Values in [-1, 1) whose sums round differently in another order.
    pub(in crate::cuda) fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `column_sums_many` of sums of several widths (one column, part of a block, more
    /// columns than the finishing block has threads) over `rows` (rows from its last block),
    /// next to `column_sums` of each sum alone (a separate finish kernel).
    fn many_against_one_by_one(dev: &CudaDevice, rows: usize, seed: u64) {
        let widths = [1usize, 33, 300, 7];
        let ld = 304;
        let src = dev.upload(&values(rows.max(1) * ld, seed)).unwrap();
        let stale = vec![f32::NAN; ld];
        let many: Vec<DeviceBuffer<f32>> = widths.iter().map(|_| dev.upload(&stale).unwrap()).collect();
        let alone: Vec<DeviceBuffer<f32>> = widths.iter().map(|_| dev.upload(&stale).unwrap()).collect();
        let sums: Vec<ColumnSum> = widths
            .iter()
            .zip(&many)
            .enumerate()
            .map(|(i, (&cols, dst))| ColumnSum { src: src.ptr_at(i), cols, ld, dst: dst.device_ptr(), own_rows: None })
            .collect();
        column_sums_many(dev, rows, &sums).unwrap();
        for (sum, dst) in sums.iter().zip(&alone) {
            column_sums(dev, sum.src, 1, rows, sum.cols, ld, 0, dst.device_ptr()).unwrap();
        }
        for ((cols, many), alone) in widths.iter().zip(&many).zip(&alone) {
            let (many, alone) = (dev.download(many).unwrap(), dev.download(alone).unwrap());
            assert!(alone[..*cols].iter().all(|v| v.is_finite()), "{rows} rows, {cols} columns: {alone:?}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&many), bits(&alone), "{rows} rows, {cols} columns");
        }
    }

    /// The squared-norm partials of many runs of one packed buffer (as a model's gradients
    /// lie), empty runs and runs of more than [`SQUARE_BLOCKS`] blocks among them, over more
    /// than one launch's table: each run's blocks lie end to end, so its partials, summed in
    /// order, are the bits of the run's partials alone.
    #[test]
    fn squared_norm_partials_lie_run_after_run() {
        let dev = CudaDevice::emulated().unwrap();
        let lens: Vec<usize> = (0..TABLE_LEN + 9).map(|i| [0, 1, 300, 5_000][i % 4] + i).collect();
        let (lens, big) = ([lens, vec![0, 270_000, 0]].concat(), TABLE_LEN + 10);
        let packed = dev.upload(&values(lens.iter().sum(), 7)).unwrap();
        let mut at = 0;
        let runs: Vec<DeviceRun<f32>> = lens
            .iter()
            .map(|&len| {
                at += len;
                DeviceRun::new(&packed, at - len, len).unwrap()
            })
            .collect();
        let before = dev.counters();
        let partial = dev.download(&sum_squares_partials(&dev, &runs).unwrap()).unwrap();
        let launches = dev.counters().since(&before).launches_by_kernel;
        assert_eq!(launches.get("sum_squares_partial"), Some(&2), "{launches:?}");
        let mut next = 0;
        for (i, run) in runs.iter().enumerate() {
            let alone = dev.download(&sum_squares_partials(&dev, std::slice::from_ref(run)).unwrap()).unwrap();
            assert_eq!(alone.len(), run.len().div_ceil(THREADS as usize).min(SQUARE_BLOCKS), "run {i}");
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&partial[next..next + alone.len()]), bits(&alone), "run {i} of {} elements", run.len());
            next += alone.len();
        }
        assert_eq!(next, partial.len());
        assert!(runs[big].len().div_ceil(THREADS as usize) > SQUARE_BLOCKS);
    }

    #[test]
    fn many_column_sums_in_one_launch_give_the_bits_of_each_sum_alone() {
        let dev = CudaDevice::emulated().unwrap();
        // 5000 rows: 79 chunks of 64. Each shape twice: the last block leaves its counter at 0.
        for rows in [0, 3, 5000, 0, 3, 5000] {
            let before = dev.counters();
            many_against_one_by_one(&dev, rows, rows as u64);
            let launches = dev.counters().since(&before).launches_by_kernel;
            assert_eq!(launches.get("column_sums_many"), Some(&1), "{launches:?}");
        }
    }

    #[test]
    fn launches_from_several_host_threads_share_the_arrival_counters_one_at_a_time() {
        let dev = CudaDevice::emulated().unwrap();
        std::thread::scope(|scope| {
            for seed in 0..4 {
                let dev = &dev;
                scope.spawn(move || (0..5).for_each(|_| many_against_one_by_one(dev, 700, seed)));
            }
        });
    }
}
