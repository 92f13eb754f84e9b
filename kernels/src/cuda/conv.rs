//! 2-D convolution (groups = 1, dilation = 1) on the GPU by im2col + cuBLAS, mirroring
//! `cpu::conv`: `y_n[O, P] = w[O, K]·col_n[K, P]` per image, with `K = C·KH·KW` and
//! `P = OH·OW`. A 1×1 stride-1 unpadded convolution reads `x_n[C, H·W]` as `col_n`.
//!
//! Images are processed in chunks whose im2col buffer stays under [`COL_BUDGET`] floats:
//! one im2col launch and one strided-batched GEMM per chunk. The backward writes
//! `dx = col2im(wᵀ·dy_n)`, `dw = Σ_n dy_n·col_nᵀ` (zeroed, then one GEMM per image adding
//! onto it, in image order) and `dbias = Σ dy`.

pub use crate::cpu::conv::Conv2dGeometry;

use super::allocator::DeviceBuffer;
use super::blas::{gemm, gemm_strided_batched, GemmDims, Operand, Precision};
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, Result};
use super::launch::{elementwise, per_row, ptr, ptr_at, size, THREADS};
use super::module::KernelFamily;
use crate::cpu::matmul::Store;

const FAMILY: KernelFamily = KernelFamily::Conv;
/// Most floats of one chunk's im2col buffer (256 MiB).
pub const COL_BUDGET: usize = 1 << 26;
/// Bytes per element, for raw address arithmetic.
const F32_BYTES: usize = std::mem::size_of::<f32>();

/// The derived sizes of a geometry.
#[derive(Clone, Copy)]
struct Sizes {
    positions: usize,
    depth: usize,
    x_image: usize,
    y_image: usize,
    pointwise: bool,
}

fn sizes(g: &Conv2dGeometry) -> Sizes {
    let positions = g.out_height() * g.out_width();
    Sizes {
        positions,
        depth: g.in_channels * g.kernel_h * g.kernel_w,
        x_image: g.in_channels * g.height * g.width,
        y_image: g.out_channels * positions,
        pointwise: g.kernel_h == 1 && g.kernel_w == 1 && g.stride == 1 && g.padding == 0,
    }
}

impl Sizes {
    /// Images per chunk so that the chunk's im2col buffer fits the budget.
    fn images_per_chunk(&self, batch: usize) -> usize {
        (COL_BUDGET / (self.depth * self.positions).max(1)).clamp(1, batch.max(1))
    }
}

fn check(op: &'static str, g: &Conv2dGeometry, x: usize, w: usize) -> Result<Sizes> {
    ensure(g.stride >= 1, op, || "stride must be at least 1".to_string())?;
    let s = sizes(g);
    ensure_len(op, "x", x, g.batch * s.x_image)?;
    ensure_len(op, "w", w, g.out_channels * s.depth)?;
    Ok(s)
}

/// The im2col (or col2im) kernel's geometry arguments after its two buffers.
fn geometry_args(g: &Conv2dGeometry, images: usize) -> [super::module::Arg; 10] {
    [
        size(images),
        size(g.in_channels),
        size(g.height),
        size(g.width),
        size(g.kernel_h),
        size(g.kernel_w),
        size(g.stride),
        size(g.padding),
        size(g.out_height()),
        size(g.out_width()),
    ]
}

/// `y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C,KH,KW]) (+ bias[O] if given)`.
pub fn conv2d_forward(
    dev: &CudaDevice,
    g: &Conv2dGeometry,
    x: &DeviceBuffer<f32>,
    w: &DeviceBuffer<f32>,
    bias: Option<&DeviceBuffer<f32>>,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    for buffer in [x, w, &*y].into_iter().chain(bias) {
        dev.check_owner(OP, buffer)?;
    }
    let s = check(OP, g, x.len(), w.len())?;
    ensure_len(OP, "y", y.len(), g.batch * s.y_image)?;
    if let Some(bias) = bias {
        ensure_len(OP, "bias", bias.len(), g.out_channels)?;
        let args = [ptr(bias), ptr(y), size(y.len()), size(g.out_channels), size(s.positions)];
        dev.launch(FAMILY, "fill_bias", elementwise(y.len()), &args)?;
    }
    if s.y_image == 0 {
        return Ok(());
    }
    let store = if bias.is_some() { Store::Accumulate } else { Store::Overwrite };
    let per_chunk = s.images_per_chunk(g.batch);
    let mut col = if s.pointwise { None } else { Some(dev.alloc::<f32>(per_chunk * s.depth * s.positions)?) };
    for first in (0..g.batch).step_by(per_chunk) {
        let images = per_chunk.min(g.batch - first);
        let (cols, col_stride) = match &mut col {
            None => (x.ptr_at(first * s.x_image), s.x_image),
            Some(col) => {
                let mut args = vec![ptr_at(x, first * s.x_image), ptr(col)];
                args.extend(geometry_args(g, images));
                dev.launch(FAMILY, "im2col", elementwise(images * s.depth * s.positions), &args)?;
                (col.device_ptr(), s.depth * s.positions)
            }
        };
        gemm_strided_batched(
            dev,
            GemmDims { m: g.out_channels, n: s.positions, k: s.depth },
            (Operand::rows(w.device_ptr(), s.depth), 0),
            (Operand::rows(cols, s.positions), col_stride),
            store,
            (y.ptr_at(first * s.y_image), s.positions, s.y_image),
            images,
        )?;
    }
    Ok(())
}

// d/dx_n = col2im(wᵀ·dy_n),  d/dw = Σ_n dy_n·col_nᵀ,  d/dbias[o] = Σ_{n,p} dy[n, o, p]
/// `dx = ...`, `dw = ...`, `dbias = ...` (each optional: `None` skips that gradient).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    dev: &CudaDevice,
    g: &Conv2dGeometry,
    x: &DeviceBuffer<f32>,
    w: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    dx: Option<&mut DeviceBuffer<f32>>,
    mut dw: Option<&mut DeviceBuffer<f32>>,
    dbias: Option<&mut DeviceBuffer<f32>>,
) -> Result<()> {
    const OP: &str = "conv2d_backward";
    for buffer in [x, w, dy].into_iter().chain(dx.as_deref()).chain(dw.as_deref()).chain(dbias.as_deref()) {
        dev.check_owner(OP, buffer)?;
    }
    let s = check(OP, g, x.len(), w.len())?;
    ensure_len(OP, "dy", dy.len(), g.batch * s.y_image)?;
    if let Some(dx) = &dx {
        ensure_len(OP, "dx", dx.len(), x.len())?;
    }
    if let Some(dw) = dw.as_deref_mut() {
        ensure_len(OP, "dw", dw.len(), w.len())?;
        // The per-image products add onto it in order.
        dev.fill_zero(dw)?;
    }
    if let Some(dbias) = dbias {
        ensure_len(OP, "dbias", dbias.len(), g.out_channels)?;
        let args = [ptr(dy), ptr(dbias), size(g.batch), size(g.out_channels), size(s.positions)];
        dev.launch(FAMILY, "conv_bias_grad", per_row(g.out_channels, THREADS), &args)?;
    }
    if s.y_image == 0 || s.x_image == 0 || (dx.is_none() && dw.is_none()) {
        // Nothing flows back: the gradients are zeros.
        return dx.map_or(Ok(()), |dx| dev.fill_zero(dx));
    }
    let per_chunk = s.images_per_chunk(g.batch);
    let chunk_col = per_chunk * s.depth * s.positions;
    let mut col = if s.pointwise || dw.is_none() { None } else { Some(dev.alloc::<f32>(chunk_col)?) };
    let mut dcol = if s.pointwise || dx.is_none() { None } else { Some(dev.alloc::<f32>(chunk_col)?) };
    let (o, depth, positions) = (g.out_channels, s.depth, s.positions);
    for first in (0..g.batch).step_by(per_chunk) {
        let images = per_chunk.min(g.batch - first);
        let dy_chunk = dy.ptr_at(first * s.y_image);
        if let Some(dw) = dw.as_deref() {
            // d/dw = Σ_n dy_n[O, P]·col_nᵀ[P, K], image by image in order onto the zeroed dw.
            let (cols, col_stride) = match &mut col {
                None => (x.ptr_at(first * s.x_image), s.x_image),
                Some(col) => {
                    let mut args = vec![ptr_at(x, first * s.x_image), ptr(col)];
                    args.extend(geometry_args(g, images));
                    dev.launch(FAMILY, "im2col", elementwise(images * depth * positions), &args)?;
                    (col.device_ptr(), depth * positions)
                }
            };
            for i in 0..images {
                let dy_n = Operand::rows(dy_chunk + (i * s.y_image * F32_BYTES) as u64, positions);
                let col_t = Operand::transposed(cols + (i * col_stride * F32_BYTES) as u64, positions);
                let dims = GemmDims { m: o, n: depth, k: positions };
                gemm(dev, Precision::F32, dims, dy_n, col_t, Store::Accumulate, (dw.device_ptr(), depth))?;
            }
        }
        if let Some(dx) = dx.as_deref() {
            // d/dcol_n = wᵀ[K, O]·dy_n[O, P]; pointwise convolutions write straight into dx.
            let w_t = (Operand::transposed(w.device_ptr(), depth), 0);
            let dy_rows = (Operand::rows(dy_chunk, positions), s.y_image);
            let dims = GemmDims { m: depth, n: positions, k: o };
            match &mut dcol {
                None => {
                    let out = (dx.ptr_at(first * s.x_image), positions, s.x_image);
                    gemm_strided_batched(dev, dims, w_t, dy_rows, Store::Overwrite, out, images)?;
                }
                Some(dcol) => {
                    let out = (dcol.device_ptr(), positions, depth * positions);
                    gemm_strided_batched(dev, dims, w_t, dy_rows, Store::Overwrite, out, images)?;
                    let mut args = vec![ptr(dcol), ptr_at(dx, first * s.x_image)];
                    args.extend(geometry_args(g, images));
                    dev.launch(FAMILY, "col2im", elementwise(images * s.x_image), &args)?;
                }
            }
        }
    }
    Ok(())
}
