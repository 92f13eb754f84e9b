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
}
