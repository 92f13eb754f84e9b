//! The CPU's rotary-embedding cos/sin tables, built once per (head dim, theta) and kept.
//!
//! A table row depends only on its position, so one table of at least `pos_offset + T`
//! rows serves every call; it is rebuilt, doubled, when a longer one is needed. Building it
//! per call (`T·D/2` f64 `sin_cos`, forward and backward of every layer) cost more than
//! the rotation itself. The CUDA branch keeps its own uploaded copy (`cuda/rope.rs`).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kernels::cpu::rope;

/// Fewest positions of a cached table (short sequences share one table).
const MIN_POSITIONS: usize = 256;

/// `cos` and `sin`, each `[positions, head_dim / 2]` row-major.
pub(crate) struct RopeTable {
    head_dim: usize,
    theta_bits: u32,
    positions: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// A table with at least `positions` rows for `head_dim` and `theta`, from the cache or
/// built and cached (replacing a shorter one).
pub(crate) fn rope_table(positions: usize, head_dim: usize, theta: f32) -> Arc<RopeTable> {
    static TABLES: OnceLock<Mutex<Vec<Arc<RopeTable>>>> = OnceLock::new();
    let is_for = |t: &RopeTable| t.head_dim == head_dim && t.theta_bits == theta.to_bits();
    let mut tables = TABLES.get_or_init(Mutex::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(table) = tables.iter().find(|t| is_for(t) && t.positions >= positions) {
        return Arc::clone(table);
    }
    let positions = positions.next_power_of_two().max(MIN_POSITIONS);
    let (cos, sin) = rope::rope_table(positions, head_dim, theta);
    let table = Arc::new(RopeTable { head_dim, theta_bits: theta.to_bits(), positions, cos, sin });
    tables.retain(|t| !is_for(t));
    tables.push(Arc::clone(&table));
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_table_is_the_fresh_one_and_grows_on_demand() {
        let short = rope_table(10, 6, 500.0);
        assert!(short.positions >= 10);
        assert!(Arc::ptr_eq(&short, &rope_table(short.positions, 6, 500.0)), "not reused");
        let long = rope_table(short.positions + 1, 6, 500.0);
        let (cos, sin) = rope::rope_table(long.positions, 6, 500.0);
        assert_eq!((&long.cos, &long.sin), (&cos, &sin));
        assert!(!Arc::ptr_eq(&short, &rope_table(4, 6, 501.0)), "theta ignored");
    }
}
