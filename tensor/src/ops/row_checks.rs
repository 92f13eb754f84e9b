//! Operand checks shared by the row ops (softmax, cross-entropy, norms, rotary embedding,
//! embedding lookup, attention), each returning an error that names the op and the shapes.
//!
//! The row ops follow one convention: each forward returns what its backward needs (row
//! statistics, log-sum-exp) beside the output, as tensors on the input's device, so the
//! autograd crate saves exactly that and nothing more, and GPU results stay on the GPU.
//! Token ids and targets are host slices on every device (a CUDA op copies them over; they
//! are small).

use crate::{Error, Result, Tensor};

impl Tensor {
    /// Width of the last axis, or an error naming `op` for a rank-0 tensor.
    pub(crate) fn last_dim(&self, op: &'static str) -> Result<usize> {
        self.shape.last().copied().ok_or_else(|| Error::InvalidShape {
            op,
            shape: vec![],
            reason: "needs at least one dimension".into(),
        })
    }

    /// Width of the last axis and a contiguous copy (the layout CPU row kernels need).
    pub(crate) fn rows(&self, op: &'static str) -> Result<(usize, Tensor)> {
        self.require_cpu(op)?;
        let cols = self.last_dim(op)?;
        Ok((cols, self.contiguous()?))
    }

    /// Errors unless `other` has exactly this tensor's shape and device.
    pub(crate) fn check_like(&self, op: &'static str, other: &Tensor) -> Result<()> {
        self.same_device(op, other)?;
        if other.shape != self.shape {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: other.shape.clone() });
        }
        Ok(())
    }

    /// Errors unless `stats` holds one value per row of `rows` rows, on this tensor's device.
    pub(crate) fn check_row_stats(&self, op: &'static str, stats: &Tensor, rows: usize) -> Result<()> {
        self.same_device(op, stats)?;
        if stats.numel() != rows {
            return Err(Error::ShapeMismatch { op, lhs: self.shape.clone(), rhs: stats.shape.clone() });
        }
        Ok(())
    }

    /// `(B, T, H, D)` of a rank-4 tensor, or an error naming `op`.
    pub fn dims4(&self, op: &'static str) -> Result<[usize; 4]> {
        match self.shape.as_slice() {
            &[b, t, h, d] => Ok([b, t, h, d]),
            _ => Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "expected [B, T, H, D]".into() }),
        }
    }
}
