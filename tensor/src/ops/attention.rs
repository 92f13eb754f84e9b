//! Causal scaled-dot-product attention of `[B, T, H, D]` operands, returning the
//! per-query log-sum-exp its backward needs (no T×T mask is built; the backward recomputes
//! the probabilities tile by tile). Kernels: `kernels::cpu::attention`
//! (`kernels::cuda::attention` on the GPU).

use kernels::cpu::attention::{self, AttentionDims};

use crate::{Error, Result, Tensor};

/// `[B, H, Tq]`: the shape of the saved log-sum-exp.
fn lse_shape(dims: &AttentionDims) -> [usize; 3] {
    [dims.batch, dims.heads, dims.q_seq]
}

impl Tensor {
    /// Checks causal-attention operands (`q: [B, Tq, H, D]`, `k, v: [B, Tk, H, D]`,
    /// `0 < D`, `Tq ≤ Tk`, one device) once, for either device's kernels; returns their sizes.
    fn attention_dims(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<AttentionDims> {
        let [b, tq, h, d] = q.dims4(op)?;
        let [kb, tk, kh, kd] = k.dims4(op)?;
        if [kb, kh, kd] != [b, h, d] || v.shape != k.shape || tq > tk {
            return Err(Error::ShapeMismatch { op, lhs: q.shape.clone(), rhs: k.shape.clone() });
        }
        if d == 0 {
            return Err(Error::InvalidShape { op, shape: q.shape.clone(), reason: "zero head dim".into() });
        }
        q.same_device(op, k)?;
        q.same_device(op, v)?;
        Ok(AttentionDims { batch: b, q_seq: tq, kv_seq: tk, heads: h, head_dim: d, scale })
    }

    /// [`Tensor::attention_dims`] of a backward's operands, and its forward's `out` (shaped like
    /// `q`) and `lse` (a value per query) and the output gradient `dout` (shaped like `q`).
    fn attention_backward_dims(
        op: &'static str,
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
    ) -> Result<AttentionDims> {
        let dims = Tensor::attention_dims(op, q, k, v, scale)?;
        q.check_like(op, out)?;
        q.check_like(op, dout)?;
        q.check_row_stats(op, lse, dims.lse_len())?;
        Ok(dims)
    }

    /// Causal scaled-dot-product attention of `q: [B, Tq, H, D]` over `k, v: [B, Tk, H, D]`
    /// (Tq ≤ Tk; the queries are the last Tq positions). Returns the output `[B, Tq, H, D]`
    /// and the per-query log-sum-exp `[B, H, Tq]` (on the inputs' device) for backward. No
    /// T×T mask is built.
    pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Tensor)> {
        let dims = Tensor::attention_dims("causal_attention", q, k, v, scale)?;
        #[cfg(feature = "cuda")]
        if q.cuda_storage().is_some() {
            return cuda::causal_attention(q, k, v, &dims);
        }
        q.require_cpu("causal_attention")?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let mut out = crate::pool::buffer(q.numel());
        let mut lse = vec![0.0; dims.lse_len()];
        attention::causal_attention_forward(q.as_slice()?, k.as_slice()?, v.as_slice()?, &dims, &mut out, &mut lse);
        Ok((Tensor::from_vec(out, &q.shape)?, Tensor::from_vec(lse, &lse_shape(&dims))?))
    }

    /// `(dq, dk, dv)` of [`Tensor::causal_attention`] from its inputs, output `out`, saved
    /// `lse` and the output gradient `dout`. The probabilities are recomputed tile by tile:
    /// `dq = dS·k·scale`, `dk = dSᵀ·q·scale`, `dv = Pᵀ·dout`, `dS = P ⊙ (dP − rowsum(dout⊙out))`.
    pub fn causal_attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "causal_attention_backward";
        let dims = Tensor::attention_backward_dims(OP, [q, k, v], out, lse, dout, scale)?;
        #[cfg(feature = "cuda")]
        if q.cuda_storage().is_some() {
            return cuda::causal_attention_backward(q, k, v, out, lse, dout, &dims);
        }
        q.require_cpu(OP)?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let (out, lse, dout) = (out.contiguous()?, lse.contiguous()?, dout.contiguous()?);
        let (mut dq, mut dk, mut dv) =
            (crate::pool::buffer(q.numel()), crate::pool::buffer(k.numel()), crate::pool::buffer(v.numel()));
        attention::causal_attention_backward(
            q.as_slice()?,
            k.as_slice()?,
            v.as_slice()?,
            out.as_slice()?,
            lse.as_slice()?,
            dout.as_slice()?,
            &dims,
            &mut dq,
            &mut dk,
            &mut dv,
        );
        Ok((Tensor::from_vec(dq, &q.shape)?, Tensor::from_vec(dk, &k.shape)?, Tensor::from_vec(dv, &v.shape)?))
    }

    /// The gradient `[B, T, 3·H·D]` of the packed QKV product whose [`Tensor::rope_qkv`] gave
    /// `q`, `k` and `v`, from attention over them ([`Tensor::causal_attention`]'s `out` and
    /// `lse`) and its output gradient `dout`: [`Tensor::rope_qkv_backward`] of
    /// [`Tensor::causal_attention_backward`]'s gradients. On a GPU's tensor cores the attention
    /// kernels write it themselves, rotating dq and dk back as they store them (two launches,
    /// no dense gradients in between, each value rounded once); elsewhere the two ops run in turn.
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_attention_backward_packed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
        theta: f32,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if q.cuda_storage().is_some() {
            let dims =
                Tensor::attention_backward_dims("rotary_attention_backward_packed", [q, k, v], out, lse, dout, scale)?;
            if let Some(dqkv) = cuda::rotary_attention_backward_packed(q, k, v, out, lse, dout, &dims, theta)? {
                return Ok(dqkv);
            }
        }
        let (dq, dk, dv) = Tensor::causal_attention_backward(q, k, v, out, lse, dout, scale)?;
        Tensor::rope_qkv_backward(&dq, &dk, &dv, theta)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of causal attention in `ops/attention.rs`: the flash-style forward (output and
    //! per-query log-sum-exp, both left on the device) and its backward. Head dims above
    //! `kernels::cuda::attention::MAX_HEAD_DIM` are refused with an error. Under bf16
    //! products ([`crate::cuda::MatmulPrecision::Bf16`]) attention's own products run in
    //! bf16 on the tensor cores too, as PyTorch's SDPA does under autocast, where the
    //! kernels take the head dimension; otherwise, and in f32, on the CUDA cores. From bf16
    //! q, k and v (RoPE's output under bf16 products) the output is stored in bf16 alone, as
    //! FlashAttention-2 stores it: the output projection reads it so, and the backward's δ
    //! reads it so.

    use std::sync::Arc;

    use kernels::cpu::attention::AttentionDims;
    use kernels::cuda::attention::{self as launch, AttentionPrecision};
    use kernels::cuda::{CudaDevice, Values, ValuesMut};

    use crate::cuda::MatmulPrecision;
    use crate::cuda::{
        matmul_precision, product_input_buffers, product_input_output, product_only_output, product_only_storage,
        CudaStorage,
    };
    use crate::{Result, Tensor};

    /// The precision of attention's products for `dims` under the process's matmul precision.
    /// The forward and its backward ask in the same step, so they agree.
    fn precision(dims: &AttentionDims) -> AttentionPrecision {
        if matmul_precision() == MatmulPrecision::Bf16 && launch::tensor_cores_fit(dims.head_dim) {
            AttentionPrecision::Bf16
        } else {
            AttentionPrecision::F32
        }
    }

    /// Whether attention over heads of `head_dim` reads q, k and v in bf16 (its tensor-core
    /// kernels under bf16 products), so that whoever writes them (RoPE) writes bf16 only.
    pub(crate) fn reads_bf16_inputs(head_dim: usize) -> bool {
        matmul_precision() == MatmulPrecision::Bf16 && launch::tensor_cores_fit(head_dim)
    }

    /// q, k and v as the kernels read them: as they are held (bf16, RoPE's output under bf16
    /// products) when the tensor-core kernels run, else f32 (widened if need be).
    fn inputs<'a>(qkv: [&'a Tensor; 3], precision: AttentionPrecision, op: &'static str) -> Result<[Values<'a>; 3]> {
        let value = |t: &'a Tensor| match precision {
            AttentionPrecision::Bf16 => t.cuda_values(op),
            AttentionPrecision::F32 => Ok(Values::F32(t.cuda_f32(op)?)),
        };
        Ok([value(qkv[0])?, value(qkv[1])?, value(qkv[2])?])
    }

    /// `(out [B, Tq, H, D], lse [B, H, Tq])` of causal attention.
    pub(crate) fn causal_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        dims: &AttentionDims,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "causal_attention";
        let dev = q.cuda_device(OP)?;
        let (q, k, v) = (q.dense()?, k.dense()?, v.dense()?);
        let mut lse = CudaStorage::alloc(&dev, dims.lse_len())?;
        let precision = precision(dims);
        let qkv = inputs([&q, &k, &v], precision, OP)?;
        let out = if qkv[0].is_bf16() {
            let mut out = CudaStorage::alloc_values(&dev, q.numel(), true)?;
            let values = out.values_mut(OP)?;
            launch::causal_attention_forward(&dev, qkv, dims, precision, (values, None), lse.f32_buffer_mut(OP)?)?;
            Tensor::from_cuda(out, q.shape())?
        } else {
            // The output feeds the output projection: in bf16 too under bf16 products.
            product_input_output(&dev, OP, q.shape(), |out, out_bf16| {
                let out = (ValuesMut::F32(out), out_bf16);
                Ok(launch::causal_attention_forward(&dev, qkv, dims, precision, out, lse.f32_buffer_mut(OP)?)?)
            })?
        };
        Ok((out, Tensor::from_cuda(lse, &super::lse_shape(dims))?))
    }

    /// `(dq, dk, dv)` of causal attention from the saved output and `lse`.
    pub(crate) fn causal_attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        dims: &AttentionDims,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "causal_attention_backward";
        let dev = q.cuda_device(OP)?;
        let (q, k, v) = (q.dense()?, k.dense()?, v.dense()?);
        let (out, lse, dout) = (out.dense()?, lse.dense()?, dout.dense()?);
        let precision = precision(dims);
        let qkv = inputs([&q, &k, &v], precision, OP)?;
        // As the forward stored it: bf16 from bf16 q, k and v; dout as held beside them (bf16
        // alone from the output projection's backward under bf16 products).
        let (out, lse) = (out.cuda_values(OP)?, lse.cuda_f32(OP)?);
        let dout = if qkv[0].is_bf16() { dout.cuda_values(OP)? } else { Values::F32(dout.cuda_f32(OP)?) };
        let (dq, dk, dv) = if precision == AttentionPrecision::Bf16 {
            // Read by RoPE's backward and the projections' products alone: bf16 alone, as
            // FlashAttention-2's backward writes them under autocast.
            let alloc = |len| product_only_storage(&dev, len);
            let (mut dq, mut dk, mut dv) = (alloc(q.numel())?, alloc(k.numel())?, alloc(v.numel())?);
            let grads = (dq.values_mut(OP)?, dk.values_mut(OP)?, (dv.values_mut(OP)?, None));
            launch::causal_attention_backward(&dev, qkv, out, lse, dout, dims, precision, grads.0, grads.1, grads.2)?;
            (dq, dk, dv)
        } else {
            let alloc = |len| CudaStorage::alloc(&dev, len);
            let (mut dq, mut dk, mut dv) = (alloc(q.numel())?, alloc(k.numel())?, alloc(v.numel())?);
            let (dq_buffer, dk_buffer) =
                (ValuesMut::F32(dq.f32_buffer_mut(OP)?), ValuesMut::F32(dk.f32_buffer_mut(OP)?));
            // dv feeds the value projection's backward products: in bf16 too under bf16.
            let (dv_buffer, dv_bf16) = product_input_buffers(&mut dv, OP)?;
            let dv_buffers = (ValuesMut::F32(dv_buffer), dv_bf16);
            launch::causal_attention_backward(
                &dev, qkv, out, lse, dout, dims, precision, dq_buffer, dk_buffer, dv_buffers,
            )?;
            (dq, dk, dv)
        };
        Ok((Tensor::from_cuda(dq, q.shape())?, Tensor::from_cuda(dk, k.shape())?, Tensor::from_cuda(dv, v.shape())?))
    }

    /// [`Tensor::rotary_attention_backward_packed`] in the tensor-core kernels' two launches,
    /// when they run (bf16 products, a head dim they take, q, k and v held in bf16 as RoPE
    /// writes them then, one length); `None` otherwise, for the caller's two ops.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rotary_attention_backward_packed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        dims: &AttentionDims,
        theta: f32,
    ) -> Result<Option<Tensor>> {
        const OP: &str = "rotary_attention_backward_packed";
        let dev = q.cuda_device(OP)?;
        let (q, k, v) = (q.dense()?, k.dense()?, v.dense()?);
        let qkv = [q.cuda_values(OP)?, k.cuda_values(OP)?, v.cuda_values(OP)?];
        let fused = precision(dims) == AttentionPrecision::Bf16
            && qkv.iter().all(|values| values.is_bf16())
            && dims.q_seq == dims.kv_seq;
        if !fused {
            return Ok(None);
        }
        let saved = [out, lse, dout];
        Ok(Some(packed_gradient(&dev, launch::QkvInputs::Dense(qkv), saved, dims, theta)?))
    }

    /// The packed QKV product's gradient `[B, T, 3·H·D]` from the tensor-core backward over
    /// `inputs` (RoPE's dense q, k and v, or the packed product itself, rotated as it is
    /// loaded), `[out, lse, dout]` the forward's output and log-sum-exp and the output's
    /// gradient: dq and dk rotated back by RoPE's tables (base `theta`) as they are stored.
    /// Read by the packed product's backward (or the fused gate's) alone: bf16 alone.
    pub(crate) fn packed_gradient(
        dev: &Arc<CudaDevice>,
        inputs: launch::QkvInputs,
        [out, lse, dout]: [&Tensor; 3],
        dims: &AttentionDims,
        theta: f32,
    ) -> Result<Tensor> {
        const OP: &str = "rotary_attention_backward_packed";
        let (out, lse, dout) = (out.dense()?, lse.dense()?, dout.dense()?);
        let table = crate::ops::rope::cuda::table(dev, dims.kv_seq, dims.head_dim, theta)?;
        let shape = [dims.batch, dims.q_seq, 3 * dims.heads * dims.head_dim];
        product_only_output(dev, OP, &shape, |dqkv| {
            let (out, lse, dout) = (out.cuda_values(OP)?, lse.cuda_f32(OP)?, dout.cuda_values(OP)?);
            Ok(launch::causal_attention_backward_packed(
                dev, inputs, out, lse, dout, dims, dqkv, &table.cos, &table.sin,
            )?)
        })
    }
}
