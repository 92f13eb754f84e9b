//! Launchers of `norm.cu`: RMSNorm and LayerNorm over the last axis (`x` is `[N, C]`).
//!
//! Mirrors `cpu::norm`: the forward saves `rstd` (and `mean`) per row; the backward writes
//! `dx = ...` and `dweight`/`dbias = ...` (never reads them). The parameter gradients are column
//! sums over rows in a fixed order (partial sums per chunk of rows, then the chunks in
//! order), so they repeat bit for bit. RMSNorm's backward kernel writes its weight's partial
//! sums in the pass that writes `dx` (two launches in all, or one when a later launch finishes
//! the partials: [`rms_norm_backward_partial`]); LayerNorm's come from a second pass over `x`
//! and `dy` (three).

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, CudaError, Result};
use super::launch::{check_owners, opt_ptr, per_row, ptr, row_threads, size, warp_per_row};
use super::module::{Arg, KernelFamily};
use super::reduce::{chunking, finish_block, finish_column_sums, ColumnSum};
use super::values::{output_with_twin, Values, ValuesMut};

pub use crate::cpu::norm::{NormDims, NormGrads, RowStats};

const FAMILY: KernelFamily = KernelFamily::Norm;

/// Row lanes of a chunk of rows in the parameter gradients' column sums (`NORM_ROW_LANES` in
/// `norm.cu`): lane `l` sums rows `l, l + 8, ...` of the chunk, then the lanes are added in order.
/// Also the warps of an RMSNorm block, one row (or one row lane) each.
const ROW_LANES: usize = 8;

/// The launch of an RMSNorm row kernel (`norm.cu`, and the fused gate's residual add and norm):
/// a warp per row, [`ROW_LANES`] rows a block of 256 threads.
pub(crate) fn rms_norm_rows(rows: usize) -> LaunchConfig {
    warp_per_row(rows, ROW_LANES)
}

/// [`NormDims::check`], as on the CPU, as a shape error naming `op`.
fn check(
    op: &'static str,
    dims: &NormDims,
    rows: &[(&str, usize)],
    stats: &[(&str, usize)],
    params: &[(&str, Option<usize>)],
) -> Result<()> {
    dims.check(rows, stats, params).map_err(|message| CudaError::shape(op, message))
}

/// `y = x·rstd·weight`, `rstd = 1/√(mean(x²) + eps)` saved per row. `y` is f32, with
/// `y_bf16`, when given, getting it rounded to nearest even (for the bf16 products that read
/// `y`), or bf16 alone (rounded so; no twin): under bf16 products nothing else reads it.
pub fn rms_norm_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    dims: &NormDims,
    (y, y_bf16): (ValuesMut<'_>, Option<&mut DeviceBuffer<bf16>>),
    rstd: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "rms_norm_forward";
    check_owners(dev, OP, &[x, weight, rstd])?;
    let y = y.as_values();
    let [y_f32, y_bf16] = output_with_twin(dev, OP, y, y_bf16.as_deref())?;
    check(OP, dims, &[("x", x.len()), ("y", y.len())], &[("rstd", rstd.len())], &[("weight", Some(weight.len()))])?;
    let NormDims { rows, cols, eps } = *dims;
    let args = [ptr(x), ptr(weight), y_f32, y_bf16, ptr(rstd), size(rows), size(cols), Arg::F32(eps)];
    dev.launch(FAMILY, "rms_norm_forward", rms_norm_rows(rows), &args)
}

/// The pre-ln LLaMA block's residual add and the next RMSNorm in one launch: `sum = x + delta`,
/// then [`rms_norm_forward`] of `sum` (`y` as there, and `rstd`), bit for bit as the two apart.
/// `delta` is f32, or bf16 (the sublayer's output projection, stored so under bf16 products),
/// added as its widened values. The backward is [`rms_norm_backward`] of `sum`.
pub fn add_rms_norm_forward(
    dev: &CudaDevice,
    (x, delta): (&DeviceBuffer<f32>, Values<'_>),
    weight: &DeviceBuffer<f32>,
    dims: &NormDims,
    (sum, y, y_bf16): (&mut DeviceBuffer<f32>, ValuesMut<'_>, Option<&mut DeviceBuffer<bf16>>),
    rstd: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "add_rms_norm_forward";
    check_owners(dev, OP, &[x, weight, sum, rstd])?;
    delta.check_owner(dev, OP)?;
    let y = y.as_values();
    let [y_f32, y_bf16] = output_with_twin(dev, OP, y, y_bf16.as_deref())?;
    check(
        OP,
        dims,
        &[("x", x.len()), ("delta", delta.len()), ("sum", sum.len()), ("y", y.len())],
        &[("rstd", rstd.len())],
        &[("weight", Some(weight.len()))],
    )?;
    let NormDims { rows, cols, eps } = *dims;
    let args = [
        ptr(x),
        delta.arg_at(0),
        ptr(weight),
        ptr(sum),
        y_f32,
        y_bf16,
        ptr(rstd),
        size(rows),
        size(cols),
        Arg::F32(eps),
    ];
    let kernel = delta.kernel("add_rms_norm_forward", "add_rms_norm_forward_delta_bf16");
    dev.launch(FAMILY, kernel, rms_norm_rows(rows), &args)
}

/// `dx = ∂L/∂x` and `dweight = ∂L/∂weight` (when given) for RMSNorm, from the saved `rstd`.
/// `residual`, when given, is the gradient already reaching `x` by another path (a pre-ln
/// LLaMA block's residual stream): `dx` is then the total. `dx_bf16`, when given, gets `dx`
/// rounded to nearest even (for the bf16 products that read it). `dy` is f32, or bf16 (the
/// input gradient of the bf16 products that read `y`, stored so under bf16 products).
pub fn rms_norm_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    (dy, residual): (Values<'_>, Option<&DeviceBuffer<f32>>),
    dims: &NormDims,
    (grads, dx_bf16): (NormGrads<'_, DeviceBuffer<f32>>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<()> {
    const OP: &str = "rms_norm_backward";
    let NormGrads { dx, dweight, dbias } = grads;
    ensure(dbias.is_none(), OP, || "RMSNorm has no bias".to_string())?;
    if let Some(dw) = &dweight {
        dev.check_owner(OP, dw)?;
        ensure(dw.len() == dims.cols, OP, || format!("dweight has {} elements, expected {}", dw.len(), dims.cols))?;
    }
    let inputs = (x, weight, rstd);
    let partials = backward_rows(dev, OP, inputs, (dy, residual), dims, (dx, dx_bf16), dweight.is_some())?;
    match (partials, dweight) {
        (Some(partials), Some(dw)) => partials.finish(dev, dw),
        _ => Ok(()),
    }
}

/// RMSNorm's weight gradient as its backward kernel leaves it: one partial sum per row lane
/// of each chunk of rows ([`rms_norm_backward_partial`]), finished by a later launch that sums
/// other things too (the fused gate's column sums: `fused_gate_backward_with_norm`), with no
/// launch of its own.
#[derive(Debug)]
pub struct RmsNormWeightPartials {
    lane_partial: DeviceBuffer<f32>,
    chunks: usize,
    cols: usize,
}

impl RmsNormWeightPartials {
    /// The weight gradient's length.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weight gradient into `dw` (`cols` values on the partials' device) in a launch of its
    /// own: 32 columns per block, the chunks side by side (chunk_total, common.cuh).
    pub fn finish(&self, dev: &CudaDevice, dw: &mut DeviceBuffer<f32>) -> Result<()> {
        const OP: &str = "rms_norm_weight_grad_finish";
        check_owners(dev, OP, &[&self.lane_partial, dw])?;
        ensure(dw.len() == self.cols, OP, || format!("dweight has {} elements, expected {}", dw.len(), self.cols))?;
        let cfg = LaunchConfig {
            grid_dim: (self.cols.div_ceil(32) as u32, 1, 1),
            block_dim: finish_block(self.chunks),
            shared_mem_bytes: 0,
        };
        let args = [ptr(&self.lane_partial), size(self.chunks), size(self.cols), ptr(dw)];
        dev.launch(FAMILY, OP, cfg, &args)
    }

    /// The partials' buffer, for an owner check.
    pub(crate) fn buffer(&self) -> &DeviceBuffer<f32> {
        &self.lane_partial
    }

    /// The column sum writing the weight gradient to `dw` (a device address the caller has
    /// checked): the lanes of a chunk in order in f32, then the chunks in f64, as
    /// `rms_norm_weight_grad_finish` adds them (a chunk of [`ROW_LANES`] rows, one per lane),
    /// so the same bits.
    pub(crate) fn finish_sum(&self, dw: u64) -> ColumnSum {
        let rows = (ROW_LANES * self.chunks, ROW_LANES);
        ColumnSum { src: self.lane_partial.device_ptr(), cols: self.cols, ld: self.cols, dst: dw, own_rows: Some(rows) }
    }
}

/// [`rms_norm_backward`]'s `dx` (the same launch and bits), with the weight gradient left as
/// its partial sums for a later launch to finish.
pub fn rms_norm_backward_partial(
    dev: &CudaDevice,
    (x, weight, rstd): (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
    (dy, residual): (Values<'_>, Option<&DeviceBuffer<f32>>),
    dims: &NormDims,
    (dx, dx_bf16): (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>),
) -> Result<RmsNormWeightPartials> {
    const OP: &str = "rms_norm_backward_partial";
    let partials = backward_rows(dev, OP, (x, weight, rstd), (dy, residual), dims, (dx, dx_bf16), true)?;
    Ok(partials.expect("asked for the weight's partials"))
}

/// RMSNorm's backward kernel (checked here): `dx` (and its bf16 copy), and with `weight_grad`
/// the weight gradient's lane partials.
fn backward_rows(
    dev: &CudaDevice,
    op: &'static str,
    (x, weight, rstd): (&DeviceBuffer<f32>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
    (dy, residual): (Values<'_>, Option<&DeviceBuffer<f32>>),
    dims: &NormDims,
    (dx, dx_bf16): (&mut DeviceBuffer<f32>, Option<&mut DeviceBuffer<bf16>>),
    weight_grad: bool,
) -> Result<Option<RmsNormWeightPartials>> {
    check_owners(dev, op, &[x, weight, rstd, dx])?;
    dy.check_owner(dev, op)?;
    check(
        op,
        dims,
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len()), ("residual", residual.map_or(x.len(), |r| r.len()))],
        &[("rstd", rstd.len())],
        &[("weight", Some(weight.len()))],
    )?;
    if let Some(r) = residual {
        dev.check_owner(op, r)?;
    }
    if let Some(copy) = &dx_bf16 {
        dev.check_owner(op, copy)?;
        ensure(copy.len() == dx.len(), op, || format!("dx_bf16 has {} elements, dx {}", copy.len(), dx.len()))?;
    }
    let NormDims { rows, cols, .. } = *dims;
    // The weight's gradient in the order of LayerNorm's (`layer_norm_param_grads`): one partial
    // sum per lane of each chunk of rows, written by the backward kernel, then the finish.
    let (per_chunk, chunks) = chunking(rows, 1);
    let lane_partial = weight_grad.then(|| dev.alloc::<f32>(ROW_LANES * chunks * cols)).transpose()?;
    // A block per chunk, a warp per row lane.
    let cfg =
        LaunchConfig { grid_dim: (chunks as u32, 1, 1), block_dim: (32 * ROW_LANES as u32, 1, 1), shared_mem_bytes: 0 };
    let args = [
        ptr(x),
        ptr(weight),
        ptr(rstd),
        dy.arg_at(0),
        opt_ptr(residual),
        ptr(dx),
        opt_ptr(dx_bf16.as_deref()),
        size(rows),
        size(cols),
        size(per_chunk),
        opt_ptr(lane_partial.as_ref()),
    ];
    dev.launch(FAMILY, dy.kernel("rms_norm_backward", "rms_norm_backward_dy_bf16"), cfg, &args)?;
    Ok(lane_partial.map(|lane_partial| RmsNormWeightPartials { lane_partial, chunks, cols }))
}

/// `y = (x − mean)·rstd (· weight + bias if given)`; `mean` and `rstd` saved per row.
pub fn layer_norm_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: Option<&DeviceBuffer<f32>>,
    bias: Option<&DeviceBuffer<f32>>,
    dims: &NormDims,
    y: &mut DeviceBuffer<f32>,
    stats: RowStats<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "layer_norm_forward";
    let RowStats { mean, rstd } = stats;
    check_owners(dev, OP, &[x, y, mean, rstd])?;
    check_owners(dev, OP, &weight.into_iter().chain(bias).collect::<Vec<_>>())?;
    check(
        OP,
        dims,
        &[("x", x.len()), ("y", y.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[("weight", weight.map(|w| w.len())), ("bias", bias.map(|b| b.len()))],
    )?;
    let NormDims { rows, cols, eps } = *dims;
    let args =
        [ptr(x), opt_ptr(weight), opt_ptr(bias), ptr(y), ptr(mean), ptr(rstd), size(rows), size(cols), Arg::F32(eps)];
    dev.launch(FAMILY, "layer_norm_forward", per_row(rows, row_threads(cols)), &args)
}

/// `dx = ∂L/∂x`, and `dweight`/`dbias` = their gradients when given, for LayerNorm.
pub fn layer_norm_backward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    weight: Option<&DeviceBuffer<f32>>,
    stats: RowStats<&DeviceBuffer<f32>>,
    dy: &DeviceBuffer<f32>,
    dims: &NormDims,
    grads: NormGrads<'_, DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let (RowStats { mean, rstd }, NormGrads { dx, dweight, dbias }) = (stats, grads);
    check_owners(dev, OP, &[x, mean, rstd, dy, dx])?;
    check(
        OP,
        dims,
        &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
        &[("mean", mean.len()), ("rstd", rstd.len())],
        &[
            ("weight", weight.map(|w| w.len())),
            ("dweight", dweight.as_ref().map(|w| w.len())),
            ("dbias", dbias.as_ref().map(|b| b.len())),
        ],
    )?;
    if let Some(w) = weight {
        dev.check_owner(OP, w)?;
    }
    for g in dweight.iter().chain(dbias.iter()) {
        dev.check_owner(OP, g)?;
    }
    let NormDims { rows, cols, .. } = *dims;
    let args = [ptr(x), opt_ptr(weight), ptr(mean), ptr(rstd), ptr(dy), ptr(dx), size(rows), size(cols)];
    dev.launch(FAMILY, "layer_norm_backward", per_row(rows, row_threads(cols)), &args)?;
    layer_norm_param_grads(dev, x, dy, RowStats { mean, rstd }, dims, (dweight, dbias))
}

/// LayerNorm's `dweight = Σ_rows dy ⊙ x̂`, `dbias = Σ_rows dy` (either may be absent).
fn layer_norm_param_grads(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    RowStats { mean, rstd }: RowStats<&DeviceBuffer<f32>>,
    dims: &NormDims,
    (dweight, dbias): (Option<&mut DeviceBuffer<f32>>, Option<&mut DeviceBuffer<f32>>),
) -> Result<()> {
    let NormDims { rows, cols, .. } = *dims;
    const OP: &str = "norm parameter gradients";
    if cols == 0 || (dweight.is_none() && dbias.is_none()) {
        return Ok(());
    }
    for buffer in dweight.iter().chain(dbias.iter()) {
        dev.check_owner(OP, buffer)?;
    }
    let (per_chunk, chunks) = chunking(rows, 1);
    let partial_w = dweight.as_ref().map(|_| dev.alloc::<f32>(chunks * cols)).transpose()?;
    let partial_b = dbias.as_ref().map(|_| dev.alloc::<f32>(chunks * cols)).transpose()?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, ROW_LANES as u32, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        ptr(x),
        ptr(dy),
        ptr(mean),
        ptr(rstd),
        size(rows),
        size(cols),
        size(per_chunk),
        opt_ptr(partial_w.as_ref()),
        opt_ptr(partial_b.as_ref()),
    ];
    dev.launch(FAMILY, "norm_param_grads_partial", cfg, &args)?;
    if let (Some(partial), Some(dw)) = (&partial_w, dweight) {
        finish_column_sums(dev, partial, 1, chunks, cols, dw.device_ptr())?;
    }
    if let (Some(partial), Some(db)) = (&partial_b, dbias) {
        finish_column_sums(dev, partial, 1, chunks, cols, db.device_ptr())?;
    }
    Ok(())
}

#[cfg(all(test, feature = "cuda-emu"))]
mod tests {
    use super::super::reduce::column_sums_many;
    use super::super::reduce::tests::values;
    use super::*;

    /// The weight gradient's partials finished in a column-sum launch beside other sums of
    /// other rows (as the fused gate finishes them: `finish_sum`) are the bits of
    /// `rms_norm_backward`'s own finish, and `dx` is the same launch's: for one chunk of rows,
    /// several, and a partial last chunk, and with fewer and more chunks than the other sums.
    #[test]
    fn partials_finished_in_a_column_sum_launch_are_the_finish_kernels_bits() {
        let dev = CudaDevice::emulated().unwrap();
        for (rows, cols, other_rows) in [(5, 24, 70), (300, 40, 3), (1000, 33, 200)] {
            let dims = NormDims { rows, cols, eps: 0.0 };
            let (x, dy) = (dev.upload(&values(rows * cols, 1)).unwrap(), dev.upload(&values(rows * cols, 2)).unwrap());
            let weight = dev.upload(&values(cols, 3)).unwrap();
            let rstd = dev.upload(&vec![1.25; rows]).unwrap();
            let (mut dx, mut dw) = (dev.alloc::<f32>(rows * cols).unwrap(), dev.alloc::<f32>(cols).unwrap());
            let grads = NormGrads { dx: &mut dx, dweight: Some(&mut dw), dbias: None };
            rms_norm_backward(&dev, &x, &weight, &rstd, (Values::F32(&dy), None), &dims, (grads, None)).unwrap();

            let mut partial_dx = dev.alloc::<f32>(rows * cols).unwrap();
            let inputs = (&x, &weight, &rstd);
            let partials =
                rms_norm_backward_partial(&dev, inputs, (Values::F32(&dy), None), &dims, (&mut partial_dx, None))
                    .unwrap();
            assert_eq!(partials.cols(), cols);
            let other = dev.upload(&values(other_rows * 50, 4)).unwrap();
            let (finished, other_sum) = (dev.upload(&vec![f32::NAN; cols]).unwrap(), dev.alloc::<f32>(50).unwrap());
            let other_alone = dev.alloc::<f32>(50).unwrap();
            let sum_of_other = |dst: &DeviceBuffer<f32>| ColumnSum {
                src: other.device_ptr(),
                cols: 50,
                ld: 50,
                dst: dst.device_ptr(),
                own_rows: None,
            };
            let sums = [sum_of_other(&other_sum), partials.finish_sum(finished.device_ptr())];
            column_sums_many(&dev, other_rows, &sums).unwrap();
            column_sums_many(&dev, other_rows, &[sum_of_other(&other_alone)]).unwrap();
            let bits = |b: &DeviceBuffer<f32>| dev.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&finished), bits(&dw), "dw, {rows} rows");
            assert_eq!(bits(&partial_dx), bits(&dx), "dx, {rows} rows");
            assert_eq!(bits(&other_sum), bits(&other_alone), "the other sum, {rows} rows");
        }
    }
}
