//! Per-token layers added to the residual stream (SPEC §4, note `004`).
//!
//! - [`PerTokenTransform`]: `PTT(x, token) = U·(M[token]·(D·x))`, `D: r × C`,
//!   `M: V × r × r`, `U: C × r` (init 0, so the block starts as the baseline), r ≈ √C.
//!   Inserted after attention: `x = x + attn(norm(x)); x = x + PTT(x, tok); ...`.
//! - [`TokenScale`]: the BlinkDL form, FFN output `⊙ E[token]`, `E: V × C` (init 1).
//!
//! PyTorch equivalent of PTT: `up(torch.einsum("nij,nj->ni", M[tok], down(x)))`.
//! Init choices the note leaves open: D Kaiming-uniform, M the identity for every token
//! (the transform starts as a plain low-rank bottleneck; with U = 0 the output is 0 anyway).

use autograd::{Result, Var};
use tensor::{Error, Rng, Tensor, Tokens};

use crate::init;
use crate::module::{join, Module};

/// `U·(M[token]·(D·x))`: a token-specific `r × r` map inside a rank-r bottleneck.
pub struct PerTokenTransform {
    /// `D: [r, C]`.
    pub down: Var,
    /// `M: [V, r, r]`.
    pub table: Var,
    /// `U: [C, r]`, init 0.
    pub up: Var,
}

impl PerTokenTransform {
    /// A transform of width `dim` with `rank` (SPEC: `round(√dim)`) for a `vocab`-token table.
    pub fn new(vocab: usize, dim: usize, rank: usize, rng: &mut Rng) -> PerTokenTransform {
        let mut identities = vec![0.0; vocab * rank * rank];
        for matrix in identities.chunks_mut(rank * rank) {
            matrix.iter_mut().step_by(rank + 1).for_each(|v| *v = 1.0);
        }
        let table = Tensor::from_vec(identities, &[vocab, rank, rank]).expect("length matches [V, r, r]");
        PerTokenTransform {
            down: init::kaiming_uniform(&[rank, dim], dim, rng),
            table: Var::parameter(table),
            up: init::zeros(&[dim, rank]),
        }
    }

    /// `x: [..., C]` with one token id per row (`ids` on `x`'s device) → `[..., C]` (the
    /// residual update, not `x` + it).
    pub fn forward(&self, x: &Var, ids: &Tokens) -> Result<Var> {
        let shape = x.shape();
        let (vocab, rank, dim) = (self.table.shape()[0], self.down.shape()[0], self.down.shape()[1]);
        let rows = x.value_ref().numel() / dim.max(1);
        if ids.len() != rows {
            return Err(Error::ShapeMismatch { op: "per_token_transform", lhs: shape, rhs: vec![ids.len()] });
        }
        let projected = x.reshape(&[rows, dim])?.matmul(&self.down.transpose(0, 1)?)?;
        let matrices =
            self.table.reshape(&[vocab, rank * rank])?.embedding(ids, &[rows])?.reshape(&[rows, rank, rank])?;
        // (M·y)_i = Σ_j M_ij·y_j, as a broadcast product and a sum (no per-token GEMM calls).
        let mixed = matrices.mul(&projected.reshape(&[rows, 1, rank])?)?.sum_axis(2, false)?;
        mixed.matmul(&self.up.transpose(0, 1)?)?.reshape(&shape)
    }
}

impl Module for PerTokenTransform {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "down.weight"), &self.down);
        visit(join(prefix, "table"), &self.table);
        visit(join(prefix, "up.weight"), &self.up);
    }
}

/// `y ⊙ E[token]`: a learned per-token, per-channel scale of a sublayer's output.
pub struct TokenScale {
    /// `E: [V, C]`, init 1.
    pub weight: Var,
}

impl TokenScale {
    /// A table of ones over `vocab` tokens and `dim` channels.
    pub fn new(vocab: usize, dim: usize) -> TokenScale {
        TokenScale { weight: init::ones(&[vocab, dim]) }
    }

    /// `y: [..., C]` with one token id per row (`ids` on `y`'s device) → `y ⊙ E[ids]`.
    pub fn forward(&self, y: &Var, ids: &Tokens) -> Result<Var> {
        let shape = y.shape();
        let ids_shape = &shape[..shape.len().saturating_sub(1)];
        y.mul(&self.weight.embedding(ids, ids_shape)?)
    }
}

impl Module for TokenScale {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
    }
}
