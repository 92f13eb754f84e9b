//! Launchers of `pool.cu`: max pooling (square window, −∞ padding, floor mode) and global
//! average pooling over the `H×W` planes of `x[N, C, H, W]`, forward and backward.
//!
//! Mirrors `cpu::pool`, except that the winners' indices (`argmax`, each an index into its
//! `H·W` plane) are `u32` on the device, and the max-pool backward gathers into each input
//! from the windows that can hold it, so it also takes the window geometry. Results are
//! those of the CPU: the same scan order in the forward (a NaN wins its window), the same
//! order of additions in the backward, and per-plane means summed in order in f64.
//! Gradients are written (`dx = ...`), never added.

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, CudaError, Result};
use super::launch::{check_owners, elementwise, ptr, size};
use super::module::KernelFamily;

pub use crate::cpu::pool::{max_pool2d_output_size, MaxPool2d};

const FAMILY: KernelFamily = KernelFamily::Pool;

/// Checks the geometry ([`MaxPool2d::check`], as on the CPU) and that a plane's indices fit
/// the device's `u32` `argmax`; returns `(OH, OW)`.
fn check(g: &MaxPool2d, op: &'static str) -> Result<(usize, usize)> {
    g.check().map_err(|message| CudaError::shape(op, message))?;
    let (height, width) = (g.height, g.width);
    ensure(u32::try_from(height * width).is_ok(), op, || format!("a {height}×{width} plane exceeds u32 indices"))?;
    Ok(g.output_size())
}

/// `y[N, C, OH, OW]` = the window maxima and `argmax` = each winner's index in its plane.
pub fn max_pool2d_forward(
    dev: &CudaDevice,
    g: &MaxPool2d,
    x: &DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
    argmax: &mut DeviceBuffer<u32>,
) -> Result<()> {
    const OP: &str = "max_pool2d_forward";
    check_owners(dev, OP, &[x, y])?;
    dev.check_owner(OP, argmax)?;
    let (out_h, out_w) = check(g, OP)?;
    ensure_len(OP, "x", x.len(), g.planes * g.height * g.width)?;
    ensure_len(OP, "y", y.len(), g.planes * out_h * out_w)?;
    ensure_len(OP, "argmax", argmax.len(), y.len())?;
    let args = [
        ptr(x),
        size(g.planes),
        size(g.height),
        size(g.width),
        size(g.kernel),
        size(g.stride),
        size(g.padding),
        size(out_h),
        size(out_w),
        ptr(y),
        ptr(argmax),
    ];
    dev.launch(FAMILY, "max_pool2d_forward", elementwise(y.len()), &args)
}

// d/dx[n, c, argmax[n, c, o]] = dy[n, c, o]   (summed where windows share a winner)
/// `dx = 0`, then `dx[argmax] += dy`, from the forward's `argmax`.
pub fn max_pool2d_backward(
    dev: &CudaDevice,
    g: &MaxPool2d,
    argmax: &DeviceBuffer<u32>,
    dy: &DeviceBuffer<f32>,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "max_pool2d_backward";
    check_owners(dev, OP, &[dy, dx])?;
    dev.check_owner(OP, argmax)?;
    let (out_h, out_w) = check(g, OP)?;
    ensure_len(OP, "dy", dy.len(), g.planes * out_h * out_w)?;
    ensure_len(OP, "argmax", argmax.len(), dy.len())?;
    ensure_len(OP, "dx", dx.len(), g.planes * g.height * g.width)?;
    if dy.is_empty() {
        // No windows: nothing reaches the input.
        return dev.fill_zero(dx);
    }
    let args = [
        ptr(argmax),
        ptr(dy),
        size(g.planes),
        size(g.height),
        size(g.width),
        size(g.kernel),
        size(g.stride),
        size(g.padding),
        size(out_h),
        size(out_w),
        ptr(dx),
    ];
    dev.launch(FAMILY, "max_pool2d_backward", elementwise(dx.len()), &args)
}

/// `y[p] = mean of x[p, 0..spatial)` for each of the `planes = N·C` planes.
pub fn global_avg_pool_forward(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    planes: usize,
    spatial: usize,
    y: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "global_avg_pool_forward";
    check_owners(dev, OP, &[x, y])?;
    ensure(spatial > 0, OP, || "empty planes have no mean".to_string())?;
    ensure_len(OP, "x", x.len(), planes * spatial)?;
    ensure_len(OP, "y", y.len(), planes)?;
    let args = [ptr(x), size(planes), size(spatial), ptr(y)];
    dev.launch(FAMILY, "global_avg_pool_forward", elementwise(planes), &args)
}

// d/dx[n, c, s] = dy[n, c] / S
/// `dx = dy / spatial`, broadcast over each plane.
pub fn global_avg_pool_backward(
    dev: &CudaDevice,
    dy: &DeviceBuffer<f32>,
    planes: usize,
    spatial: usize,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "global_avg_pool_backward";
    check_owners(dev, OP, &[dy, dx])?;
    ensure(spatial > 0, OP, || "empty planes have no mean".to_string())?;
    ensure_len(OP, "dy", dy.len(), planes)?;
    ensure_len(OP, "dx", dx.len(), planes * spatial)?;
    let args = [ptr(dy), size(planes), size(spatial), ptr(dx)];
    dev.launch(FAMILY, "global_avg_pool_backward", elementwise(dx.len()), &args)
}
