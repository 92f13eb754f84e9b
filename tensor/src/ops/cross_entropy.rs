//! Mean cross-entropy of logits against class ids (PyTorch `F.cross_entropy`, with an
//! ignore index), returning the per-row log-sum-exp and the targets its backward needs. On
//! a GPU neither direction waits for the device: the rows are counted on the host, the
//! targets are uploaded once (by the forward), and the backward reads the loss's gradient
//! on the device. Kernels: `kernels::cpu::cross_entropy` (`kernels::cuda::softmax` on the GPU).

use kernels::cpu::cross_entropy::{self, CrossEntropyDims};

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::cross_entropy`]: the mean loss over counted rows, with the per-row
/// log-sum-exp, the targets and the count saved for backward.
pub struct CrossEntropy {
    /// The mean loss, rank 0 on the logits' device (a GPU loss stays there until asked for;
    /// see [`CrossEntropy::loss_value`]).
    pub loss: Tensor,
    /// Log-sum-exp of every row's logits, `[N]` on the logits' device.
    pub lse: Tensor,
    /// Rows whose target is not the ignore index.
    pub count: usize,
    /// The targets, where the backward reads them.
    pub targets: SavedTargets,
}

/// The targets of a cross-entropy as its backward reads them: on the host, and for logits
/// on a GPU also on the device (uploaded once, by the forward).
pub struct SavedTargets {
    host: Vec<u32>,
    #[cfg(feature = "cuda")]
    device: Option<kernels::cuda::DeviceBuffer<u32>>,
}

impl SavedTargets {
    /// Host targets (for logits on the CPU).
    fn host(targets: &[u32]) -> SavedTargets {
        SavedTargets {
            host: targets.to_vec(),
            #[cfg(feature = "cuda")]
            device: None,
        }
    }
}

impl CrossEntropy {
    /// The loss on the host (waits for the GPU when the logits are there).
    pub fn loss_value(&self) -> Result<f32> {
        self.loss.to_host()?.item()
    }
}

impl Tensor {
    /// Errors unless this is `[N, V]` logits for `targets[N]` with every target below `V`
    /// or equal to `ignore_index`; returns the kernels' sizes.
    fn check_targets(&self, op: &'static str, targets: &[u32], ignore_index: Option<u32>) -> Result<CrossEntropyDims> {
        let cols = self.last_dim(op)?;
        let rows = self.numel() / cols.max(1);
        if self.rank() != 2 || targets.len() != rows {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: vec![targets.len()] });
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= cols && Some(t) != ignore_index) {
            return Err(Error::IndexOutOfRange { op, index: bad as usize, size: cols });
        }
        Ok(CrossEntropyDims { rows, cols, ignore_index })
    }

    /// Mean cross-entropy of logits `[N, V]` against class ids `targets[N]`; rows whose
    /// target equals `ignore_index` are skipped (PyTorch `F.cross_entropy`). On a GPU this
    /// waits for the logits (the kernel reports its row count) but leaves the loss there.
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<CrossEntropy> {
        let dims = self.check_targets("cross_entropy", targets, ignore_index)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::cross_entropy(self, targets, &dims);
        }
        let (_, x) = self.rows("cross_entropy")?;
        let rows = targets.len();
        let mut losses = vec![0.0; rows];
        let mut lse = vec![0.0; rows];
        let count = cross_entropy::cross_entropy_forward(x.as_slice()?, targets, &dims, &mut losses, &mut lse);
        let lse = Tensor::from_vec(lse, &[rows])?;
        Ok(CrossEntropy { loss: mean_loss(&losses, count), lse, count, targets: SavedTargets::host(targets) })
    }

    /// `(dy / count) · (softmax(logits) − onehot(target))` for every row not ignored (ignored
    /// rows get zeros): the backward of [`Tensor::cross_entropy`] from its saved `lse`,
    /// targets and count, for the rank-0 gradient `dy` of the mean loss (on a GPU read there:
    /// nothing waits).
    pub fn cross_entropy_backward(
        logits: &Tensor,
        targets: &SavedTargets,
        ignore_index: Option<u32>,
        lse: &Tensor,
        dy: &Tensor,
        count: usize,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let dims = logits.check_targets(OP, &targets.host, ignore_index)?;
        logits.check_row_stats(OP, lse, targets.host.len())?;
        logits.same_device(OP, dy)?;
        if dy.numel() != 1 {
            return Err(Error::ShapeMismatch { op: OP, lhs: vec![], rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if logits.cuda_storage().is_some() {
            return cuda::cross_entropy_backward(logits, targets, &dims, lse, dy, count);
        }
        let scale = if count > 0 { dy.item()? / count as f32 } else { 0.0 };
        let targets = &targets.host;
        let (_, logits) = logits.rows(OP)?;
        let mut dlogits = crate::pool::buffer(logits.numel());
        let lse = lse.contiguous()?;
        cross_entropy::cross_entropy_backward(logits.as_slice()?, targets, &dims, lse.as_slice()?, scale, &mut dlogits);
        Tensor::from_vec(dlogits, &logits.shape)
    }
}

/// The mean of per-row `losses` over the `count` rows not ignored (ignored rows hold 0),
/// summed in f64; 0 when every row is ignored. A rank-0 tensor.
pub(crate) fn mean_loss(losses: &[f32], count: usize) -> Tensor {
    let total: f64 = losses.iter().map(|&l| l as f64).sum();
    Tensor::scalar(if count == 0 { 0.0 } else { (total / count as f64) as f32 })
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA half of the fused cross-entropy: the loss and its backward over rows of logits.

    use std::sync::Arc;

    use kernels::cuda::elementwise::{scalar_forward, Binary};
    use kernels::cuda::reduce::sum_axis;
    use kernels::cuda::softmax::{self as launch, CrossEntropyDims};
    use kernels::cuda::{CudaDevice, DeviceBuffer};

    use super::{CrossEntropy, SavedTargets};
    use crate::cuda::{product_input_output, CudaStorage};
    use crate::{Result, Tensor};

    /// Mean cross-entropy of `[N, cols]` logits against host `targets` (already range-checked):
    /// the loss stays on the device as a rank-0 tensor, and nothing waits for the device (the
    /// kept rows are counted on the host). The targets are uploaded once, for both directions.
    pub(crate) fn cross_entropy(logits: &Tensor, targets: &[u32], dims: &CrossEntropyDims) -> Result<CrossEntropy> {
        const OP: &str = "cross_entropy";
        let dev = logits.cuda_device(OP)?;
        let logits = logits.dense()?;
        let rows = targets.len();
        let count = targets.iter().filter(|&&t| Some(t) != dims.ignore_index).count();
        let device_targets = dev.upload(targets)?;
        let mut losses = CudaStorage::alloc(&dev, rows)?;
        let mut lse = CudaStorage::alloc(&dev, rows)?;
        launch::cross_entropy_forward_queued(
            &dev,
            logits.cuda_f32(OP)?,
            &device_targets,
            dims,
            losses.f32_buffer_mut(OP)?,
            lse.f32_buffer_mut(OP)?,
        )?;
        let loss = mean_loss(&dev, losses.f32_buffer(OP)?, count)?;
        let targets = SavedTargets { host: targets.to_vec(), device: Some(device_targets) };
        Ok(CrossEntropy { loss, lse: Tensor::from_cuda(lse, &[rows])?, count, targets })
    }

    /// The mean of per-row `losses` on the device over the `count` rows not ignored (ignored
    /// rows hold 0): Σ losses / count, a rank-0 tensor that stays there (0 when every row is
    /// ignored). Two launches, no wait.
    pub(crate) fn mean_loss(dev: &Arc<CudaDevice>, losses: &DeviceBuffer<f32>, count: usize) -> Result<Tensor> {
        const OP: &str = "mean_loss";
        let loss = if count == 0 {
            CudaStorage::zeros(dev, 1)?
        } else {
            let mut total = dev.alloc::<f32>(1)?;
            sum_axis(dev, losses, 1, losses.len(), 1, &mut total)?;
            let mut mean = CudaStorage::alloc(dev, 1)?;
            scalar_forward(dev, Binary::Div, &total, count as f32, mean.f32_buffer_mut(OP)?)?;
            mean
        };
        Tensor::from_cuda(loss, &[])
    }

    /// `dlogits = (dy / count)·(softmax − onehot)` per row not ignored, from the saved `lse`
    /// and targets; `dy` is read on the device.
    pub(crate) fn cross_entropy_backward(
        logits: &Tensor,
        targets: &SavedTargets,
        dims: &CrossEntropyDims,
        lse: &Tensor,
        dy: &Tensor,
        count: usize,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let dev = logits.cuda_device(OP)?;
        let (logits, lse, dy) = (logits.dense()?, lse.dense()?, dy.to_dtype(crate::DType::F32)?.dense()?);
        let uploaded;
        let device_targets = match &targets.device {
            Some(buffer) => buffer,
            None => {
                uploaded = dev.upload(&targets.host)?;
                &uploaded
            }
        };
        // dlogits feeds the LM head's backward products: in bf16 too under bf16 products.
        product_input_output(&dev, OP, logits.shape(), |dlogits, dlogits_bf16| {
            let (logits, lse) = (logits.cuda_f32(OP)?, lse.cuda_f32(OP)?);
            let scale = launch::MeanLossGrad { upstream: dy.cuda_f32(OP)?, count };
            let dlogits = (dlogits, dlogits_bf16);
            Ok(launch::cross_entropy_backward(&dev, logits, device_targets, dims, lse, scale, dlogits)?)
        })
    }
}
