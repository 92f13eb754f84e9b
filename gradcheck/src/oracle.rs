//! Reference forwards in f64, straight from their definitions (SPEC §6 and the papers the
//! kernels cite), for the kernels' gradient checks and the mutation tests. Layouts match
//! the kernels: row-major, rows of `cols`, attention in `[B, T, H, D]`.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, PI};

/// f32 values widened to f64.
pub fn widen(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&v| f64::from(v)).collect()
}

/// `Σ aᵢ·bᵢ` (the scalar loss `L = Σ probe ⊙ y` every check reduces to).
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `erfc(x)` to ~1e-13 relative: the Taylor series of erf below |x| = 3, Lentz's continued
/// fraction beyond.
pub fn erfc(x: f64) -> f64 {
    let a = x.abs();
    let tail = if a < 3.0 {
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while term.abs() > 1e-17 {
            n += 1.0;
            term *= -a * a / n;
            sum += term / (2.0 * n + 1.0);
        }
        1.0 - sum * FRAC_2_SQRT_PI
    } else {
        let mut fraction = a;
        for k in (1..=60).rev() {
            fraction = a + (k as f64 / 2.0) / fraction;
        }
        (-a * a).exp() / (fraction * PI.sqrt())
    };
    if x >= 0.0 {
        tail
    } else {
        2.0 - tail
    }
}

/// `σ(x) = 1 / (1 + e^{−x})`.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `SiLU(x) = x·σ(x)`.
pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// Exact GELU, `x·Φ(x) = ½·x·erfc(−x/√2)` (Hendrycks & Gimpel 2016, eq. 1).
pub fn gelu(x: f64) -> f64 {
    0.5 * x * erfc(-x * FRAC_1_SQRT_2)
}

/// The tanh approximation `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
pub fn gelu_tanh(x: f64) -> f64 {
    let k = FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

/// `SwiGLU(g, u) = SiLU(g)·u` elementwise.
pub fn swiglu(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

/// Softmax of each row of `cols`, max-subtracted.
pub fn softmax(x: &[f64], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = row.iter().map(|v| (v - max).exp()).sum();
            row.iter().map(move |v| (v - max).exp() / total)
        })
        .collect()
}

/// `log softmax` of each row of `cols`: `x − logsumexp(row)`.
pub fn log_softmax(x: &[f64], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let lse = logsumexp(row);
            row.iter().map(move |v| v - lse)
        })
        .collect()
}

/// `log Σ e^x` of one row, max-subtracted.
pub fn logsumexp(row: &[f64]) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
}

/// Cross-entropy of each row of `cols` logits against its target: `logsumexp − x[t]`.
pub fn cross_entropy(logits: &[f64], cols: usize, targets: &[u32]) -> Vec<f64> {
    logits.chunks(cols).zip(targets).map(|(row, &t)| logsumexp(row) - row[t as usize]).collect()
}

/// RMSNorm of each row of `cols`: `x / √(mean(x²) + eps) ⊙ w` (Zhang & Sennrich 2019).
pub fn rms_norm(x: &[f64], weight: &[f64], cols: usize, eps: f64) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
            row.iter().zip(weight).map(move |(v, w)| v * rstd * w)
        })
        .collect()
}

/// LayerNorm of each row of `cols` with the biased variance: `(x − μ)/√(σ² + eps) ⊙ w + b`.
pub fn layer_norm(x: &[f64], weight: &[f64], bias: &[f64], cols: usize, eps: f64) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let mean = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            row.iter().zip(weight).zip(bias).map(move |((v, w), b)| (v - mean) * rstd * w + b)
        })
        .collect()
}

/// `A·B` for row-major `A: [m, k]`, `B: [k, n]`.
pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                out[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    out
}

/// Rotary position embedding, Hugging Face's rotate-half layout (Su et al. 2021, eq. 34):
/// row `r` of `x: [B, T, H, D]` sits at position `(r / heads) % seq + offset` and pairs
/// element `i` with `i + D/2`; `cos`, `sin` are `[positions, D/2]` tables.
pub fn rope(x: &[f64], cos: &[f64], sin: &[f64], seq: usize, heads: usize, head_dim: usize, offset: usize) -> Vec<f64> {
    let half = head_dim / 2;
    let mut y = vec![0.0; x.len()];
    for (row, (xh, yh)) in x.chunks(head_dim).zip(y.chunks_mut(head_dim)).enumerate() {
        let table = ((row / heads) % seq + offset) * half;
        for i in 0..half {
            let (c, s) = (cos[table + i], sin[table + i]);
            yh[i] = xh[i] * c - xh[i + half] * s;
            yh[i + half] = xh[i + half] * c + xh[i] * s;
        }
    }
    y
}

/// The shape of a causal attention call: `q: [batch, q_seq, heads, head_dim]`,
/// `k, v: [batch, kv_seq, heads, head_dim]`; query `i` sits at position `i + kv_seq − q_seq`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// `B`.
    pub batch: usize,
    /// Queries per sequence.
    pub q_seq: usize,
    /// Keys per sequence (≥ `q_seq`).
    pub kv_seq: usize,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub head_dim: usize,
}

/// `softmax(q·kᵀ·scale + causal mask)·v` per batch entry and head, in `[B, T, H, D]`.
pub fn causal_attention(q: &[f64], k: &[f64], v: &[f64], shape: AttentionShape, scale: f64) -> Vec<f64> {
    let AttentionShape { batch, q_seq, kv_seq, heads, head_dim } = shape;
    let offset = kv_seq - q_seq;
    let q_at = |b: usize, i: usize, h: usize| ((b * q_seq + i) * heads + h) * head_dim;
    let kv_at = |b: usize, s: usize, h: usize| ((b * kv_seq + s) * heads + h) * head_dim;
    let mut out = vec![0.0; q.len()];
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..q_seq {
                let scores: Vec<f64> = (0..=i + offset)
                    .map(|s| scale * dot(&q[q_at(b, i, h)..][..head_dim], &k[kv_at(b, s, h)..][..head_dim]))
                    .collect();
                let weights = softmax(&scores, scores.len());
                for (s, p) in weights.iter().enumerate() {
                    for x in 0..head_dim {
                        out[q_at(b, i, h) + x] += p * v[kv_at(b, s, h) + x];
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // erfc(1) and Φ(1) from tables.
        assert!((erfc(1.0) - 0.157_299_207_050_285_1).abs() < 1e-14);
        assert!((gelu(1.0) - 0.841_344_746_068_542_9).abs() < 1e-13);
        assert!((erfc(4.0) - 1.541_725_790_028_002e-8).abs() < 1e-20);
        assert!((gelu_tanh(1.0) - gelu(1.0)).abs() < 2e-4);
        let s = softmax(&[1.0, 2.0, 3.0], 3);
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-15 && s[2] > s[1]);
        let ce = cross_entropy(&[0.0, 0.0], 2, &[1]);
        assert!((ce[0] - 2f64.ln()).abs() < 1e-15);
        assert_eq!(matmul(&[1.0, 2.0], &[3.0, 4.0], 1, 2, 1), vec![11.0]);
    }

    #[test]
    fn attention_of_one_key_returns_its_value() {
        let shape = AttentionShape { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 2 };
        assert_eq!(causal_attention(&[1.0, 2.0], &[3.0, 4.0], &[5.0, 6.0], shape, 0.5), vec![5.0, 6.0]);
    }
}
