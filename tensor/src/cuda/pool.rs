//! The CUDA branch of `ops/pool.rs`: max pooling (winners kept as `u32` plane indices on the
//! device) and global average pooling through `kernels::cuda::pool`.

use std::sync::Arc;

use kernels::cuda::pool::{self as launch, MaxPool2d};
use kernels::cuda::{CudaDevice, DeviceBuffer};

use super::{accumulated, cuda_error, output};
use crate::{Device, Result, Tensor};

/// The winners of a max pooling on a GPU, with the device that holds them.
pub(crate) struct DeviceIndices {
    buffer: DeviceBuffer<u32>,
    device: Arc<CudaDevice>,
}

impl DeviceIndices {
    /// Number of outputs.
    pub(crate) fn len(&self) -> usize {
        self.buffer.len()
    }

    /// The GPU holding them.
    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal())
    }

    /// A host copy (waits for the forward that writes them).
    pub(crate) fn to_vec(&self) -> Result<Vec<usize>> {
        let indices = self.device.download(&self.buffer).map_err(|e| cuda_error("max_pool2d indices", e))?;
        Ok(indices.into_iter().map(|i| i as usize).collect())
    }
}

/// The launchers' geometry of a max pooling of `x_shape = [N, C, H, W]` (checked by the caller).
fn geometry(x_shape: &[usize], kernel: usize, stride: usize, padding: usize) -> MaxPool2d {
    let planes = x_shape[..2].iter().product();
    MaxPool2d { planes, height: x_shape[2], width: x_shape[3], kernel, stride, padding }
}

/// `y[N, C, OH, OW]` and the winners' indices; `[OH, OW]` checked by the caller.
pub(crate) fn max_pool2d(
    x: &Tensor,
    kernel: usize,
    stride: usize,
    padding: usize,
    [out_h, out_w]: [usize; 2],
) -> Result<(Tensor, DeviceIndices)> {
    const OP: &str = "max_pool2d";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    let g = geometry(x.shape(), kernel, stride, padding);
    let mut argmax = dev.alloc::<u32>(g.planes * out_h * out_w).map_err(|e| cuda_error(OP, e))?;
    let y = output(&dev, OP, &[x.shape()[0], x.shape()[1], out_h, out_w], |y| {
        Ok(launch::max_pool2d_forward(&dev, &g, x.cuda_f32(OP)?, y, &mut argmax)?)
    })?;
    Ok((y, DeviceIndices { buffer: argmax, device: dev }))
}

/// `d/dx` of a max pooling of an input of `x_shape`, from its winners (shapes checked by
/// the caller).
pub(crate) fn max_pool2d_backward(
    x_shape: &[usize],
    indices: &DeviceIndices,
    dy: &Tensor,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d_backward";
    let dev = dy.cuda_device(OP)?;
    let dy = dy.dense()?;
    let g = geometry(x_shape, kernel, stride, padding);
    accumulated(&dev, OP, x_shape, |dx| {
        Ok(launch::max_pool2d_backward(&dev, &g, &indices.buffer, dy.cuda_f32(OP)?, dx)?)
    })
}

/// `y[N, C]`, the mean of each of the `planes` planes of `spatial` values.
pub(crate) fn global_avg_pool(x: &Tensor, planes: usize, spatial: usize) -> Result<Tensor> {
    const OP: &str = "global_avg_pool";
    let dev = x.cuda_device(OP)?;
    let x = x.dense()?;
    let shape = [x.shape()[0], x.shape()[1]];
    output(&dev, OP, &shape, |y| Ok(launch::global_avg_pool_forward(&dev, x.cuda_f32(OP)?, planes, spatial, y)?))
}

/// `d/dx[n, c, s] = dy[n, c] / (H·W)` for an input of `x_shape` (checked by the caller).
pub(crate) fn global_avg_pool_backward(x_shape: &[usize], dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "global_avg_pool_backward";
    let dev = dy.cuda_device(OP)?;
    let dy = dy.dense()?;
    let (planes, spatial) = (x_shape[0] * x_shape[1], x_shape[2] * x_shape[3]);
    accumulated(&dev, OP, x_shape, |dx| {
        Ok(launch::global_avg_pool_backward(&dev, dy.cuda_f32(OP)?, planes, spatial, dx)?)
    })
}
