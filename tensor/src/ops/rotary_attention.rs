//! LLaMA's attention over a packed QKV product as one op: RoPE's rotation of q and k, then
//! causal attention ([`Tensor::rope_qkv`], [`Tensor::causal_attention`]), keeping what the
//! backward needs in a [`PackedAttention`]. On a GPU's tensor cores under bf16 products the
//! kernels read the packed product itself and rotate q and k as they load them, forward and
//! backward (`kernels::cuda::attention::QkvInputs::Packed`): RoPE takes no launch, no dense q,
//! k or v is written, and the backward saves the product instead of them; the bits are those
//! of RoPE then attention. Elsewhere the ops run in turn.

use crate::{Result, Tensor};

/// Attention over a packed QKV product ([`Tensor::rotary_attention_packed`]): its output and
/// what its backward ([`PackedAttention::backward`]) reads.
pub struct PackedAttention {
    /// The attention output, `[B, T, H, D]`.
    pub out: Tensor,
    /// The log-sum-exp of each query's scores, `[B, H, T]`.
    lse: Tensor,
    inputs: SavedInputs,
    scale: f32,
    theta: f32,
}

/// The inputs attention read, as its backward reads them again.
enum SavedInputs {
    /// RoPE's rotated q and k, and v, each a dense `[B, T, H, D]`.
    Rotated([Tensor; 3]),
    /// The packed product `[B, T, 3·H·D]` (bf16), rotated as the GPU kernels load it.
    #[cfg(feature = "cuda")]
    Packed { qkv: Tensor, heads: usize },
}

impl Tensor {
    /// Causal attention (`scale`) over the packed QKV product `qkv: [B, T, 3·H·D]` (each
    /// token's q, k and v side by side) with `heads` heads, q and k rotated by RoPE from
    /// position 0 with base `theta`: [`Tensor::causal_attention`] of [`Tensor::rope_qkv`].
    pub fn rotary_attention_packed(qkv: &Tensor, heads: usize, scale: f32, theta: f32) -> Result<PackedAttention> {
        #[cfg(feature = "cuda")]
        if qkv.cuda_storage().is_some() {
            let dims = super::rope::qkv_dims("rotary_attention_packed", qkv.shape(), heads)?;
            if let Some((out, lse)) = cuda::forward(qkv, dims, scale, theta)? {
                let inputs = SavedInputs::Packed { qkv: qkv.dense()?, heads };
                return Ok(PackedAttention { out, lse, inputs, scale, theta });
            }
        }
        let (q, k, v) = Tensor::rope_qkv(qkv, heads, theta)?;
        let (out, lse) = Tensor::causal_attention(&q, &k, &v, scale)?;
        Ok(PackedAttention { out, lse, inputs: SavedInputs::Rotated([q, k, v]), scale, theta })
    }
}

impl PackedAttention {
    /// The gradient `[B, T, 3·H·D]` of the packed product from the output gradient `dout`:
    /// `[Rᵀ dq | Rᵀ dk | dv]` per token ([`Tensor::rotary_attention_backward_packed`]).
    pub fn backward(&self, dout: &Tensor) -> Result<Tensor> {
        let PackedAttention { out, lse, scale, theta, .. } = self;
        match &self.inputs {
            SavedInputs::Rotated([q, k, v]) => {
                Tensor::rotary_attention_backward_packed(q, k, v, out, lse, dout, *scale, *theta)
            }
            #[cfg(feature = "cuda")]
            SavedInputs::Packed { qkv, heads } => cuda::backward(qkv, *heads, out, lse, dout, *scale, *theta),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The tensor-core kernels reading the packed product unrotated.

    use kernels::cpu::attention::AttentionDims;
    use kernels::cpu::rope::RopeDims;
    use kernels::cuda::attention::{self as launch, QkvInputs};

    use crate::cuda::CudaStorage;
    use crate::ops::attention::cuda::{packed_gradient, reads_bf16_inputs};
    use crate::ops::rope::cuda::table;
    use crate::{Result, Tensor};

    /// The attention sizes of a packed product of `dims`.
    fn attention_dims(dims: RopeDims, scale: f32) -> AttentionDims {
        let RopeDims { batch, seq, heads, head_dim, .. } = dims;
        AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale }
    }

    /// `(out, lse)` from the packed product read unrotated, when the tensor-core kernels run
    /// and the product is held in bf16 (as bf16 products store it); `None` otherwise (an f32
    /// product is rotated in f32 before attention rounds it: RoPE's own launch).
    pub(super) fn forward(qkv: &Tensor, dims: RopeDims, scale: f32, theta: f32) -> Result<Option<(Tensor, Tensor)>> {
        const OP: &str = "rotary_attention_packed";
        if !reads_bf16_inputs(dims.head_dim) {
            return Ok(None);
        }
        let dev = qkv.cuda_device(OP)?;
        let qkv = qkv.dense()?;
        let values = qkv.cuda_values(OP)?;
        if !values.is_bf16() {
            return Ok(None);
        }
        let attention = attention_dims(dims, scale);
        let table = table(&dev, dims.seq, dims.head_dim, theta)?;
        let mut lse = CudaStorage::alloc(&dev, attention.lse_len())?;
        // bf16 alone, as FlashAttention-2 stores it: the output projection reads it so.
        let mut out = CudaStorage::alloc_values(&dev, dims.len(), true)?;
        let tables = (&table.cos, &table.sin);
        launch::rotary_causal_attention_forward_packed(
            &dev,
            values,
            &attention,
            out.values_mut(OP)?,
            lse.f32_buffer_mut(OP)?,
            tables,
        )?;
        let shape = [dims.batch, dims.seq, dims.heads, dims.head_dim];
        let lse_shape = [dims.batch, dims.heads, dims.seq];
        Ok(Some((Tensor::from_cuda(out, &shape)?, Tensor::from_cuda(lse, &lse_shape)?)))
    }

    /// The packed product's gradient from the kernels reading it unrotated again, dq and dk
    /// rotated back as they are stored: bf16 alone, read by the packed product's backward.
    pub(super) fn backward(
        qkv: &Tensor,
        heads: usize,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
        theta: f32,
    ) -> Result<Tensor> {
        const OP: &str = "rotary_attention_backward_packed";
        let dev = qkv.cuda_device(OP)?;
        let dims = crate::ops::rope::qkv_dims(OP, qkv.shape(), heads)?;
        out.check_like(OP, dout)?;
        let inputs = QkvInputs::Packed(qkv.cuda_values(OP)?);
        packed_gradient(&dev, inputs, [out, lse, dout], &attention_dims(dims, scale), theta)
    }
}
