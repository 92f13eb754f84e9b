//! Causal scaled-dot-product attention as one op (flash-attention style): the forward
//! saves q, k, v, the output and the per-query log-sum-exp; backward
//! (`Tensor::causal_attention_backward`) recomputes the probabilities tile by tile instead
//! of storing a T×T matrix.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `softmax(q·kᵀ·scale + causal mask)·v` for `q: [B, Tq, H, D]`, `k, v: [B, Tk, H, D]`
    /// (PyTorch `F.scaled_dot_product_attention(..., is_causal=True)` in [B, T, H, D] layout).
    pub fn causal_attention(q: &Var, k: &Var, v: &Var, scale: f32) -> Result<Var> {
        let (qt, kt, vt) = (q.value().contiguous()?, k.value().contiguous()?, v.value().contiguous()?);
        let (out, lse) = Tensor::causal_attention(&qt, &kt, &vt, scale)?;
        let saved_out = out.clone();
        Ok(Var::from_op(out, vec![q.clone(), k.clone(), v.clone()], move |dout| {
            // d/dq = dS·k·scale, d/dk = dSᵀ·q·scale, d/dv = Pᵀ·dout, dS = P ⊙ (dP − rowsum(dout⊙out))
            let (dq, dk, dv) = Tensor::causal_attention_backward(&qt, &kt, &vt, &saved_out, &lse, dout, scale)?;
            Ok(vec![dq, dk, dv])
        }))
    }

    /// [`Var::causal_attention`] of `q` and `k` rotated by RoPE (token t at position t, base
    /// `theta`; [`Var::rope`]), LLaMA's attention as one op: both rotations run in one launch
    /// on a GPU, forward and backward (`Tensor::rope_pair`), and saved for the backward.
    pub fn rotary_causal_attention(q: &Var, k: &Var, v: &Var, scale: f32, theta: f32) -> Result<Var> {
        let (qr, kr) = Tensor::rope_pair(&q.value_ref(), &k.value_ref(), theta, 0)?;
        let vt = v.value().contiguous()?;
        let (out, lse) = Tensor::causal_attention(&qr, &kr, &vt, scale)?;
        let saved_out = out.clone();
        Ok(Var::from_op(out, vec![q.clone(), k.clone(), v.clone()], move |dout| {
            let (dqr, dkr, dv) = Tensor::causal_attention_backward(&qr, &kr, &vt, &saved_out, &lse, dout, scale)?;
            // d/dx of a rotation is the inverse rotation.
            let (dq, dk) = Tensor::rope_pair_backward(&dqr, &dkr, theta, 0)?;
            Ok(vec![dq, dk, dv])
        }))
    }

    /// [`Var::rotary_causal_attention`] of the packed QKV product `qkv: [B, T, 3·H·D]` (each
    /// token's q, k and v side by side: one GEMM of the stacked weights, [`Var::packed_linear`])
    /// with `heads` heads; returns `[B, T, H, D]`. On a GPU's tensor cores under bf16 products
    /// the attention kernels read the packed product and rotate q and k as they load them,
    /// forward and backward, so RoPE takes no launch; elsewhere the rotations and the move of
    /// v out of the packed rows are one launch each way on a GPU
    /// ([`Tensor::rotary_attention_packed`]).
    pub fn rotary_causal_attention_packed(qkv: &Var, heads: usize, scale: f32, theta: f32) -> Result<Var> {
        let attention = Tensor::rotary_attention_packed(&qkv.value_ref(), heads, scale, theta)?;
        let out = attention.out.clone();
        // d/dx of a rotation is the inverse rotation; dv goes back into its third of each row.
        Ok(Var::from_op(out, vec![qkv.clone()], move |dout| Ok(vec![attention.backward(dout)?])))
    }
}
