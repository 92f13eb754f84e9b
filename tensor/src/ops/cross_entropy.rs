//! Mean cross-entropy of logits against class ids (PyTorch `F.cross_entropy`, with an
//! ignore index), returning the per-row log-sum-exp its backward needs. On a GPU only this
//! op waits for the device (its kernel reports the counted rows). Kernels:
//! `kernels::cpu::cross_entropy` (`kernels::cuda::softmax` on the GPU).

use kernels::cpu::cross_entropy;

use crate::{Error, Result, Tensor};

/// Output of [`Tensor::cross_entropy`]: the mean loss over counted rows, with the per-row
/// log-sum-exp and the count saved for backward.
pub struct CrossEntropy {
    /// The mean loss, rank 0 on the logits' device (a GPU loss stays there until asked for;
    /// see [`CrossEntropy::loss_value`]).
    pub loss: Tensor,
    /// Log-sum-exp of every row's logits, `[N]` on the logits' device.
    pub lse: Tensor,
    /// Rows whose target is not the ignore index.
    pub count: usize,
}

impl CrossEntropy {
    /// The loss on the host (waits for the GPU when the logits are there).
    pub fn loss_value(&self) -> Result<f32> {
        self.loss.to_host()?.item()
    }
}

impl Tensor {
    /// Errors unless this is `[N, V]` logits for `targets[N]` with every target below `V`
    /// or equal to `ignore_index`; returns `V`.
    fn check_targets(&self, op: &'static str, targets: &[u32], ignore_index: Option<u32>) -> Result<usize> {
        let cols = self.last_dim(op)?;
        let rows = self.numel() / cols.max(1);
        if self.rank() != 2 || targets.len() != rows {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: vec![targets.len()] });
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= cols && Some(t) != ignore_index) {
            return Err(Error::IndexOutOfRange { op, index: bad as usize, size: cols });
        }
        Ok(cols)
    }

    /// Mean cross-entropy of logits `[N, V]` against class ids `targets[N]`; rows whose
    /// target equals `ignore_index` are skipped (PyTorch `F.cross_entropy`). On a GPU this
    /// waits for the logits (the kernel reports its row count) but leaves the loss there.
    pub fn cross_entropy(&self, targets: &[u32], ignore_index: Option<u32>) -> Result<CrossEntropy> {
        let cols = self.check_targets("cross_entropy", targets, ignore_index)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::softmax::cross_entropy(self, cols, targets, ignore_index);
        }
        let (_, x) = self.rows("cross_entropy")?;
        let rows = targets.len();
        let mut losses = vec![0.0; rows];
        let mut lse = vec![0.0; rows];
        let count =
            cross_entropy::cross_entropy_forward(x.as_slice()?, cols, targets, ignore_index, &mut losses, &mut lse);
        let total: f64 = losses.iter().map(|&l| l as f64).sum();
        let loss = if count == 0 { 0.0 } else { (total / count as f64) as f32 };
        Ok(CrossEntropy { loss: Tensor::scalar(loss), lse: Tensor::from_vec(lse, &[rows])?, count })
    }

    /// `scale · (softmax(logits) − onehot(target))` for every row not ignored (ignored rows
    /// get zeros): the backward of [`Tensor::cross_entropy`] from its saved `lse`, with
    /// `scale = d loss / count`.
    pub fn cross_entropy_backward(
        logits: &Tensor,
        targets: &[u32],
        ignore_index: Option<u32>,
        lse: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let cols = logits.check_targets(OP, targets, ignore_index)?;
        logits.check_row_stats(OP, lse, targets.len())?;
        #[cfg(feature = "cuda")]
        if logits.cuda_storage().is_some() {
            return crate::cuda::softmax::cross_entropy_backward(logits, cols, targets, ignore_index, lse, scale);
        }
        let (_, logits) = logits.rows(OP)?;
        let mut dlogits = crate::pool::zeros(logits.numel());
        let lse = lse.contiguous()?;
        cross_entropy::cross_entropy_backward(
            logits.as_slice()?,
            cols,
            targets,
            ignore_index,
            lse.as_slice()?,
            scale,
            &mut dlogits,
        );
        Tensor::from_vec(dlogits, &logits.shape)
    }
}
