//! Batched matrix multiply with broadcasting batch dimensions and free transposes.
//!
//! PyTorch equivalent: `torch.matmul` for operands of rank ≥ 2.

use kernels::cpu::matmul::{matmul, MatRef};

use crate::shape::broadcast_shapes;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// `self[..., m, k] · rhs[..., k, n]`; batch dimensions broadcast. Strided operands
    /// (e.g. `w.transpose(0, 1)`) are read in place, never copied (on a GPU, where cuBLAS
    /// can take the view). GPU products run in the precision set by
    /// `tensor::cuda::set_matmul_precision` (f32 unless bf16 mixed precision is on).
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.same_device("matmul", rhs)?;
        let mismatch = || Error::ShapeMismatch { op: "matmul", lhs: self.shape.clone(), rhs: rhs.shape.clone() };
        if self.rank() < 2 || rhs.rank() < 2 {
            return Err(mismatch());
        }
        let (m, k) = (self.shape[self.rank() - 2], self.shape[self.rank() - 1]);
        let (k2, n) = (rhs.shape[rhs.rank() - 2], rhs.shape[rhs.rank() - 1]);
        if k != k2 {
            return Err(mismatch());
        }
        let batch = broadcast_shapes("matmul", &self.shape[..self.rank() - 2], &rhs.shape[..rhs.rank() - 2])
            .map_err(|_| mismatch())?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return crate::cuda::matmul::matmul(self, rhs, &batch, (m, k, n));
        }
        let lhs = self.expand(&[batch.as_slice(), &[m, k]].concat())?;
        let rhs = rhs.expand(&[batch.as_slice(), &[k, n]].concat())?;
        let batches: usize = batch.iter().product();
        let mut out = crate::pool::buffer(batches * m * n);
        let (lhs_data, rhs_data) = (lhs.f32_storage("matmul")?, rhs.f32_storage("matmul")?);
        for b in 0..batches {
            let (l, r) = (operand(&lhs, lhs_data, b, &batch), operand(&rhs, rhs_data, b, &batch));
            matmul(&mut out, b * m * n, l, r, m, n, k, false);
        }
        Tensor::from_vec(out, &[batch.as_slice(), &[m, n]].concat())
    }
}

/// Matrix `b` of the batch of an expanded `[batch..., rows, cols]` view, as a gemm operand.
fn operand<'a>(t: &Tensor, data: &'a [f32], b: usize, batch: &[usize]) -> MatRef<'a> {
    let rank = t.rank();
    MatRef {
        data,
        offset: t.offset + batch_offset(b, batch, &t.strides[..rank - 2]),
        row_stride: t.strides[rank - 2] as isize,
        col_stride: t.strides[rank - 1] as isize,
    }
}

/// Storage offset of flat batch index `b` for a view with `strides` over `batch` dims.
fn batch_offset(mut b: usize, batch: &[usize], strides: &[usize]) -> usize {
    let mut offset = 0;
    for d in (0..batch.len()).rev() {
        offset += (b % batch[d]) * strides[d];
        b /= batch[d];
    }
    offset
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_broadcast_and_transposed() {
        let a = Tensor::from_vec((0..12).map(|i| i as f32).collect(), &[2, 2, 3]).unwrap();
        let w = Tensor::from_vec((0..6).map(|i| i as f32 * 0.5).collect(), &[2, 3]).unwrap();
        // a · wᵀ with w broadcast over the batch.
        let y = a.matmul(&w.transpose(0, 1).unwrap()).unwrap();
        assert_eq!(y.shape(), &[2, 2, 2]);
        let a0 = [0.0, 1.0, 2.0];
        let w1 = [1.5, 2.0, 2.5];
        let expected: f32 = a0.iter().zip(w1).map(|(x, y)| x * y).sum();
        assert_eq!(y.to_vec()[1], expected);
        assert!(a.matmul(&w).is_err());
    }
}
