//! Pooling over the `H×W` planes of `[N, C, H, W]` tensors: max pooling (the ImageNet stem's
//! 3×3/2) and global average pooling (the ResNet head), forward and backward, on the CPU
//! (`kernels::cpu::pool`) or a GPU (`kernels::cuda::pool`). No autograd here.
//!
//! PyTorch equivalents: `F.max_pool2d(x, kernel, stride, padding)` (floor mode, padding
//! counts as −∞) and `F.adaptive_avg_pool2d(x, 1).flatten(1)`. Max pooling returns the
//! winners' indices beside its output, exactly what its backward reads.

use kernels::cpu::pool::{
    global_avg_pool_backward, global_avg_pool_forward, max_pool2d_backward, max_pool2d_forward, MaxPool2d,
};

use crate::{Device, Error, Result, Tensor};

/// The winners of a [`Tensor::max_pool2d`]: per output, the index of the winning input
/// within its `H·W` plane, kept on the device of the pooled tensor for the backward.
pub struct MaxPoolIndices(pub(crate) Indices);

/// Where the indices live.
pub(crate) enum Indices {
    Host(Vec<usize>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::DeviceIndices),
}

impl MaxPoolIndices {
    /// Number of outputs (`N·C·OH·OW`).
    pub fn len(&self) -> usize {
        match &self.0 {
            Indices::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Indices::Cuda(d) => d.len(),
        }
    }

    /// True when the pooling had no output.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device holding the indices (that of the pooled tensor).
    pub fn device(&self) -> Device {
        match &self.0 {
            Indices::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Indices::Cuda(d) => d.device(),
        }
    }

    /// The indices on the host (a download from a GPU).
    pub fn to_vec(&self) -> Result<Vec<usize>> {
        match &self.0 {
            Indices::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            Indices::Cuda(d) => d.to_vec(),
        }
    }
}

/// The kernels' geometry of a max pooling of `[N, C, H, W]` ([`MaxPool2d`], the same for
/// both devices), or an error when the window is invalid ([`MaxPool2d::check`]) or the
/// kernel is larger than the padded input (no output).
fn max_pool2d_geometry(
    op: &'static str,
    shape: &[usize],
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<MaxPool2d> {
    let &[n, c, height, width] = shape else {
        return Err(Error::InvalidShape { op, shape: shape.to_vec(), reason: "expected [N, C, H, W]".into() });
    };
    let g = MaxPool2d { planes: n * c, height, width, kernel, stride, padding };
    let invalid = |reason: String| Error::InvalidShape { op, shape: shape.to_vec(), reason };
    g.check().map_err(invalid)?;
    let (out_h, out_w) = g.output_size();
    if out_h == 0 || out_w == 0 {
        return Err(invalid(format!("a {kernel}×{kernel} window is larger than the padded {height}×{width} input")));
    }
    Ok(g)
}

impl Tensor {
    /// Max pooling with a square `kernel`, `stride` and −∞ `padding` (PyTorch
    /// `F.max_pool2d`, floor mode). Returns `y[N, C, OH, OW]` and, per output, the index of
    /// the winning input within its `H·W` plane (what backward scatters to).
    pub fn max_pool2d(&self, kernel: usize, stride: usize, padding: usize) -> Result<(Tensor, MaxPoolIndices)> {
        let op = "max_pool2d";
        // A 4-D shape: max_pool2d_geometry checks it.
        let g = max_pool2d_geometry(op, &self.shape, kernel, stride, padding)?;
        let ((out_h, out_w), (n, c)) = (g.output_size(), (self.shape[0], self.shape[1]));
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let (y, indices) = cuda::max_pool2d(self, &g)?;
            return Ok((y, MaxPoolIndices(Indices::Cuda(indices))));
        }
        let x = self.contiguous()?;
        let mut y = vec![0.0; g.output_len()];
        let mut argmax = vec![0; y.len()];
        max_pool2d_forward(&g, x.as_slice()?, &mut y, &mut argmax);
        Ok((Tensor::from_vec(y, &[n, c, out_h, out_w])?, MaxPoolIndices(Indices::Host(argmax))))
    }

    /// The backward of [`Tensor::max_pool2d`] of an input of `x_shape`, from its `indices`
    /// and the same window: `d/dx[n, c, argmax[n, c, o]] = dy[n, c, o]`, summed where
    /// windows share a winner.
    pub fn max_pool2d_backward(
        x_shape: &[usize],
        indices: &MaxPoolIndices,
        dy: &Tensor,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        let op = "max_pool2d_backward";
        // A 4-D shape: max_pool2d_geometry checks it.
        let g = max_pool2d_geometry(op, x_shape, kernel, stride, padding)?;
        let ((out_h, out_w), (n, c)) = (g.output_size(), (x_shape[0], x_shape[1]));
        if dy.shape != [n, c, out_h, out_w] || indices.len() != dy.numel() {
            return Err(Error::ShapeMismatch { op, lhs: vec![n, c, out_h, out_w], rhs: dy.shape.clone() });
        }
        if indices.device() != dy.device {
            return Err(Error::DeviceMismatch { op, lhs: indices.device(), rhs: dy.device });
        }
        match &indices.0 {
            Indices::Host(argmax) => {
                let mut dx = crate::pool::buffer(g.input_len());
                max_pool2d_backward(&g, argmax, dy.contiguous()?.as_slice()?, &mut dx);
                Tensor::from_vec(dx, x_shape)
            }
            #[cfg(feature = "cuda")]
            Indices::Cuda(argmax) => cuda::max_pool2d_backward(x_shape, &g, argmax, dy),
        }
    }

    /// `y[N, C] = mean over H·W of x[N, C, H, W]` (the ResNet head's pooling).
    pub fn global_avg_pool(&self) -> Result<Tensor> {
        let op = "global_avg_pool";
        let [n, c, h, w] = self.dims_nchw(op)?;
        if h * w == 0 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape.clone(),
                reason: "empty planes have no mean".into(),
            });
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::global_avg_pool(self, n * c, h * w);
        }
        let x = self.contiguous()?;
        let mut y = vec![0.0; n * c];
        global_avg_pool_forward(x.as_slice()?, n, c, h * w, &mut y);
        Tensor::from_vec(y, &[n, c])
    }

    /// The backward of [`Tensor::global_avg_pool`] of an input of `x_shape`:
    /// `d/dx[n, c, s] = dy[n, c] / (H·W)`.
    pub fn global_avg_pool_backward(x_shape: &[usize], dy: &Tensor) -> Result<Tensor> {
        let op = "global_avg_pool_backward";
        let &[n, c, h, w] = x_shape else {
            return Err(Error::InvalidShape { op, shape: x_shape.to_vec(), reason: "expected [N, C, H, W]".into() });
        };
        if dy.shape != [n, c] || h * w == 0 {
            return Err(Error::ShapeMismatch { op, lhs: x_shape.to_vec(), rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if dy.cuda_storage().is_some() {
            return cuda::global_avg_pool_backward(x_shape, dy);
        }
        let mut dx = crate::pool::buffer(n * c * h * w);
        global_avg_pool_backward(dy.contiguous()?.as_slice()?, n, c, h * w, &mut dx);
        Tensor::from_vec(dx, x_shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_pytorch_and_errors_name_the_op() {
        let (y, arg) = Tensor::ones(&[2, 8, 16, 16]).max_pool2d(3, 2, 1).unwrap();
        assert_eq!((y.shape(), arg.len()), (&[2, 8, 8, 8][..], 2 * 8 * 64));
        assert_eq!(Tensor::ones(&[2, 8, 4, 4]).global_avg_pool().unwrap().shape(), [2, 8]);
        assert!(Tensor::zeros(&[2, 3, 5, 5]).max_pool2d(3, 2, 2).is_err());
        assert!(Tensor::zeros(&[2, 3, 5]).global_avg_pool().is_err());
        let msg = Tensor::max_pool2d_backward(&[2, 8, 16, 16], &arg, &Tensor::zeros(&[2, 8, 8]), 3, 2, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(msg.contains("max_pool2d_backward") && msg.contains("[2, 8, 8]"), "{msg}");
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/pool.rs`: max pooling (winners kept as `u32` plane indices on the
    //! device) and global average pooling through `kernels::cuda::pool`.

    use std::sync::Arc;

    use kernels::cuda::pool::{self as launch, MaxPool2d};
    use kernels::cuda::{CudaDevice, DeviceBuffer};

    use crate::cuda::{cuda_error, output};
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

    /// `y[N, C, OH, OW]` and the winners' indices, for the geometry `g` (checked by the caller).
    pub(crate) fn max_pool2d(x: &Tensor, g: &MaxPool2d) -> Result<(Tensor, DeviceIndices)> {
        const OP: &str = "max_pool2d";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        let (out_h, out_w) = g.output_size();
        let mut argmax = dev.alloc::<u32>(g.output_len()).map_err(|e| cuda_error(OP, e))?;
        let y = output(&dev, OP, &[x.shape()[0], x.shape()[1], out_h, out_w], |y| {
            Ok(launch::max_pool2d_forward(&dev, g, x.cuda_f32(OP)?, y, &mut argmax)?)
        })?;
        Ok((y, DeviceIndices { buffer: argmax, device: dev }))
    }

    /// `d/dx` of a max pooling of an input of `x_shape`, from its winners (shapes checked by
    /// the caller).
    pub(crate) fn max_pool2d_backward(
        x_shape: &[usize],
        g: &MaxPool2d,
        indices: &DeviceIndices,
        dy: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "max_pool2d_backward";
        let dev = dy.cuda_device(OP)?;
        let dy = dy.dense()?;
        output(&dev, OP, x_shape, |dx| Ok(launch::max_pool2d_backward(&dev, g, &indices.buffer, dy.cuda_f32(OP)?, dx)?))
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
        output(&dev, OP, x_shape, |dx| {
            Ok(launch::global_avg_pool_backward(&dev, dy.cuda_f32(OP)?, planes, spatial, dx)?)
        })
    }
}
