//! The LM head and its cross-entropy as one op: the mean over counted rows of
//! `CE(h_r·Wᵀ, t_r)` for `h: [N, C]`, `W: [V, C]` (PyTorch `F.cross_entropy(h @ W.T, targets,
//! ignore_index=...)`), computed in chunks of rows so that no `[N, V]` buffer exists. At the
//! anchor setting (V = 32,000, N = 64 × 256 = 16,384) the logits alone are 2 GB of f32, and
//! the unfused backward adds their gradient (2 GB) and its bf16 copy (1 GB). Per chunk:
//!
//! ```text
//! logits    = h[chunk] · Wᵀ                       [rows, V], the chunk's one buffer
//! losses[chunk], logits ← (softmax − onehot) / count        one pass over the rows
//! dh[chunk] = dlogits · W                         [rows, C]
//! dW       += dlogitsᵀ · h[chunk]                 [V, C] (the first chunk writes it)
//! ```
//!
//! So the gradients of the mean loss are computed in the forward, as Liger-Kernel's fused
//! linear cross-entropy and llm.c do; the autograd op (`Var::linear_cross_entropy`) keeps
//! `dh` and `dW` and its backward multiplies them by the loss's upstream gradient
//! ([`Tensor::scaled_by_upstream`], read on the device). Without gradients (evaluation) only
//! the first two lines run. The products have the precision of every matmul: on a GPU under
//! bf16 products their operands are bf16 (`h`'s and `W`'s kept copies) and so is the chunk,
//! as autocast stores a product's output: the logits product rounds its f32 sums to bf16, the
//! pass reads their f32 values and writes the gradient over them rounded to bf16, which the
//! two gradient products read; f32 otherwise. Kernels: `kernels::cpu::cross_entropy::
//! cross_entropy_forward_backward` (`kernels::cuda::softmax` on the GPU) and the GEMMs.
//!
//! Chunk size: at most [`LOGITS_CHUNK_BYTES`] (256 MiB) of f32 logits, the rows split evenly
//! (V = 32,000: 8 chunks of 2,048 rows of 16,384; V = 256: up to 262,144 rows in one chunk),
//! the same rows under bf16 products. Each chunk's products are then still large (2,048 × 512
//! × 32,000 is 67 GFLOP), while the chunk (250 MiB there, 125 MiB in bf16) is small beside
//! the 5 GB it replaces. What the op adds is `dh` and `dW`, kept from the forward to the
//! backward, and their scaled copies (the backward may run twice, so it does not scale them
//! in place): at the anchor 32 + 62.5 MiB each.

use kernels::cpu::cross_entropy::{cross_entropy_forward_backward, CrossEntropyDims};
use kernels::cpu::matmul::{matmul, GemmDims, MatRef, Store};

use super::cross_entropy::mean_loss;
use crate::{Error, Result, Tensor, Tokens};

/// The most f32 logits one chunk of [`Tensor::linear_cross_entropy`] holds: 256 MiB.
pub const LOGITS_CHUNK_BYTES: usize = 256 << 20;

/// Output of [`Tensor::linear_cross_entropy`].
pub struct LinearCrossEntropy {
    /// The mean loss over counted rows, rank 0 on `h`'s device (a GPU loss stays there).
    pub loss: Tensor,
    /// Rows whose target is not the ignore index.
    pub count: usize,
    /// `d loss / d h`, `[N, C]`, when asked for.
    pub dh: Option<Tensor>,
    /// `d loss / d W`, `[V, C]`, when asked for.
    pub dweight: Option<Tensor>,
}

/// One call's sizes and choices, as both devices' chunk loops read them.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// `N`: rows of `h` and targets.
    rows: usize,
    /// `C`: the width of `h` and of `W`'s rows.
    width: usize,
    /// `V`: rows of `W`, logits per row.
    vocab: usize,
    /// Rows per chunk ([`chunk_rows`]).
    chunk: usize,
    /// The target that marks a row to skip.
    ignore_index: Option<u32>,
    /// Rows not ignored: the mean's denominator.
    count: usize,
    /// Which of `[dh, dW]` to compute.
    needs: [bool; 2],
}

impl Plan {
    /// Every chunk as `(first row, rows)`, in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.chunk).map(|first| (first, self.chunk.min(self.rows - first)))
    }

    /// The kernels' sizes for a chunk of `rows` rows.
    fn chunk_dims(&self, rows: usize) -> CrossEntropyDims {
        CrossEntropyDims { rows, cols: self.vocab, ignore_index: self.ignore_index }
    }

    /// The factor of the gradient written over the logits, `1 / count` (the mean's; 0 when
    /// every row is ignored), or `None` when no gradient is asked for.
    fn grad_scale(&self) -> Option<f32> {
        let scale = if self.count > 0 { 1.0 / self.count as f32 } else { 0.0 };
        self.needs.contains(&true).then_some(scale)
    }

    /// How the product of the chunk starting at `first` stores into `dW`: the first chunk
    /// writes it, the others add onto it (GEMM β = 1).
    fn dweight_store(first: usize) -> Store {
        if first == 0 {
            Store::Overwrite
        } else {
            Store::Accumulate
        }
    }
}

/// Rows per chunk for `rows` rows of `vocab` logits: at most `max_rows` (by default as many
/// as fit [`LOGITS_CHUNK_BYTES`], at least one), the rows split evenly over the chunks so that
/// they all have one shape (the last may be a few rows shorter).
fn chunk_rows(rows: usize, vocab: usize, max_rows: Option<usize>) -> usize {
    let bound = max_rows.unwrap_or(LOGITS_CHUNK_BYTES / (4 * vocab.max(1))).max(1);
    rows.div_ceil(rows.div_ceil(bound).max(1)).max(1)
}

impl Tensor {
    /// Mean cross-entropy of the logits `self·weightᵀ` (`self: [N, C]`, `weight: [V, C]`, a
    /// linear layer's `[out, in]` weight) against `targets[N]` (on `self`'s device: a GPU
    /// reads them from their device buffer), rows whose target is `ignore_index` skipped:
    /// what `self.matmul(&weight.transpose(0, 1)?)?.cross_entropy(..)` computes, without its
    /// `[N, V]` buffers (see the module doc). `needs` says which of
    /// `[d loss/d self, d loss/d weight]` to compute (for an upstream gradient of 1: see
    /// [`Tensor::scaled_by_upstream`]); neither is evaluation. `max_chunk_rows` caps the rows
    /// per chunk below the default of [`LOGITS_CHUNK_BYTES`] of logits (tests use it to cross
    /// chunk boundaries on small inputs). On a GPU nothing waits for the device.
    pub fn linear_cross_entropy(
        &self,
        weight: &Tensor,
        targets: &Tokens,
        ignore_index: Option<u32>,
        needs: [bool; 2],
        max_chunk_rows: Option<usize>,
    ) -> Result<LinearCrossEntropy> {
        const OP: &str = "linear_cross_entropy";
        self.same_device(OP, weight)?;
        let mismatch = || Error::ShapeMismatch { op: OP, lhs: self.shape.clone(), rhs: weight.shape.clone() };
        let (&[rows, width], &[vocab, weight_width]) = (self.shape.as_slice(), weight.shape.as_slice()) else {
            return Err(mismatch());
        };
        if width != weight_width {
            return Err(mismatch());
        }
        if targets.len() != rows {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape.clone(), rhs: vec![targets.len()] });
        }
        targets.check_device(OP, self.device)?;
        let host = targets.host();
        // The scan only when some target is ≥ V (the ignore index may be).
        if targets.max_id().is_some_and(|max| max as usize >= vocab) {
            if let Some(&bad) = host.iter().find(|&&t| t as usize >= vocab && Some(t) != ignore_index) {
                return Err(Error::IndexOutOfRange { op: OP, index: bad as usize, size: vocab });
            }
        }
        let count = match ignore_index {
            Some(ignore) => host.iter().filter(|&&t| t != ignore).count(),
            None => rows,
        };
        if rows == 0 {
            let loss = Tensor::zeros_on(&[], self.device)?;
            let dh = needs[0].then(|| Tensor::zeros_on(&[0, width], self.device)).transpose()?;
            let dweight = needs[1].then(|| Tensor::zeros_on(&[vocab, width], self.device)).transpose()?;
            return Ok(LinearCrossEntropy { loss, count, dh, dweight });
        }
        let chunk = chunk_rows(rows, vocab, max_chunk_rows);
        let plan = Plan { rows, width, vocab, chunk, ignore_index, count, needs };
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::linear_cross_entropy(self, weight, targets, &plan);
        }
        linear_cross_entropy_cpu(self, weight, host, &plan)
    }

    /// `upstream · g` for each saved gradient `g` of [`Tensor::linear_cross_entropy`]: the
    /// backward of the mean loss for its gradient `upstream` (one element, on the gradients'
    /// device; usually 1, less under gradient accumulation). On a GPU `upstream` is read there
    /// and every gradient is scaled in one launch: nothing waits.
    pub fn scaled_by_upstream(grads: &[&Tensor], upstream: &Tensor) -> Result<Vec<Tensor>> {
        const OP: &str = "scaled_by_upstream";
        if upstream.numel() != 1 {
            return Err(Error::ShapeMismatch { op: OP, lhs: vec![], rhs: upstream.shape.clone() });
        }
        for g in grads {
            g.same_device(OP, upstream)?;
        }
        #[cfg(feature = "cuda")]
        if upstream.cuda_storage().is_some() {
            return cuda::scaled_by_upstream(grads, upstream);
        }
        let s = upstream.item()?;
        grads.iter().map(|g| g.scalar_op(crate::ops::Binary::Mul, s)).collect()
    }
}

/// The chunk loop of [`Tensor::linear_cross_entropy`] on the CPU (inputs checked).
fn linear_cross_entropy_cpu(h: &Tensor, weight: &Tensor, targets: &[u32], plan: &Plan) -> Result<LinearCrossEntropy> {
    let Plan { rows: n, width: c, vocab: v, chunk, count, needs, .. } = *plan;
    let (h, weight) = (h.contiguous()?, weight.contiguous()?);
    let (h, w) = (h.as_slice()?, weight.as_slice()?);
    // Row-major views: h[first..] is [rows, C], W is [V, C] and Wᵀ the same storage read by columns.
    let h_rows = |first: usize| MatRef { data: h, offset: first * c, row_stride: c as isize, col_stride: 1 };
    let w_rows = MatRef { data: w, offset: 0, row_stride: c as isize, col_stride: 1 };
    let w_transposed = MatRef { row_stride: 1, col_stride: c as isize, ..w_rows };
    let mut losses = vec![0.0; n];
    let mut logits = crate::pool::buffer(chunk * v);
    let mut dh = needs[0].then(|| crate::pool::buffer(n * c));
    let mut dw = needs[1].then(|| crate::pool::buffer(v * c));
    for (first, rows) in plan.chunks() {
        let logits = &mut logits[..rows * v];
        matmul(logits, 0, h_rows(first), w_transposed, GemmDims { m: rows, n: v, k: c }, Store::Overwrite);
        let (chunk_targets, chunk_losses) = (&targets[first..][..rows], &mut losses[first..][..rows]);
        cross_entropy_forward_backward(logits, chunk_targets, &plan.chunk_dims(rows), plan.grad_scale(), chunk_losses);
        // The logits now hold dlogits = (softmax − onehot) / count (when a gradient is asked for).
        let dlogits = MatRef { data: logits, offset: 0, row_stride: v as isize, col_stride: 1 };
        if let Some(dh) = &mut dh {
            // d/dh = dlogits · W
            matmul(dh, first * c, dlogits, w_rows, GemmDims { m: rows, n: c, k: v }, Store::Overwrite);
        }
        if let Some(dw) = &mut dw {
            // d/dW = dlogitsᵀ · h, summed over the chunks
            let dlogits_t = MatRef { row_stride: 1, col_stride: v as isize, ..dlogits };
            matmul(dw, 0, dlogits_t, h_rows(first), GemmDims { m: v, n: c, k: rows }, Plan::dweight_store(first));
        }
    }
    crate::pool::recycle(logits);
    Ok(LinearCrossEntropy {
        loss: mean_loss(&losses, count),
        count,
        dh: dh.map(|dh| Tensor::from_vec(dh, &[n, c])).transpose()?,
        dweight: dw.map(|dw| Tensor::from_vec(dw, &[v, c])).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_at_most_256_mib_of_logits_split_evenly() {
        // The anchor: 16,384 rows of vocab 32,000 in 8 chunks of 2,048 (250 MiB each).
        assert_eq!(chunk_rows(16_384, 32_000, None), 2_048);
        // Vocab 256: a whole batch in one chunk.
        assert_eq!(chunk_rows(16, 256, None), 16);
        // A cap: 8 rows by at most 3 go in chunks of 3, 3 and 2; 7 by at most 4 in 4 and 3.
        assert_eq!(chunk_rows(8, 5, Some(3)), 3);
        assert_eq!(chunk_rows(7, 5, Some(4)), 4);
        // A vocabulary wider than the bound still gets a row at a time.
        assert_eq!(chunk_rows(3, LOGITS_CHUNK_BYTES, None), 1);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA half: the same chunk loop with cuBLAS products (bf16 operands under bf16
    //! products) and the fused cross-entropy kernel, which reads the targets in place from
    //! their Tokens' device buffer; the loss and the gradients stay on the device, and nothing
    //! waits for it.

    use half::bf16;
    use kernels::cpu::matmul::{GemmDims, Store};
    use kernels::cuda::blas::{matmul, matmul_bf16, matmul_bf16_out, DeviceMat};
    use kernels::cuda::elementwise::scaled_copies;
    use kernels::cuda::softmax::cross_entropy_forward_backward;
    use kernels::cuda::{CudaDevice, DeviceBuffer, DeviceValues, Values, ValuesMut};

    use super::{LinearCrossEntropy, Plan};
    use crate::cuda::{matmul_precision, CudaStorage, MatmulPrecision};
    use crate::ops::cross_entropy::cuda::mean_loss;
    use crate::{DType, Error, Result, Tensor, Tokens};

    const OP: &str = "linear_cross_entropy";

    /// One operand of a chunk's products: a row-major matrix view over f32 values or, under
    /// bf16 products, over their bf16 copy (the tensor-core product reads only that).
    #[derive(Clone, Copy)]
    struct Operand<'a> {
        values: Values<'a>,
        offset: usize,
        row_stride: usize,
        col_stride: usize,
    }

    impl<'a> Operand<'a> {
        /// The row-major `[.., cols]` matrix from row `first`.
        fn rows(values: Values<'a>, first: usize, cols: usize) -> Self {
            Operand { values, offset: first * cols, row_stride: cols, col_stride: 1 }
        }

        /// Its transpose (the same storage read by columns).
        fn transposed(self) -> Self {
            Operand { row_stride: self.col_stride, col_stride: self.row_stride, ..self }
        }

        /// The view over `buffer`: the operand's f32 values or bf16 copy.
        fn view<T: kernels::cuda::DeviceScalar>(&self, buffer: &'a DeviceBuffer<T>) -> DeviceMat<'a, T> {
            DeviceMat { buffer, offset: self.offset, row_stride: self.row_stride, col_stride: self.col_stride }
        }
    }

    /// `dst[at..] = lhs·rhs` (`+=` with [`Store::Accumulate`]): two bf16 operands on the
    /// tensor cores, or two f32 ones; into a bf16 `dst` (from element 0, overwritten) the
    /// bf16 product's f32 sums rounded to nearest even.
    fn product(
        dev: &CudaDevice,
        (dst, at): (ValuesMut, usize),
        lhs: Operand,
        rhs: Operand,
        dims: GemmDims,
        store: Store,
    ) -> Result<()> {
        match (lhs.values, rhs.values, dst) {
            (Values::Bf16(l), Values::Bf16(r), ValuesMut::F32(dst)) => {
                matmul_bf16(dev, dst, at, lhs.view(l), rhs.view(r), dims, store)?
            }
            (Values::Bf16(l), Values::Bf16(r), ValuesMut::Bf16(dst)) if at == 0 && store == Store::Overwrite => {
                matmul_bf16_out(dev, dst, lhs.view(l), rhs.view(r), dims)?
            }
            (Values::F32(l), Values::F32(r), ValuesMut::F32(dst)) => {
                matmul(dev, dst, at, lhs.view(l), rhs.view(r), dims, store)?
            }
            (l, r, dst) => {
                // One precision choice makes both operands and the logits (a bf16 output is
                // one whole product): anything else is a bug, reported as such.
                let dtype = |values: Values| if values.is_bf16() { DType::BF16 } else { DType::F32 };
                let got = if l.is_bf16() == r.is_bf16() { dst.as_values() } else { r };
                return Err(Error::DTypeMismatch { op: OP, expected: dtype(l), got: dtype(got) });
            }
        }
        Ok(())
    }

    /// The bf16 copy an f32 device tensor keeps (made here if it has none; shared after).
    fn bf16_copy(t: &Tensor) -> Result<Tensor> {
        t.to_dtype(DType::BF16)?.dense()
    }

    /// The device buffer of a bf16 tensor made by [`bf16_copy`].
    fn bf16_buffer(t: &Tensor) -> Result<&DeviceBuffer<bf16>> {
        t.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: t.device })?.bf16_buffer(OP)
    }

    /// The chunk loop of [`Tensor::linear_cross_entropy`] on the GPU (inputs checked).
    pub(super) fn linear_cross_entropy(
        h: &Tensor,
        weight: &Tensor,
        targets: &Tokens,
        plan: &Plan,
    ) -> Result<LinearCrossEntropy> {
        let Plan { rows: n, width: c, vocab: v, chunk, count, needs, .. } = *plan;
        let dev = h.cuda_device(OP)?;
        let (h, weight) = (h.to_dtype(DType::F32)?.dense()?, weight.to_dtype(DType::F32)?.dense()?);
        let grad_scale = plan.grad_scale();
        let bf16 = matmul_precision() == MatmulPrecision::Bf16;
        let copies = if bf16 { Some((bf16_copy(&h)?, bf16_copy(&weight)?)) } else { None };
        // Under bf16 products only the copies are read (h may be held in bf16 alone: a norm's output).
        let (h_values, w_values) = match &copies {
            Some((h16, w16)) => (Values::Bf16(bf16_buffer(h16)?), Values::Bf16(bf16_buffer(w16)?)),
            None => (Values::F32(h.cuda_f32(OP)?), Values::F32(weight.cuda_f32(OP)?)),
        };
        let w_rows = Operand::rows(w_values, 0, c);

        let targets = targets.device_ids(OP)?;
        let mut losses = dev.alloc::<f32>(n)?;
        // The chunk's logits, overwritten by their gradient: under bf16 products in bf16, as
        // autocast stores a product (the cross-entropy reads their f32 values, and the two
        // gradient products read the gradient in bf16), else f32.
        let mut logits = DeviceValues::alloc(&dev, chunk * v, bf16)?;
        let mut dh = if needs[0] { Some(CudaStorage::alloc(&dev, n * c)?) } else { None };
        let mut dw = if needs[1] { Some(CudaStorage::alloc(&dev, v * c)?) } else { None };
        for (first, rows) in plan.chunks() {
            let h_rows = Operand::rows(h_values, first, c);
            let dims = GemmDims { m: rows, n: v, k: c };
            product(&dev, (logits.values_mut(), 0), h_rows, w_rows.transposed(), dims, Store::Overwrite)?;
            let chunk_dims = plan.chunk_dims(rows);
            cross_entropy_forward_backward(
                &dev,
                logits.values_mut(),
                targets,
                first,
                &chunk_dims,
                grad_scale,
                &mut losses,
            )?;
            // The logits now hold dlogits = (softmax − onehot) / count (when a gradient is asked for).
            let dlogits = Operand::rows(logits.values(), 0, v);
            if let Some(dh) = &mut dh {
                // d/dh = dlogits · W
                let dst = (ValuesMut::F32(dh.f32_buffer_mut(OP)?), first * c);
                product(&dev, dst, dlogits, w_rows, GemmDims { m: rows, n: c, k: v }, Store::Overwrite)?;
            }
            if let Some(dw) = &mut dw {
                // d/dW = dlogitsᵀ · h, summed over the chunks
                let (dst, dims) = ((ValuesMut::F32(dw.f32_buffer_mut(OP)?), 0), GemmDims { m: v, n: c, k: rows });
                product(&dev, dst, dlogits.transposed(), h_rows, dims, Plan::dweight_store(first))?;
            }
        }
        Ok(LinearCrossEntropy {
            loss: mean_loss(&dev, &losses, count)?,
            count,
            dh: dh.map(|dh| Tensor::from_cuda(dh, &[n, c])).transpose()?,
            dweight: dw.map(|dw| Tensor::from_cuda(dw, &[v, c])).transpose()?,
        })
    }

    /// `upstream · g` for each of `grads` in one launch, `upstream` read on the device.
    pub(super) fn scaled_by_upstream(grads: &[&Tensor], upstream: &Tensor) -> Result<Vec<Tensor>> {
        const OP: &str = "scaled_by_upstream";
        let dev = upstream.cuda_device(OP)?;
        let upstream = upstream.to_dtype(DType::F32)?.dense()?;
        let grads = grads.iter().map(|g| g.to_dtype(DType::F32)?.dense()).collect::<Result<Vec<_>>>()?;
        let mut out = grads.iter().map(|g| CudaStorage::alloc(&dev, g.numel())).collect::<Result<Vec<_>>>()?;
        let mut parts = grads
            .iter()
            .zip(&mut out)
            .map(|(g, o)| Ok((g.cuda_f32(OP)?, o.f32_buffer_mut(OP)?)))
            .collect::<Result<Vec<_>>>()?;
        scaled_copies(&dev, upstream.cuda_f32(OP)?, &mut parts)?;
        grads.iter().zip(out).map(|(g, o)| Tensor::from_cuda(o, g.shape())).collect()
    }
}
