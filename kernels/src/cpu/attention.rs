//! Causal scaled-dot-product attention as one op, flash-style (Dao et al. 2022, FlashAttention
//! Algorithm 1 forward and Algorithm 2 backward, on the CPU).
//!
//! q `[B, Tq, H, D]`, k and v `[B, Tk, H, D]`, out `[B, Tq, H, D]`:
//! out_i = Σ_s softmax_s(scale · q_i·k_s) v_s over keys s ≤ i + (Tk − Tq), so a query block
//! at the end of a longer key/value cache (decoding) sees the whole prefix.
//!
//! The forward walks key tiles with an online softmax (running max and sum per query) and
//! never builds the `Tq × Tk` score matrix or a mask; it saves only `lse` `[B, H, Tq]`, the
//! log-sum-exp of each query's scaled scores. The backward recomputes each probability tile
//! as e^(score − lse) and writes `dq, dk, dv = ...` (the crate's contract, see `lib.rs`).
//! Tile products run in registers (`tile_gemm`) on the heads in place; only each head's keys
//! (and, in backward, values) are copied once, transposed to `[D, T]`, so score tiles are
//! products with rows of Kᵀ.
//!
//! PyTorch equivalent: `F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)`
//! on `[B, H, T, D]` tensors (PyTorch aligns the causal mask top-left when Tq < Tk; here it
//! is bottom-right, which is what a KV cache needs).
//!
//! Layout legend: `B` batch, `T` sequence, `H` heads, `D` head dim.

use std::marker::PhantomData;

use rayon::prelude::*;
use wide::f32x8;

use super::matmul::{GemmDims, Store};
use super::parallel;
use super::reduce::{dot, slice_max};
use super::scratch::with_scratch;
use super::simd::{exp8, load, store, LANES};
use super::tile_gemm::{tile_gemm, TileA, TileB};

/// Queries per tile: the rows of one score block.
const Q_TILE: usize = 32;
/// Keys per tile: the width of the score block kept in cache (32 × 128 floats = 16 KiB, so
/// a sequence of up to 128 keys needs no online-softmax rescaling at all).
const K_TILE: usize = 128;

/// `out` and `lse` (the log-sum-exp of each query's scaled scores, saved for backward) of
/// the operands `dims` describes. Query i attends keys s ≤ its absolute position, which is
/// what makes KV-cache decoding work.
pub fn causal_attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &AttentionDims,
    out: &mut [f32],
    lse: &mut [f32],
) {
    dims.assert_fits("causal_attention_forward", q, k, v);
    assert_eq!(out.len(), q.len(), "causal_attention_forward: out has the wrong length");
    assert_eq!(lse.len(), dims.lse_len(), "causal_attention_forward: lse has the wrong length");
    let (q_seq, heads) = (dims.q_seq, dims.heads);
    if out.is_empty() {
        return;
    }
    // One task per (b, h): the head's keys are transposed once ([D, Tk], so score tiles are
    // rows of Kᵀ) and all its query tiles run in it. Heads interleave in `out`, so each task
    // writes its own rows through `HeadRows`; lse is [B, H, Tq], one run per task.
    let out = HeadRows::new(out);
    let head = |(index, lse): (usize, &mut [f32])| forward_head(dims, q, k, v, index / heads, index % heads, out, lse);
    if parallel::should_parallelise(dims.work()) {
        lse.par_chunks_mut(q_seq).enumerate().for_each(head);
    } else {
        lse.chunks_mut(q_seq).enumerate().for_each(head);
    }
}

/// dq, dk, dv = gradients (recompute probabilities from q, k and lse; delta_i = Σ dout_i ⊙ out_i).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: &AttentionDims,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    dims.assert_fits("causal_attention_backward", q, k, v);
    let (batch, heads) = (dims.batch, dims.heads);
    assert!(
        out.len() == q.len() && dout.len() == q.len(),
        "causal_attention_backward: out or dout has the wrong length"
    );
    assert_eq!(lse.len(), dims.lse_len(), "causal_attention_backward: lse has the wrong length");
    assert!(
        dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "causal_attention_backward: gradient has the wrong length"
    );
    if q.is_empty() {
        // No queries: keys and values that nothing attends to have zero gradients.
        dk.fill(0.0);
        dv.fill(0.0);
        return;
    }
    // With P = softmax(S), S = scale·Q·Kᵀ, O = P·V:  d/dV = Pᵀ·dO,  d/dS = P ⊙ (dO·Vᵀ − δ),
    // d/dQ = scale·dS·K,  d/dK = scale·dSᵀ·Q,  δ_i = Σ_d dO_id·O_id.
    // One task per (b, h); heads interleave in memory, so each task adds its finished
    // gradient rows into its own rows of dq, dk and dv through `HeadRows`.
    let grads = Grads { dq: HeadRows::new(dq), dk: HeadRows::new(dk), dv: HeadRows::new(dv) };
    let pair = |index: usize| backward_pair(dims, q, k, v, out, lse, dout, index / heads, index % heads, grads);
    if parallel::should_parallelise(2 * dims.work()) {
        (0..batch * heads).into_par_iter().for_each(pair);
    } else {
        (0..batch * heads).for_each(pair);
    }
}

/// Naive reference (materialises scores) for tests and the bench.
pub fn causal_attention_reference(q: &[f32], k: &[f32], v: &[f32], dims: &AttentionDims) -> Vec<f32> {
    dims.assert_fits("causal_attention_reference", q, k, v);
    let AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale } = *dims;
    let mut out = vec![0.0; q.len()];
    let mut scores = vec![0.0; kv_seq];
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..q_seq {
                let keys = i + dims.offset() + 1;
                let qi = &q[dims.q_at(b, i, h)..][..head_dim];
                for (s, score) in scores[..keys].iter_mut().enumerate() {
                    let ks = &k[dims.kv_at(b, s, h)..][..head_dim];
                    *score = scale * qi.iter().zip(ks).map(|(a, b)| a * b).sum::<f32>();
                }
                let max = scores[..keys].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = scores[..keys].iter().map(|s| (s - max).exp()).sum();
                let oi = &mut out[dims.q_at(b, i, h)..][..head_dim];
                for (s, &score) in scores[..keys].iter().enumerate() {
                    let p = (score - max).exp() / total;
                    for (o, &vs) in oi.iter_mut().zip(&v[dims.kv_at(b, s, h)..][..head_dim]) {
                        *o += p * vs;
                    }
                }
            }
        }
    }
    out
}

/// Naive reference of [`causal_attention_backward`] (materialises each query's probabilities
/// and recomputes the output it needs) for tests and the bench: `(dq, dk, dv)`.
pub fn causal_attention_backward_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    dims: &AttentionDims,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    dims.assert_fits("causal_attention_backward_reference", q, k, v);
    assert_eq!(dout.len(), q.len(), "causal_attention_backward_reference: dout has the wrong length");
    let AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale } = *dims;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let (mut probs, mut dprobs) = (vec![0.0; kv_seq], vec![0.0; kv_seq]);
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..q_seq {
                let keys = i + dims.offset() + 1;
                let at = dims.q_at(b, i, h);
                let (qi, doi) = (&q[at..][..head_dim], &dout[at..][..head_dim]);
                for s in 0..keys {
                    let kv = dims.kv_at(b, s, h);
                    probs[s] = scale * dot(qi, &k[kv..][..head_dim]);
                    // dP_s = dO_i · v_s.
                    dprobs[s] = dot(doi, &v[kv..][..head_dim]);
                }
                let max = probs[..keys].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                probs[..keys].iter_mut().for_each(|p| *p = (*p - max).exp());
                let total: f32 = probs[..keys].iter().sum();
                probs[..keys].iter_mut().for_each(|p| *p /= total);
                // δ = Σ_s P_s·dP_s = dO_i · O_i.
                let delta = dot(&probs[..keys], &dprobs[..keys]);
                for s in 0..keys {
                    let kv = dims.kv_at(b, s, h);
                    let ds = probs[s] * (dprobs[s] - delta) * scale;
                    for d in 0..head_dim {
                        dv[kv + d] += probs[s] * doi[d];
                        dq[at + d] += ds * k[kv + d];
                        dk[kv + d] += ds * qi[d];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Sizes of one causal attention call, shared by the CPU and CUDA kernels (`cuda::attention`
/// takes the same struct): q `[B, Tq, H, D]`, k and v `[B, Tk, H, D]`, out like q, lse
/// `[B, H, Tq]`. Query i sits at absolute position `i + (Tk − Tq)`. [`AttentionDims::check`]
/// is the one validation both devices run; the private methods below are the CPU kernels'
/// index arithmetic of the `[B, T, H, D]` layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// `B`: sequences.
    pub batch: usize,
    /// `Tq`: queries per sequence.
    pub q_seq: usize,
    /// `Tk ≥ Tq`: keys (and values) per sequence.
    pub kv_seq: usize,
    /// `H`: heads.
    pub heads: usize,
    /// `D > 0`: dims per head.
    pub head_dim: usize,
    /// Scale of the scores `q·k` (usually `1/√D`).
    pub scale: f32,
}

impl AttentionDims {
    /// Elements of q (and of out, dout, dq).
    pub fn q_len(&self) -> usize {
        self.batch * self.q_seq * self.heads * self.head_dim
    }

    /// Elements of k, and of v.
    pub fn kv_len(&self) -> usize {
        self.batch * self.kv_seq * self.heads * self.head_dim
    }

    /// Elements of lse.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.q_seq
    }

    /// Whether these sizes describe operands of `q`, `k` and `v` elements; the error says
    /// what does not fit.
    pub fn check(&self, q: usize, k: usize, v: usize) -> Result<(), String> {
        if self.q_seq > self.kv_seq {
            return Err(format!("more queries ({}) than keys ({})", self.q_seq, self.kv_seq));
        }
        if self.head_dim == 0 {
            return Err("zero head_dim".into());
        }
        if q != self.q_len() {
            return Err(format!("q has {q} elements, [B, Tq, H, D] = {:?} needs {}", self.q_shape(), self.q_len()));
        }
        if k != self.kv_len() || v != self.kv_len() {
            return Err(format!(
                "k and v have {k} and {v} elements, [B, Tk, H, D] = {:?} needs {}",
                [self.batch, self.kv_seq, self.heads, self.head_dim],
                self.kv_len()
            ));
        }
        Ok(())
    }

    fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.q_seq, self.heads, self.head_dim]
    }

    /// Panics naming `op` unless [`AttentionDims::check`] accepts `q`, `k`, `v`.
    fn assert_fits(&self, op: &str, q: &[f32], k: &[f32], v: &[f32]) {
        if let Err(message) = self.check(q.len(), k.len(), v.len()) {
            panic!("{op}: {message}");
        }
    }

    /// Absolute position of query 0.
    fn offset(&self) -> usize {
        self.kv_seq - self.q_seq
    }

    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.q_seq + i) * self.heads + h) * self.head_dim
    }

    fn kv_at(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.kv_seq + s) * self.heads + h) * self.head_dim
    }

    /// Multiply-adds of one pass (the causal half of Q·Kᵀ and of P·V).
    fn work(&self) -> usize {
        self.batch * self.heads * self.q_seq * self.kv_seq * self.head_dim
    }

    /// Of the `cols` keys from `s0`, how many query `i` sees (the causal mask).
    fn visible_keys(&self, i: usize, s0: usize, cols: usize) -> usize {
        (i + self.offset() + 1).saturating_sub(s0).min(cols)
    }

    /// Keys visible to the queries `i0..i0 + rows`: `0..end`.
    fn key_end(&self, i0: usize, rows: usize) -> usize {
        i0 + rows + self.offset()
    }

    /// Query-side rows `[tokens, D]` of one head from element `at` (any tile layout).
    fn rows<'a>(&self, data: &'a [f32], at: usize) -> TileA<'a> {
        TileA { data, offset: at, row_stride: self.heads * self.head_dim, col_stride: 1 }
    }

    /// Rows `[tokens, D]` of key/value head `h` of batch entry `b` from token `s0`, as the
    /// right operand of a tile product.
    fn kv_rows<'a>(&self, data: &'a [f32], b: usize, s0: usize, h: usize) -> TileB<'a> {
        TileB { data, offset: self.kv_at(b, s0, h), row_stride: self.heads * self.head_dim }
    }

    /// Head `h` of batch entry `b` of a key/value tensor, transposed into `t` `[D, Tk]`.
    fn transpose_head(&self, data: &[f32], b: usize, h: usize, t: &mut [f32]) {
        let head = &data[self.kv_at(b, 0, h)..];
        let (stride, dh, seq) = (self.heads * self.head_dim, self.head_dim, self.kv_seq);
        // 8 × 8 blocks in registers: eight contiguous loads (8 tokens × 8 dims), one
        // shuffle network, eight contiguous stores (8 dims × 8 tokens).
        let (seq_blocks, dim_blocks) = (seq - seq % LANES, dh - dh % LANES);
        for s0 in (0..seq_blocks).step_by(LANES) {
            for x0 in (0..dim_blocks).step_by(LANES) {
                let rows = std::array::from_fn(|r| load(&head[(s0 + r) * stride + x0..]));
                for (j, column) in f32x8::transpose(rows).into_iter().enumerate() {
                    store(column, &mut t[(x0 + j) * seq + s0..]);
                }
            }
        }
        // The ragged edges (tokens past the last block of 8, dims past the last 8), one by one.
        for s in 0..seq {
            let first_dim = if s < seq_blocks { dim_blocks } else { 0 };
            for x in first_dim..dh {
                t[x * seq + s] = head[s * stride + x];
            }
        }
    }

    /// Columns `s0..` of a transposed head `[D, Tk]` as the right operand of a tile product.
    fn kt_columns<'a>(&self, kt: &'a [f32], s0: usize) -> TileB<'a> {
        TileB { data: kt, offset: s0, row_stride: self.kv_seq }
    }
}

/// A `[B, T, H, D]` tensor shared by the per-(b, h) tasks. Heads interleave in memory, so no
/// task can borrow a contiguous part of it, but each task touches only the D-element rows of
/// its own (b, h), which no other task touches.
#[derive(Clone, Copy)]
struct HeadRows<'a> {
    ptr: *mut f32,
    len: usize,
    borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a HeadRows stands for an exclusive borrow of an `f32` slice (which is Send and
// Sync); tasks on different threads reach only disjoint rows of it through `row`.
unsafe impl Send for HeadRows<'_> {}
// SAFETY: as for Send.
unsafe impl Sync for HeadRows<'_> {}

impl<'a> HeadRows<'a> {
    fn new(data: &'a mut [f32]) -> Self {
        Self { ptr: data.as_mut_ptr(), len: data.len(), borrow: PhantomData }
    }

    /// Elements `at..at + len`, bounds-checked.
    ///
    /// # Safety
    /// No other reference to these elements may be live while the returned slice is (each
    /// task asks only for rows of its own (b, h), and for each row once at a time).
    unsafe fn row(self, at: usize, len: usize) -> &'a mut [f32] {
        assert!(at + len <= self.len, "HeadRows: row out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(at), len)
    }
}

/// Writes the online softmax of every query tile of head `h` of batch entry `b` over all its
/// visible keys into the head's rows of `out`, and their log-sum-exp into `lse` `[Tq]`.
#[allow(clippy::too_many_arguments)]
fn forward_head(
    d: &AttentionDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    h: usize,
    out: HeadRows,
    lse: &mut [f32],
) {
    let dh = d.head_dim;
    let kt_len = dh * d.kv_seq;
    // Reused per thread, so a call allocates (and page-faults) nothing after the first.
    with_scratch(kt_len + Q_TILE * K_TILE + Q_TILE * dh, |scratch| {
        let (kt, rest) = scratch.split_at_mut(kt_len);
        let (scores, acc) = rest.split_at_mut(Q_TILE * K_TILE);
        d.transpose_head(k, b, h, kt);
        for i0 in (0..d.q_seq).step_by(Q_TILE) {
            let rows = Q_TILE.min(d.q_seq - i0);
            let acc = &mut acc[..rows * dh];
            // acc = Σ e^(score − max)·v, sum = Σ e^(score − max), both rescaled when max grows.
            let mut max = [f32::NEG_INFINITY; Q_TILE];
            let mut sum = [0.0f32; Q_TILE];
            let q_tile = d.rows(q, d.q_at(b, i0, h));
            let end = d.key_end(i0, rows);
            for s0 in (0..end).step_by(K_TILE) {
                let cols = K_TILE.min(end - s0);
                let scores = &mut scores[..rows * cols];
                tile_gemm(
                    scores,
                    cols,
                    q_tile,
                    d.kt_columns(kt, s0),
                    GemmDims { m: rows, n: cols, k: dh },
                    d.scale,
                    Store::Overwrite,
                );
                for (r, row) in scores.chunks_mut(cols).enumerate() {
                    let visible = d.visible_keys(i0 + r, s0, cols);
                    let new_max = max[r].max(row_max(&row[..visible]));
                    // The first tile always holds key 0, so new_max is finite and this is
                    // e^-∞ = 0 there (and acc, stale until then, is not read).
                    let correction = (max[r] - new_max).exp();
                    sum[r] = sum[r] * correction + exp_row(row, visible, new_max);
                    max[r] = new_max;
                    if s0 > 0 && correction != 1.0 {
                        acc[r * dh..][..dh].iter_mut().for_each(|a| *a *= correction);
                    }
                }
                tile_gemm(
                    acc,
                    dh,
                    dense(scores, cols),
                    d.kv_rows(v, b, s0, h),
                    GemmDims { m: rows, n: dh, k: cols },
                    1.0,
                    if s0 > 0 { Store::Accumulate } else { Store::Overwrite },
                );
            }
            for (r, acc_row) in acc.chunks(dh).enumerate() {
                // SAFETY: query row i0 + r of head h of batch entry b belongs to this task.
                let out_row = unsafe { out.row(d.q_at(b, i0 + r, h), dh) };
                out_row.iter_mut().zip(acc_row).for_each(|(o, &a)| *o = a / sum[r]);
                lse[i0 + r] = max[r] + sum[r].ln();
            }
        }
    });
}

/// The gradient tensors, written by the per-(b, h) tasks of the backward: every row once.
#[derive(Clone, Copy)]
struct Grads<'a> {
    dq: HeadRows<'a>,
    dk: HeadRows<'a>,
    dv: HeadRows<'a>,
}

/// FlashAttention-2 style backward of one (b, h): for each query tile and each visible key
/// tile, P = e^(S − lse), then dv += Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − δ), dq += scale·dS·K,
/// dk += scale·dSᵀ·Q in scratch tiles. A query tile's dq is written to the output when its
/// key tiles are done, the head's dk and dv at the end.
#[allow(clippy::too_many_arguments)]
fn backward_pair(
    d: &AttentionDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    b: usize,
    h: usize,
    grads: Grads,
) {
    let dh = d.head_dim;
    let (kv_len, tile) = (d.kv_seq * dh, Q_TILE * K_TILE);
    with_scratch(4 * kv_len + 2 * tile + Q_TILE * dh + d.q_seq, |scratch| {
        let (kt, rest) = scratch.split_at_mut(kv_len);
        let (vt, rest) = rest.split_at_mut(kv_len);
        let (dk_head, rest) = rest.split_at_mut(kv_len);
        let (dv_head, rest) = rest.split_at_mut(kv_len);
        let (p, rest) = rest.split_at_mut(tile);
        let (dp, rest) = rest.split_at_mut(tile);
        let (dq_tile, delta) = rest.split_at_mut(Q_TILE * dh);
        d.transpose_head(k, b, h, kt);
        d.transpose_head(v, b, h, vt);
        dk_head.fill(0.0);
        dv_head.fill(0.0);
        // δ_i = Σ_d dO_id·O_id = Σ_s P_is·dP_is, the softmax backward's row term.
        for (i, delta) in delta.iter_mut().enumerate() {
            *delta = dot(&dout[d.q_at(b, i, h)..][..dh], &out[d.q_at(b, i, h)..][..dh]);
        }
        let lse = &lse[(b * d.heads + h) * d.q_seq..][..d.q_seq];
        for i0 in (0..d.q_seq).step_by(Q_TILE) {
            let rows = Q_TILE.min(d.q_seq - i0);
            let (q_tile, do_tile) = (d.rows(q, d.q_at(b, i0, h)), d.rows(dout, d.q_at(b, i0, h)));
            // The same rows as right operands (for dK = dSᵀ·Q and dV = Pᵀ·dO).
            let q_rows = TileB { data: q, offset: q_tile.offset, row_stride: q_tile.row_stride };
            let do_rows = TileB { data: dout, offset: do_tile.offset, row_stride: do_tile.row_stride };
            let end = d.key_end(i0, rows);
            for s0 in (0..end).step_by(K_TILE) {
                let cols = K_TILE.min(end - s0);
                let (p, dp) = (&mut p[..rows * cols], &mut dp[..rows * cols]);
                tile_gemm(
                    p,
                    cols,
                    q_tile,
                    d.kt_columns(kt, s0),
                    GemmDims { m: rows, n: cols, k: dh },
                    d.scale,
                    Store::Overwrite,
                );
                for (r, row) in p.chunks_mut(cols).enumerate() {
                    exp_row(row, d.visible_keys(i0 + r, s0, cols), lse[i0 + r]);
                }
                // d/dV = Pᵀ·dO
                tile_gemm(
                    &mut dv_head[s0 * dh..],
                    dh,
                    transposed(p, cols),
                    do_rows,
                    GemmDims { m: cols, n: dh, k: rows },
                    1.0,
                    Store::Accumulate,
                );
                // d/dP = dO·Vᵀ;  d/dS = P ⊙ (dP − δ)
                tile_gemm(
                    dp,
                    cols,
                    do_tile,
                    d.kt_columns(vt, s0),
                    GemmDims { m: rows, n: cols, k: dh },
                    1.0,
                    Store::Overwrite,
                );
                for r in 0..rows {
                    let (pr, dpr) = (&p[r * cols..][..cols], &mut dp[r * cols..][..cols]);
                    softmax_grad_in_place(pr, dpr, delta[i0 + r]);
                }
                // d/dQ = scale·dS·K (the first key tile overwrites the stale dq tile);
                // d/dK = scale·dSᵀ·Q
                let (dq_tile, k_rows) = (&mut dq_tile[..rows * dh], d.kv_rows(k, b, s0, h));
                tile_gemm(
                    dq_tile,
                    dh,
                    dense(dp, cols),
                    k_rows,
                    GemmDims { m: rows, n: dh, k: cols },
                    d.scale,
                    if s0 > 0 { Store::Accumulate } else { Store::Overwrite },
                );
                tile_gemm(
                    &mut dk_head[s0 * dh..],
                    dh,
                    transposed(dp, cols),
                    q_rows,
                    GemmDims { m: cols, n: dh, k: rows },
                    d.scale,
                    Store::Accumulate,
                );
            }
            for (r, grad) in dq_tile[..rows * dh].chunks(dh).enumerate() {
                // SAFETY: query row i0 + r of head h of batch entry b belongs to this task.
                unsafe { grads.dq.row(d.q_at(b, i0 + r, h), dh) }.copy_from_slice(grad);
            }
        }
        for (s, (dk_row, dv_row)) in dk_head.chunks(dh).zip(dv_head.chunks(dh)).enumerate() {
            // SAFETY: key row s of head h of batch entry b belongs to this task, and dk and
            // dv are distinct tensors.
            let (dk, dv) = unsafe { (grads.dk.row(d.kv_at(b, s, h), dh), grads.dv.row(d.kv_at(b, s, h), dh)) };
            dk.copy_from_slice(dk_row);
            dv.copy_from_slice(dv_row);
        }
    });
}

/// Largest score of a row (−∞ when empty).
fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::row_max(row) };
    }
    slice_max(row)
}

/// row ← e^(row − shift) for the first `visible` keys and 0 for the masked rest (the future
/// keys of the causal mask); returns Σ row.
fn exp_row(row: &mut [f32], visible: usize, shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::avx512_available() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::exp_row(row, visible, shift) };
    }
    exp_row_portable(row, visible, shift)
}

/// [`exp_row`] with 8-lane vectors, for CPUs without AVX-512.
fn exp_row_portable(row: &mut [f32], visible: usize, shift: f32) -> f32 {
    row[visible..].fill(0.0);
    exp_in_place(&mut row[..visible], shift)
}

/// x ← e^(x − shift) in place; returns Σ x.
fn exp_in_place(x: &mut [f32], shift: f32) -> f32 {
    let simd_end = x.len() - x.len() % LANES;
    let mut acc = wide::f32x8::ZERO;
    for i in (0..simd_end).step_by(LANES) {
        let e = exp8(load(&x[i..]) - shift);
        store(e, &mut x[i..]);
        acc += e;
    }
    let mut total = acc.reduce_add();
    for v in &mut x[simd_end..] {
        *v = (*v - shift).exp();
        total += *v;
    }
    total
}

/// The score-row passes on sixteen lanes; a row's last partial vector uses masked loads and
/// stores, so rows of any length run without a scalar tail.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_mask_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_maskz_mov_ps,
        _mm512_max_ps, _mm512_reduce_add_ps, _mm512_reduce_max_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_sub_ps,
    };

    use super::super::simd16::{exp16, first_lanes, LANES};

    /// As `super::row_max`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn row_max(row: &[f32]) -> f32 {
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in (0..row.len()).step_by(LANES) {
            // Lanes past the row keep the running max.
            max = _mm512_max_ps(max, _mm512_mask_loadu_ps(max, first_lanes(row.len() - c), row.as_ptr().add(c)));
        }
        _mm512_reduce_max_ps(max)
    }

    /// As `super::exp_row`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_row(row: &mut [f32], visible: usize, shift: f32) -> f32 {
        let shift = _mm512_set1_ps(shift);
        let mut total = _mm512_setzero_ps();
        for c in (0..row.len()).step_by(LANES) {
            let at = row.as_mut_ptr().add(c);
            let (in_row, seen) = (first_lanes(row.len() - c), first_lanes(visible.saturating_sub(c)));
            let e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, at), shift)));
            _mm512_mask_storeu_ps(at, in_row, e);
            total = _mm512_add_ps(total, e);
        }
        _mm512_reduce_add_ps(total)
    }
}

/// dp ← p ⊙ (dp − δ).
fn softmax_grad_in_place(p: &[f32], dp: &mut [f32], delta: f32) {
    let simd_end = p.len() - p.len() % LANES;
    for i in (0..simd_end).step_by(LANES) {
        store(load(&p[i..]) * (load(&dp[i..]) - delta), &mut dp[i..]);
    }
    for (g, &pv) in dp[simd_end..].iter_mut().zip(&p[simd_end..]) {
        *g = pv * (*g - delta);
    }
}

/// A contiguous row-major buffer with `cols` columns as the left operand of a tile product.
fn dense(data: &[f32], cols: usize) -> TileA<'_> {
    TileA { data, offset: 0, row_stride: cols, col_stride: 1 }
}

/// The transpose of a contiguous row-major buffer with `cols` columns, as a left operand.
fn transposed(data: &[f32], cols: usize) -> TileA<'_> {
    TileA { data, offset: 0, row_stride: 1, col_stride: cols }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::oracle::{self, AttentionShape};
    use gradcheck::{assert_close, assert_within, gradient, Dtype, Tolerance};

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| (((i * 37 + seed * 101) % 61) as f32 / 61.0 - 0.5) * 2.0).collect()
    }

    #[derive(Clone, Copy, Debug)]
    struct Case {
        batch: usize,
        q_seq: usize,
        kv_seq: usize,
        heads: usize,
        head_dim: usize,
    }

    impl Case {
        fn inputs(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let q_len = self.batch * self.q_seq * self.heads * self.head_dim;
            let kv_len = self.batch * self.kv_seq * self.heads * self.head_dim;
            (values(q_len, 1), values(kv_len, 2), values(kv_len, 3))
        }

        fn scale(&self) -> f32 {
            1.0 / (self.head_dim as f32).sqrt()
        }

        fn dims(&self) -> AttentionDims {
            let Case { batch, q_seq, kv_seq, heads, head_dim } = *self;
            AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale: self.scale() }
        }

        fn forward(&self, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
            let mut out = vec![0.0; q.len()];
            let mut lse = vec![0.0; self.batch * self.heads * self.q_seq];
            causal_attention_forward(q, k, v, &self.dims(), &mut out, &mut lse);
            (out, lse)
        }

        /// Σ probe ⊙ attention(q, k, v) from the toolkit's f64 oracle.
        fn loss_f64(&self, q: &[f64], k: &[f64], v: &[f64], probe: &[f64]) -> f64 {
            let Case { batch, q_seq, kv_seq, heads, head_dim } = *self;
            let shape = AttentionShape { batch, q_seq, kv_seq, heads, head_dim };
            oracle::dot(&oracle::causal_attention(q, k, v, shape, self.scale() as f64), probe)
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_row_passes_match_portable() {
        if !crate::cpu::avx512_available() {
            eprintln!("skipping avx512_row_passes_match_portable: this CPU has no AVX-512F");
            return;
        }
        for len in [1, 7, 16, 17, 33, 64] {
            let row: Vec<f32> = values(len, len).iter().map(|x| 4.0 * x).collect();
            // SAFETY: the CPU has AVX-512F (checked above).
            assert_eq!(unsafe { avx512::row_max(&row) }, slice_max(&row));
            for visible in [0, 1, len / 2, len] {
                let (mut wide, mut narrow) = (row.clone(), row.clone());
                // SAFETY: as above.
                let wide_sum = unsafe { avx512::exp_row(&mut wide, visible, 0.5) };
                let narrow_sum = exp_row_portable(&mut narrow, visible, 0.5);
                assert!((wide_sum - narrow_sum).abs() <= 1e-6 * narrow_sum.max(1.0), "{len} {visible}");
                for (a, b) in wide.iter().zip(&narrow) {
                    assert!((a - b).abs() <= 1e-6 * b.abs(), "{len} {visible}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn forward_matches_reference() {
        let cases = [
            Case { batch: 2, q_seq: 70, kv_seq: 70, heads: 3, head_dim: 16 },
            Case { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 1 },
            Case { batch: 2, q_seq: 5, kv_seq: 133, heads: 2, head_dim: 12 },
            Case { batch: 1, q_seq: 1, kv_seq: 9, heads: 4, head_dim: 8 },
            Case { batch: 3, q_seq: 129, kv_seq: 200, heads: 2, head_dim: 7 },
        ];
        for c in cases {
            let (q, k, v) = c.inputs();
            let (out, lse) = c.forward(&q, &k, &v);
            let want = causal_attention_reference(&q, &k, &v, &c.dims());
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
            // lse of the last query of head 0, batch 0, recomputed directly.
            let i = c.q_seq - 1;
            let scores: Vec<f32> = (0..c.kv_seq)
                .map(|s| {
                    c.scale()
                        * (0..c.head_dim)
                            .map(|x| q[i * c.heads * c.head_dim + x] * k[s * c.heads * c.head_dim + x])
                            .sum::<f32>()
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want_lse = max + scores.iter().map(|s| (s - max).exp()).sum::<f32>().ln();
            assert!((lse[i] - want_lse).abs() < 1e-5);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for c in [
            Case { batch: 1, q_seq: 5, kv_seq: 5, heads: 2, head_dim: 3 },
            Case { batch: 2, q_seq: 3, kv_seq: 7, heads: 1, head_dim: 4 },
            // Three query tiles and two key tiles, the second key tile partly masked.
            Case { batch: 1, q_seq: 66, kv_seq: 140, heads: 1, head_dim: 2 },
        ] {
            let (q, k, v) = c.inputs();
            let (out, lse) = c.forward(&q, &k, &v);
            let probe = values(q.len(), 4);
            // Stale NaN contents: the overwriting backward must write every element.
            let (mut dq, mut dk, mut dv) = (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
            causal_attention_backward(&q, &k, &v, &out, &lse, &probe, &c.dims(), &mut dq, &mut dk, &mut dv);
            let (q64, k64, v64, probe64) =
                (oracle::widen(&q), oracle::widen(&k), oracle::widen(&v), oracle::widen(&probe));
            let tol = Dtype::F64.table().gradient;
            let numeric = gradient(&q64, Dtype::F64, |q| c.loss_f64(q, &k64, &v64, &probe64));
            assert_within(&format!("dq of {c:?}"), oracle::widen(&dq), numeric, tol);
            let numeric = gradient(&k64, Dtype::F64, |k| c.loss_f64(&q64, k, &v64, &probe64));
            assert_within(&format!("dk of {c:?}"), oracle::widen(&dk), numeric, tol);
            let numeric = gradient(&v64, Dtype::F64, |v| c.loss_f64(&q64, &k64, v, &probe64));
            assert_within(&format!("dv of {c:?}"), oracle::widen(&dv), numeric, tol);
            // The naive backward the bench checks against agrees.
            let (want_dq, want_dk, want_dv) = causal_attention_backward_reference(&q, &k, &v, &probe, &c.dims());
            assert_close("reference dq", &want_dq, &dq, Tolerance::uniform(1e-5));
            assert_close("reference dk", &want_dk, &dk, Tolerance::uniform(1e-5));
            assert_close("reference dv", &want_dv, &dv, Tolerance::uniform(1e-5));
        }
    }

    #[test]
    fn large_backward_overwrites_and_matches_small_tiles() {
        // Several tiles per head and enough work for the parallel path: batch entry 1 must get
        // the same gradients as when it is run alone, written over stale (NaN) buffers.
        let c = Case { batch: 2, q_seq: 150, kv_seq: 150, heads: 3, head_dim: 16 };
        let (q, k, v) = c.inputs();
        let (out, lse) = c.forward(&q, &k, &v);
        let dout = values(q.len(), 5);
        let grads = |q: &[f32], k: &[f32], v: &[f32], out: &[f32], lse: &[f32], dout: &[f32], batch: usize| {
            let (mut dq, mut dk, mut dv) = (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
            causal_attention_backward(
                q,
                k,
                v,
                out,
                lse,
                dout,
                &AttentionDims { batch, ..c.dims() },
                &mut dq,
                &mut dk,
                &mut dv,
            );
            (dq, dk, dv)
        };
        let (dq, dk, dv) = grads(&q, &k, &v, &out, &lse, &dout, 2);
        let half_q = q.len() / 2;
        let half_k = k.len() / 2;
        let half_lse = lse.len() / 2;
        let (dq1, dk1, dv1) =
            grads(&q[half_q..], &k[half_k..], &v[half_k..], &out[half_q..], &lse[half_lse..], &dout[half_q..], 1);
        let tol = Tolerance { atol: 1e-5, rtol: 0.0 };
        assert_close("dq", &dq[half_q..], &dq1, tol);
        assert_close("dk", &dk[half_k..], &dk1, tol);
        assert_close("dv", &dv[half_k..], &dv1, tol);
        assert!(dq.iter().chain(&dk).chain(&dv).all(|g| g.is_finite()));
    }
}
