//! Concatenation along one axis (PyTorch `torch.cat`).

use crate::{Error, Result, Tensor};

impl Tensor {
    /// Joins `tensors` along `axis`; every other dimension must agree.
    pub fn cat(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::InvalidShape {
            op: "cat",
            shape: vec![],
            reason: "nothing to concatenate".into(),
        })?;
        first.dim("cat", axis)?;
        for t in tensors {
            first.same_device("cat", t)?;
            let same_rank = t.rank() == first.rank();
            if !same_rank || (0..t.rank()).any(|d| d != axis && t.shape[d] != first.shape[d]) {
                return Err(Error::ShapeMismatch { op: "cat", lhs: first.shape.clone(), rhs: t.shape.clone() });
            }
        }
        #[cfg(feature = "cuda")]
        if first.cuda_storage().is_some() {
            let mut shape = first.shape.clone();
            shape[axis] = tensors.iter().map(|t| t.shape[axis]).sum();
            return cuda::cat(tensors, axis, &shape);
        }
        let outer: usize = first.shape[..axis].iter().product();
        let inner: usize = first.shape[axis + 1..].iter().product();
        let parts: Vec<Vec<f32>> = tensors.iter().map(|t| t.to_vec()).collect();
        let total: usize = tensors.iter().map(|t| t.shape[axis]).sum();
        let mut out = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            for (t, part) in tensors.iter().zip(&parts) {
                let run = t.shape[axis] * inner;
                out.extend_from_slice(&part[o * run..(o + 1) * run]);
            }
        }
        let mut shape = first.shape.clone();
        shape[axis] = total;
        Tensor::from_vec(out, &shape)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/concat.rs`.
    //!
    //! Each part is moved to the front axis (`[len_t, rest...]`, a dense copy unless `axis` is
    //! already 0), the parts are copied one after another into one buffer (which is then the
    //! concatenation along axis 0), and that is permuted back: one device-to-device copy per
    //! part, plus two strided copies per part and one overall when `axis > 0`.

    use crate::cuda::{cuda_error, CudaStorage};
    use crate::{DType, Result, Tensor};

    /// `tensors` (shapes checked by the caller, all on one GPU) joined along `axis` into a
    /// tensor of `shape`.
    pub(crate) fn cat(tensors: &[&Tensor], axis: usize, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "cat";
        let dev = tensors[0].cuda_device(OP)?;
        let rank = shape.len();
        // Output dimension order with `axis` first, and its inverse.
        let front: Vec<usize> = std::iter::once(axis).chain((0..rank).filter(|&d| d != axis)).collect();
        let mut back = vec![0; rank];
        for (i, &d) in front.iter().enumerate() {
            back[d] = i;
        }
        let mut stacked = CudaStorage::alloc(&dev, shape.iter().product())?;
        let mut at = 0;
        for t in tensors {
            let t = if t.dtype() == DType::F32 { (*t).clone() } else { t.to_dtype(DType::F32)? };
            let part = t.permute(&front)?.dense()?;
            let src = part.cuda_f32(OP)?;
            dev.copy_within_device(src, 0, stacked.f32_buffer_mut(OP)?, at, src.len())
                .map_err(|e| cuda_error(OP, e))?;
            at += src.len();
        }
        let front_shape: Vec<usize> = front.iter().map(|&d| shape[d]).collect();
        Tensor::from_cuda(stacked, &front_shape)?.permute(&back)?.dense()
    }
}
