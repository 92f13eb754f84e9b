//! The CUDA branch of rotary position embedding in `ops/rope.rs`, forward and backward.
//!
//! The cos/sin tables are the CPU's `rope_table`, uploaded once per (GPU, head dim, theta)
//! and kept: a table row depends only on its position, so one table of at least
//! `pos_offset + T` rows serves every call (it is rebuilt, doubled, when a longer one is
//! needed). Rebuilding it on the host for every call would cost more than the rotation.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kernels::cpu::rope::rope_table;
use kernels::cuda::{rope as launch, CudaDevice, DeviceBuffer};

use super::{accumulated, output};
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

/// Rotates `x: [B, T, H, D]` (D even, checked by the caller), token t at position
/// `pos_offset + t`; with `backward`, `x` is the output gradient and the result is the
/// inverse rotation `Rᵀ dy`.
pub(crate) fn rope(x: &Tensor, theta: f32, pos_offset: usize, backward: bool) -> Result<Tensor> {
    let op = if backward { "rope_backward" } else { "rope" };
    let [b, t, h, d] = x.dims4(op)?;
    let dev = x.cuda_device(op)?;
    let x = x.dense()?;
    let table = table(&dev, pos_offset + t, d, theta)?;
    let (cos, sin) = (&table.cos, &table.sin);
    if backward {
        accumulated(&dev, op, x.shape(), |dx| {
            Ok(launch::rope_backward(&dev, x.cuda_f32(op)?, cos, sin, b, t, h, d, pos_offset, dx)?)
        })
    } else {
        output(&dev, op, x.shape(), |y| {
            Ok(launch::rope_forward(&dev, x.cuda_f32(op)?, cos, sin, b, t, h, d, pos_offset, y)?)
        })
    }
}
