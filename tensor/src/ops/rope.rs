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
        let dims = self.rope_dims("rope", pos_offset)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::rope(self, theta, &dims, false);
        }
        let x = self.contiguous()?;
        let table = rope_table(pos_offset + dims.seq, dims.head_dim, theta);
        let mut y = crate::pool::buffer(x.numel());
        rope::rope_forward(x.as_slice()?, &table.cos, &table.sin, &dims, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// The backward of [`Tensor::rope`] for the gradient `self = dy` of its output: the
    /// inverse rotation `dx = Rᵀ dy` (a rotation is orthogonal; nothing is saved).
    pub fn rope_backward(&self, theta: f32, pos_offset: usize) -> Result<Tensor> {
        let dims = self.rope_dims("rope_backward", pos_offset)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::rope(self, theta, &dims, true);
        }
        let dy = self.contiguous()?;
        let table = rope_table(pos_offset + dims.seq, dims.head_dim, theta);
        let mut dx = crate::pool::buffer(dy.numel());
        rope::rope_backward(dy.as_slice()?, &table.cos, &table.sin, &dims, &mut dx);
        Tensor::from_vec(dx, &self.shape)
    }
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
    use kernels::cuda::{rope as launch, CudaDevice, DeviceBuffer};

    use crate::cuda::{output, product_input_output};
    use crate::{Result, Tensor};

    /// Fewest positions of a cached table (short sequences share one upload).
    const MIN_POSITIONS: usize = 256;

    /// The cos and sin tables `[positions, head_dim / 2]` of one GPU, head dim and theta.
    struct Table {
        device: Arc<CudaDevice>,
        head_dim: usize,
        theta_bits: u32,
        positions: usize,
        cos: DeviceBuffer<f32>,
        sin: DeviceBuffer<f32>,
    }

    impl Table {
        fn is_for(&self, dev: &Arc<CudaDevice>, head_dim: usize, theta: f32) -> bool {
            Arc::ptr_eq(&self.device, dev) && self.head_dim == head_dim && self.theta_bits == theta.to_bits()
        }
    }

    /// A table with at least `positions` rows on `dev`, from the cache or built and cached.
    fn table(dev: &Arc<CudaDevice>, positions: usize, head_dim: usize, theta: f32) -> Result<Arc<Table>> {
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

    /// Rotates `x` of the sizes `dims` (checked by the caller); with `backward`, `x` is the
    /// output gradient and the result is the inverse rotation `Rᵀ dy`.
    pub(crate) fn rope(x: &Tensor, theta: f32, dims: &RopeDims, backward: bool) -> Result<Tensor> {
        let op = if backward { "rope_backward" } else { "rope" };
        let dev = x.cuda_device(op)?;
        let x = x.dense()?;
        let table = table(&dev, dims.pos_offset + dims.seq, dims.head_dim, theta)?;
        let (cos, sin) = (&table.cos, &table.sin);
        if backward {
            // dq and dk feed the query and key projections' backward products: in bf16 too
            // under bf16 products (the forward's output goes to attention, in f32).
            product_input_output(&dev, op, x.shape(), |dx, dx_bf16| {
                Ok(launch::rope_backward(&dev, x.cuda_f32(op)?, cos, sin, dims, (dx, dx_bf16))?)
            })
        } else {
            output(&dev, op, x.shape(), |y| Ok(launch::rope_forward(&dev, x.cuda_f32(op)?, cos, sin, dims, y)?))
        }
    }
}
