//! Rotary position embedding of `[B, T, H, D]` (HF LLaMA rotate-half convention) and its
//! backward, the inverse rotation. Kernels: `kernels::cpu::rope` (`kernels::cuda::rope` on
//! the GPU); the cos/sin tables come from [`super::rope_table`].

use kernels::cpu::rope::{self, RopeDims};

use super::rope_table::rope_table;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The sizes of a rotation of `self: [B, T, H, D]` from `pos_offset`, checked once for
    /// either device's kernels: rank 4 and an even head dim (rotary embedding pairs its halves).
    fn rope_dims(&self, op: &'static str, pos_offset: usize) -> Result<RopeDims> {
        let [batch, seq, heads, head_dim] = self.dims4(op)?;
        if head_dim % 2 != 0 {
            return Err(Error::InvalidShape { op, shape: self.shape.clone(), reason: "head dim must be even".into() });
        }
        Ok(RopeDims { batch, seq, heads, head_dim, pos_offset })
    }

    /// Rotary position embedding of `x: [B, T, H, D]` (HF LLaMA rotate-half convention),
    /// token t at position `pos_offset + t`, base `theta` (10000 in LLaMA).
    pub fn rope(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [y] = Tensor::rotate([self], theta, pos_offset, false)?;
        Ok(y)
    }

    /// The backward of [`Tensor::rope`] for the gradient `self = dy` of its output: the
    /// inverse rotation `dx = Rᵀ dy` (a rotation is orthogonal; nothing is saved).
    pub fn rope_backward(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let [dx] = Tensor::rotate([self], theta, pos_offset, true)?;
        Ok(dx)
    }

    /// [`Tensor::rope`] of attention's queries and keys, `q: [B, T, Hq, D]` and
    /// `k: [B, T, Hk, D]` (one device), in one launch on a GPU.
    pub fn rope_pair(q: &Tensor, k: &Tensor, theta: f32, pos_offset: usize) -> Result<(Tensor, Tensor)> {
        let [q, k] = Tensor::rotate([q, k], theta, pos_offset, false)?;
        Ok((q, k))
    }

    /// The backward of [`Tensor::rope_pair`] for the gradients of its outputs: the inverse
    /// rotations of `dq` and `dk`, in one launch on a GPU.
    pub fn rope_pair_backward(dq: &Tensor, dk: &Tensor, theta: f32, pos_offset: usize) -> Result<(Tensor, Tensor)> {
        let [dq, dk] = Tensor::rotate([dq, dk], theta, pos_offset, true)?;
        Ok((dq, dk))
    }

    /// The packed QKV product `qkv: [B, T, 3·H·D]` (each token's q, k and v side by side, as
    /// one GEMM of the stacked weights writes them) as `(R q, R k, v)`, each a dense
    /// `[B, T, H, D]`, q and k rotated from position 0: one launch on a GPU (v moved beside
    /// the rotations), plain ops on the CPU.
    pub fn rope_qkv(qkv: &Tensor, heads: usize, theta: f32) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "rope_qkv";
        let dims = qkv_dims(OP, qkv.shape(), heads)?;
        #[cfg(feature = "cuda")]
        if qkv.cuda_storage().is_some() {
            return cuda::rope_qkv(qkv, dims, theta);
        }
        let [q, k, v] = qkv_parts(qkv, dims)?;
        let (q, k) = Tensor::rope_pair(&q, &k, theta, 0)?;
        Ok((q, k, v))
    }

    /// The backward of [`Tensor::rope_qkv`] for the gradients of its outputs (each
    /// `[B, T, H, D]`): `dqkv = [Rᵀ dq | Rᵀ dk | dv]` per token, `[B, T, 3·H·D]`, in one
    /// launch on a GPU (which also writes its bf16 copy under bf16 products: the packed
    /// product's input gradient reads it).
    pub fn rope_qkv_backward(dq: &Tensor, dk: &Tensor, dv: &Tensor, theta: f32) -> Result<Tensor> {
        const OP: &str = "rope_qkv_backward";
        let dims = dq.rope_dims(OP, 0)?;
        for grad in [dk, dv] {
            dq.same_device(OP, grad)?;
            if grad.shape() != dq.shape() {
                return Err(Error::ShapeMismatch { op: OP, lhs: dq.shape().to_vec(), rhs: grad.shape().to_vec() });
            }
        }
        #[cfg(feature = "cuda")]
        if dq.cuda_storage().is_some() {
            return cuda::rope_qkv_backward([dq, dk, dv], dims, theta);
        }
        let (dq, dk) = Tensor::rope_pair_backward(dq, dk, theta, 0)?;
        let RopeDims { batch, seq, heads, head_dim, .. } = dims;
        let token = |t: &Tensor| t.reshape(&[batch, seq, 1, heads * head_dim]);
        Tensor::cat(&[&token(&dq)?, &token(&dk)?, &token(dv)?], 2)?.reshape(&[batch, seq, 3 * heads * head_dim])
    }

    /// Rotates each of `xs` (all `[B, T, ·, D]` with one B, T and D, on one device) by the
    /// angles of positions `pos_offset + t`; with `backward`, by their negatives.
    fn rotate<const N: usize>(xs: [&Tensor; N], theta: f32, pos_offset: usize, backward: bool) -> Result<[Tensor; N]> {
        let op = if backward { "rope_backward" } else { "rope" };
        let mut dims = Vec::with_capacity(N);
        for x in xs {
            xs[0].same_device(op, x)?;
            let d = x.rope_dims(op, pos_offset)?;
            let first = dims.first().copied().unwrap_or(d);
            if (d.batch, d.seq, d.head_dim) != (first.batch, first.seq, first.head_dim) {
                return Err(Error::ShapeMismatch { op, lhs: xs[0].shape.clone(), rhs: x.shape.clone() });
            }
            dims.push(d);
        }
        let rotated = Tensor::rotate_each(&xs, theta, &dims, backward)?;
        let shape = xs[0].shape.clone();
        rotated.try_into().map_err(|_| Error::InvalidShape { op, shape, reason: "one rotation per tensor".into() })
    }

    /// The rotations of [`Tensor::rotate`], `xs` of the sizes `dims` (checked): one launch on
    /// a GPU, one kernel call per tensor on the CPU.
    fn rotate_each(xs: &[&Tensor], theta: f32, dims: &[RopeDims], backward: bool) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if xs[0].cuda_storage().is_some() {
            return cuda::rope(xs, theta, dims, backward);
        }
        let table = rope_table(dims[0].pos_offset + dims[0].seq, dims[0].head_dim, theta);
        let rotate = if backward { rope::rope_backward } else { rope::rope_forward };
        let mut rotated = Vec::with_capacity(xs.len());
        for (x, dims) in xs.iter().zip(dims) {
            let x = x.contiguous()?;
            let mut y = crate::pool::buffer(x.numel());
            rotate(x.as_slice()?, &table.cos, &table.sin, dims, &mut y);
            rotated.push(Tensor::from_vec(y, &x.shape)?);
        }
        Ok(rotated)
    }
}

/// The sizes of one part (q, k or v) of a packed `[B, T, 3·H·D]` QKV product of `heads`
/// heads of an even width.
pub(crate) fn qkv_dims(op: &'static str, shape: &[usize], heads: usize) -> Result<RopeDims> {
    let invalid = |reason: String| Error::InvalidShape { op, shape: shape.to_vec(), reason };
    let &[batch, seq, width] = shape else { return Err(invalid("expected [B, T, 3·H·D]".into())) };
    if heads == 0 || !width.is_multiple_of(3 * heads) || !(width / (3 * heads)).is_multiple_of(2) {
        return Err(invalid(format!("{heads} heads must split a third of width {width} into even head dims")));
    }
    Ok(RopeDims { batch, seq, heads, head_dim: width / (3 * heads), pos_offset: 0 })
}

/// q, k and v of a packed QKV product as dense `[B, T, H, D]` tensors (copies).
fn qkv_parts(qkv: &Tensor, dims: RopeDims) -> Result<[Tensor; 3]> {
    let RopeDims { batch, seq, heads, head_dim, .. } = dims;
    let width = heads * head_dim;
    let part = |i: usize| qkv.narrow(2, i * width, width)?.contiguous()?.reshape(&[batch, seq, heads, head_dim]);
    Ok([part(0)?, part(1)?, part(2)?])
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of rotary position embedding in `ops/rope.rs`, forward and backward.
    //!
    //! The cos/sin tables are the CPU's `rope_table`, uploaded once per (GPU, head dim, theta)
    //! and kept: a table row depends only on its position, so one table of at least
    //! `pos_offset + T` rows serves every call (it is rebuilt, doubled, when a longer one is
    //! needed). Rebuilding it on the host for every call would cost more than the rotation.

    use std::sync::{Arc, Mutex, OnceLock, PoisonError};

    use kernels::cpu::rope::{rope_table, RopeDims};
    use kernels::cuda::{rope as launch, CudaDevice, DeviceBuffer, Values};

    use crate::cuda::{product_input_buffers, CudaStorage};
    use crate::{Result, Tensor};

    /// Fewest positions of a cached table (short sequences share one upload).
    const MIN_POSITIONS: usize = 256;

    /// The cos and sin tables `[positions, head_dim / 2]` of one GPU, head dim and theta.
    pub(crate) struct Table {
        device: Arc<CudaDevice>,
        head_dim: usize,
        theta_bits: u32,
        positions: usize,
        pub(crate) cos: DeviceBuffer<f32>,
        pub(crate) sin: DeviceBuffer<f32>,
    }

    impl Table {
        fn is_for(&self, dev: &Arc<CudaDevice>, head_dim: usize, theta: f32) -> bool {
            Arc::ptr_eq(&self.device, dev) && self.head_dim == head_dim && self.theta_bits == theta.to_bits()
        }
    }

    /// A table with at least `positions` rows on `dev`, from the cache or built and cached.
    pub(crate) fn table(dev: &Arc<CudaDevice>, positions: usize, head_dim: usize, theta: f32) -> Result<Arc<Table>> {
        static TABLES: OnceLock<Mutex<Vec<Arc<Table>>>> = OnceLock::new();
        let mut tables = TABLES.get_or_init(Mutex::default).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(table) = tables.iter().find(|t| t.is_for(dev, head_dim, theta) && t.positions >= positions) {
            return Ok(Arc::clone(table));
        }
        let positions = positions.next_power_of_two().max(MIN_POSITIONS);
        let (cos, sin) = rope_table(positions, head_dim, theta);
        let table = Arc::new(Table {
            device: Arc::clone(dev),
            head_dim,
            theta_bits: theta.to_bits(),
            positions,
            cos: dev.upload(&cos)?,
            sin: dev.upload(&sin)?,
        });
        tables.retain(|t| !t.is_for(dev, head_dim, theta));
        tables.push(Arc::clone(&table));
        Ok(table)
    }

    /// [`Tensor::rope_qkv`] on the GPU: one launch for q, k (rotated) and v (moved), from the
    /// packed product in f32 or in bf16 (stored so under bf16 products). When attention reads
    /// them in bf16 (its tensor-core kernels), they are written in bf16 only, rounded as the
    /// kernels' staging rounds f32 ones: the same bits, half the bytes written, read and
    /// saved for the backward.
    pub(crate) fn rope_qkv(qkv: &Tensor, dims: RopeDims, theta: f32) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "rope_qkv";
        let dev = qkv.cuda_device(OP)?;
        let qkv = qkv.dense()?;
        let table = table(&dev, dims.seq, dims.head_dim, theta)?;
        let rounded = crate::ops::attention::cuda::reads_bf16_inputs(dims.head_dim);
        let alloc = || CudaStorage::alloc_values(&dev, dims.len(), rounded);
        let (mut q, mut k, mut v) = (alloc()?, alloc()?, alloc()?);
        let outputs = [q.values_mut(OP)?, k.values_mut(OP)?, v.values_mut(OP)?];
        launch::rope_qkv_forward(&dev, qkv.cuda_values(OP)?, dims, outputs, &table.cos, &table.sin)?;
        let shape = [dims.batch, dims.seq, dims.heads, dims.head_dim];
        Ok((Tensor::from_cuda(q, &shape)?, Tensor::from_cuda(k, &shape)?, Tensor::from_cuda(v, &shape)?))
    }

    /// [`Tensor::rope_qkv_backward`] on the GPU: one launch writes every token's
    /// `[Rᵀ dq | Rᵀ dk | dv]` row, read by the packed product's backward (or the fused
    /// gate's) alone: in bf16 alone under bf16 products. The gradients are read as they are
    /// held (bf16 from the tensor-core attention), widened when they differ in type.
    pub(crate) fn rope_qkv_backward(grads: [&Tensor; 3], dims: RopeDims, theta: f32) -> Result<Tensor> {
        const OP: &str = "rope_qkv_backward";
        let dev = grads[0].cuda_device(OP)?;
        let grads: Vec<Tensor> = grads.iter().map(|g| g.dense()).collect::<Result<_>>()?;
        let table = table(&dev, dims.seq, dims.head_dim, theta)?;
        let shape = [dims.batch, dims.seq, 3 * dims.heads * dims.head_dim];
        crate::cuda::product_only_output(&dev, OP, &shape, |dqkv| {
            let held = [grads[0].cuda_values(OP)?, grads[1].cuda_values(OP)?, grads[2].cuda_values(OP)?];
            let values = if held.iter().all(|v| v.is_bf16() == held[0].is_bf16()) {
                held
            } else {
                let [dq, dk, dv] = [&grads[0], &grads[1], &grads[2]].map(|g| g.cuda_f32(OP));
                [Values::F32(dq?), Values::F32(dk?), Values::F32(dv?)]
            };
            Ok(launch::rope_qkv_backward(&dev, values, dims, dqkv, &table.cos, &table.sin)?)
        })
    }

    /// Rotates every tensor of `xs` of the sizes `dims` (checked by the caller) in one
    /// launch; with `backward`, each is an output gradient and its result the inverse
    /// rotation `Rᵀ dy`.
    pub(crate) fn rope(xs: &[&Tensor], theta: f32, dims: &[RopeDims], backward: bool) -> Result<Vec<Tensor>> {
        let op = if backward { "rope_backward" } else { "rope" };
        let dev = xs[0].cuda_device(op)?;
        let xs: Vec<Tensor> = xs.iter().map(|x| x.dense()).collect::<Result<_>>()?;
        let table = table(&dev, dims[0].pos_offset + dims[0].seq, dims[0].head_dim, theta)?;
        let mut outs: Vec<CudaStorage> =
            xs.iter().map(|x| CudaStorage::alloc(&dev, x.numel())).collect::<Result<_>>()?;
        let mut parts = Vec::with_capacity(xs.len());
        for ((x, out), &dims) in xs.iter().zip(&mut outs).zip(dims) {
            // The backward's dq and dk feed the query and key projections' backward products:
            // in bf16 too under bf16 products (the forward's output goes to attention, in f32).
            let (out, out_bf16) =
                if backward { product_input_buffers(out, op)? } else { (out.f32_buffer_mut(op)?, None) };
            parts.push(launch::RopePart { x: x.cuda_f32(op)?, dims, out, out_bf16 });
        }
        if backward {
            launch::rope_backward(&dev, &mut parts, &table.cos, &table.sin)?;
        } else {
            launch::rope_forward(&dev, &mut parts, &table.cos, &table.sin)?;
        }
        drop(parts);
        outs.into_iter().zip(&xs).map(|(out, x)| Tensor::from_cuda(out, x.shape())).collect()
    }
}
