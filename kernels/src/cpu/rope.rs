//! Rotary position embedding (Su et al. 2021, RoFormer eq. 34), in the Hugging Face LLaMA
//! "rotate_half" layout: within a head of `D` dims, element `i < D/2` pairs with `i + D/2`,
//! and the pair at position `p` is rotated by the angle `p · θ^(−2i/D)`:
//!
//! ```text
//! y[i]       = x[i]·cos − x[i + D/2]·sin
//! y[i + D/2] = x[i + D/2]·cos + x[i]·sin
//! ```
//!
//! PyTorch equivalent: `q * cos + rotate_half(q) * sin` from `transformers`'
//! `apply_rotary_pos_emb`. Nothing is saved: the backward applies the inverse rotation
//! (`Rᵀ`, the same with −sin) and writes it into `dx` (gradients are written, not added: the
//! crate's contract, see `lib.rs`).
//!
//! Layout legend: `B` batch, `T` sequence, `H` heads, `D` head dim.

use super::parallel;
use super::simd::{load, store, LANES};

/// Sizes of one rotation, shared by the CPU and CUDA kernels (`cuda::rope` takes the same
/// struct): `x` is `[B, T, H, D]` with `D` even, and token t reads table row `pos_offset + t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// `B`: sequences.
    pub batch: usize,
    /// `T`: tokens per sequence.
    pub seq: usize,
    /// `H`: heads.
    pub heads: usize,
    /// `D`: dims per head (even: element `i` pairs with `i + D/2`).
    pub head_dim: usize,
    /// Position of token 0 (nonzero when decoding after a KV cache).
    pub pos_offset: usize,
}

impl RopeDims {
    /// Elements of `x` (and of the output).
    pub fn len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// True when there is nothing to rotate.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether an `input` and `output` of these lengths and tables (`cos`, `sin` lengths)
    /// fit these sizes; the error says what does not.
    pub fn check(&self, input: usize, output: usize, table: (usize, usize)) -> Result<(), String> {
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even", self.head_dim));
        }
        if input != self.len() || output != input {
            return Err(format!(
                "input and output have {input} and {output} elements, [B, T, H, D] needs {}",
                self.len()
            ));
        }
        let needed = (self.pos_offset + self.seq) * self.head_dim / 2;
        if table.0 < needed || table.1 < needed {
            return Err(format!("cos/sin tables of {} and {} values, pos_offset + T needs {needed}", table.0, table.1));
        }
        Ok(())
    }

    /// Panics naming `op` unless [`RopeDims::check`] accepts the operands.
    fn assert_fits(&self, op: &str, input: &[f32], output: &[f32], cos: &[f32], sin: &[f32]) {
        if let Err(message) = self.check(input.len(), output.len(), (cos.len(), sin.len())) {
            panic!("{op}: {message}");
        }
    }
}

/// cos and sin tables, each [max_seq, D/2] row-major.
pub fn rope_table(max_seq: usize, head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    assert!(head_dim.is_multiple_of(2), "rope_table: head_dim must be even");
    let half = head_dim / 2;
    // Angles in f64: at position 10⁴ an f32 product would already be off by ~1e-3 rad.
    let inv_freq: Vec<f64> = (0..half).map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64)).collect();
    let mut cos = Vec::with_capacity(max_seq * half);
    let mut sin = Vec::with_capacity(max_seq * half);
    for p in 0..max_seq {
        for &f in &inv_freq {
            let (s, c) = (p as f64 * f).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    (cos, sin)
}

/// x, y: [B, T, H, D] contiguous; token t uses table row pos_offset + t.
pub fn rope_forward(x: &[f32], cos: &[f32], sin: &[f32], dims: &RopeDims, y: &mut [f32]) {
    dims.assert_fits("rope_forward", x, y, cos, sin);
    rotate(x, cos, sin, dims, 1.0, y);
}

/// dx = Rᵀ dy (the inverse rotation).
pub fn rope_backward(dy: &[f32], cos: &[f32], sin: &[f32], dims: &RopeDims, dx: &mut [f32]) {
    dims.assert_fits("rope_backward", dy, dx, cos, sin);
    // d/dx (R x) = Rᵀ: the rotation by −angle.
    rotate(dy, cos, sin, dims, -1.0, dx);
}

/// Scalar reference forward (tests and benches).
pub fn rope_reference(x: &[f32], cos: &[f32], sin: &[f32], dims: &RopeDims) -> Vec<f32> {
    let RopeDims { seq, heads, head_dim, pos_offset, .. } = *dims;
    let half = head_dim / 2;
    let mut y = vec![0.0; x.len()];
    for (row, (xh, yh)) in x.chunks(head_dim).zip(y.chunks_mut(head_dim)).enumerate() {
        let t = row / heads % seq;
        let table = (pos_offset + t) * half;
        for i in 0..half {
            let (c, s) = (cos[table + i], sin[table + i]);
            yh[i] = xh[i] * c - xh[i + half] * s;
            yh[i + half] = xh[i + half] * c + xh[i] * s;
        }
    }
    y
}

/// Rotates every head of `x` by `sign`·angle into `out`, one `[H, D]` token per row, in
/// parallel over tokens.
fn rotate(x: &[f32], cos: &[f32], sin: &[f32], dims: &RopeDims, sign: f32, out: &mut [f32]) {
    let RopeDims { seq, heads, head_dim, pos_offset, .. } = *dims;
    let half = head_dim / 2;
    let token = heads * head_dim;
    parallel::for_each_row_block_mut(out, token, token * 2, |first, block| {
        for (i, out_token) in block.chunks_mut(token).enumerate() {
            let t = (first + i) % seq;
            let c = &cos[(pos_offset + t) * half..][..half];
            let s = &sin[(pos_offset + t) * half..][..half];
            let x_token = &x[(first + i) * token..][..token];
            for (xh, oh) in x_token.chunks(head_dim).zip(out_token.chunks_mut(head_dim)) {
                rotate_head(xh, c, s, sign, oh);
            }
        }
    });
}

fn rotate_head(x: &[f32], cos: &[f32], sin: &[f32], sign: f32, out: &mut [f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = out.split_at_mut(half);
    let simd_end = half - half % LANES;
    for i in (0..simd_end).step_by(LANES) {
        let (c, s) = (load(&cos[i..]), load(&sin[i..]) * sign);
        let (a, b) = (load(&x1[i..]), load(&x2[i..]));
        store(a * c - b * s, &mut o1[i..]);
        store(b * c + a * s, &mut o2[i..]);
    }
    for i in simd_end..half {
        let (c, s) = (cos[i], sin[i] * sign);
        o1[i] = x1[i] * c - x2[i] * s;
        o2[i] = x2[i] * c + x1[i] * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradcheck::{check_gradient, oracle};
    use proptest::prelude::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 13 + seed * 7) % 19) as f32 * 0.2 - 1.8).collect()
    }

    #[test]
    fn table_matches_hugging_face_definition() {
        let (cos, sin) = rope_table(5, 8, 10000.0);
        // Row p, column i: angle p / 10000^(2i/8).
        let angle = 3.0f64 / 10000f64.powf(2.0 * 2.0 / 8.0);
        assert!((cos[3 * 4 + 2] as f64 - angle.cos()).abs() < 1e-7);
        assert!((sin[3 * 4 + 2] as f64 - angle.sin()).abs() < 1e-7);
        assert_eq!((cos[0], sin[0]), (1.0, 0.0));
    }

    proptest! {
        #[test]
        fn forward_matches_reference_and_backward_inverts(
            batch in 1usize..3,
            seq in 1usize..5,
            heads in 1usize..4,
            half in 1usize..21,
            pos_offset in 0usize..3,
        ) {
            let head_dim = 2 * half;
            let (cos, sin) = rope_table(seq + pos_offset, head_dim, 10000.0);
            let x = values(batch * seq * heads * head_dim, 1);
            let mut y = vec![0.0; x.len()];
            let dims = RopeDims { batch, seq, heads, head_dim, pos_offset };
            rope_forward(&x, &cos, &sin, &dims, &mut y);
            let want = rope_reference(&x, &cos, &sin, &dims);
            prop_assert!(y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6));
            // Rᵀ R = I, written over the stale (NaN) contents of dx.
            let mut back = vec![f32::NAN; x.len()];
            rope_backward(&y, &cos, &sin, &dims, &mut back);
            prop_assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5));
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (batch, seq, heads, head_dim, offset) = (1, 3, 2, 18, 1);
        let (cos, sin) = rope_table(seq + offset, head_dim, 500.0);
        let x = values(batch * seq * heads * head_dim, 2);
        let probe = values(x.len(), 3);
        let mut dx = vec![f32::NAN; x.len()];
        rope_backward(&probe, &cos, &sin, &RopeDims { batch, seq, heads, head_dim, pos_offset: offset }, &mut dx);
        // L = Σ probe ⊙ R x with the rotation applied in f64 from the f32 table.
        let (cos64, sin64, probe64) = (oracle::widen(&cos), oracle::widen(&sin), oracle::widen(&probe));
        let loss = |x: &[f64]| oracle::dot(&oracle::rope(x, &cos64, &sin64, seq, heads, head_dim, offset), &probe64);
        check_gradient("d rope", &dx, &oracle::widen(&x), loss);
    }

    #[test]
    fn many_tokens_run_in_parallel() {
        let (batch, seq, heads, head_dim) = (4, 300, 4, 64);
        let (cos, sin) = rope_table(seq, head_dim, 10000.0);
        let x = values(batch * seq * heads * head_dim, 4);
        let mut y = vec![0.0; x.len()];
        let dims = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
        rope_forward(&x, &cos, &sin, &dims, &mut y);
        let want = rope_reference(&x, &cos, &sin, &dims);
        assert!(y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6));
    }
}
