//! The CUDA branch of `ops/elementwise.rs`: unary functions and their backward,
//! broadcasting binary ops, scalar ops, in-place accumulation and `select`.

use kernels::cuda::elementwise as launch;
use kernels::cuda::elementwise::{Binary, Unary};

use super::{accumulated, output};
use crate::{Result, Tensor};

/// `f(x)` elementwise.
pub(crate) fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
    let dev = x.cuda_device("unary")?;
    let x = x.dense()?;
    output(&dev, "unary", x.shape(), |y| Ok(launch::unary_forward(&dev, op, x.cuda_f32("unary")?, y)?))
}

/// `dy · f'(x)` from the saved input and output.
pub(crate) fn unary_backward(op: Unary, x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "unary_backward";
    let dev = x.cuda_device(OP)?;
    let (x, y, dy) = (x.dense()?, y.dense()?, dy.dense()?);
    accumulated(&dev, OP, x.shape(), |dx| {
        Ok(launch::unary_backward(&dev, op, x.cuda_f32(OP)?, y.cuda_f32(OP)?, dy.cuda_f32(OP)?, dx)?)
    })
}

/// `a op b` over `shape`, both already expanded to it (strides 0 where broadcast).
pub(crate) fn binary(a: &Tensor, b: &Tensor, op: Binary, shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "binary";
    let dev = a.cuda_device(OP)?;
    let (a_buffer, b_buffer) = (buffer_of(a, OP)?, buffer_of(b, OP)?);
    output(&dev, OP, shape, |out| {
        Ok(launch::binary_forward(
            &dev, op, a_buffer, a.offset, &a.strides, b_buffer, b.offset, &b.strides, shape, out,
        )?)
    })
}

/// `x op s` for a scalar `s`.
pub(crate) fn scalar_op(x: &Tensor, op: Binary, s: f32) -> Result<Tensor> {
    const OP: &str = "scalar_op";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    output(&dev, OP, x.shape(), |out| Ok(launch::scalar_forward(&dev, op, x.cuda_f32(OP)?, s, out)?))
}

/// `dst += src` in place when `dst` solely owns a dense buffer (gradient accumulation);
/// `None` when it does not, and the caller allocates a new sum instead.
pub(crate) fn add_in_place(dst: &mut Tensor, src: &Tensor) -> Result<Option<()>> {
    const OP: &str = "accumulate";
    if !dst.is_contiguous() || dst.offset != 0 || dst.storage.len() != dst.numel() {
        return Ok(None);
    }
    let dev = dst.cuda_device(OP)?;
    let src = src.dense()?;
    let Some(crate::Storage::Cuda(storage)) = std::sync::Arc::get_mut(&mut dst.storage) else { return Ok(None) };
    let dst_buffer = storage.f32_buffer_mut(OP)?;
    launch::add_assign(&dev, dst_buffer, src.cuda_f32(OP)?)?;
    Ok(Some(()))
}

/// `cond ? a : b`, all three dense and of one shape.
pub(crate) fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "select";
    let dev = a.cuda_device(OP)?;
    let (cond, a, b) = (cond.dense()?, a.dense()?, b.dense()?);
    output(&dev, OP, a.shape(), |out| {
        Ok(launch::select(&dev, cond.cuda_f32(OP)?, a.cuda_f32(OP)?, b.cuda_f32(OP)?, out)?)
    })
}

/// The whole f32 device buffer behind a (possibly strided or broadcast) view.
fn buffer_of<'t>(t: &'t Tensor, op: &'static str) -> Result<&'t kernels::cuda::DeviceBuffer<f32>> {
    let storage = t.cuda_storage().ok_or(crate::Error::UnsupportedDevice { op, device: t.device })?;
    storage.f32_buffer(op)
}
