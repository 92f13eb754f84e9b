//! Several bias-free linear projections of one input as one differentiable op (LLaMA's gate
//! and up projections, whose SwiGLU reads the two halves of each row: [`Var::swiglu_halves`]),
//! and the composite of plain ops it must agree with. Forward and backward are tensor-level
//! functions ([`Tensor::packed_linear`], [`Tensor::packed_linear_backward`]): on a GPU under
//! bf16 products, one GEMM over the weights' packed bf16 copy forward, and one for the input
//! gradient.

use tensor::ops::ProductOutput;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `self: [..., in]` projected by each of `weights` (`[out_i, in]`), the results side by
    /// side along the last dimension: `[..., Σ out_i]`, stored as `output` says
    /// ([`Tensor::packed_linear`]). Agrees with [`Var::packed_linear_reference`] to float
    /// tolerance, forward and backward.
    pub fn packed_linear(&self, weights: &[&Var], output: ProductOutput) -> Result<Var> {
        let values: Vec<Tensor> = weights.iter().map(|w| w.value()).collect();
        let x = self.value().contiguous()?;
        let y = x.packed_linear(&values.iter().collect::<Vec<_>>(), output)?;
        // The backward reads x only as a product operand: under bf16 products, its bf16 copy.
        let x = x.saved_for_products();
        let inputs = [vec![self.clone()], weights.iter().map(|&w| w.clone()).collect()].concat();
        // dx = dy·[W_1; …; W_k] (added onto x's gradient so far: the q, k, v projections and
        // the residual read the same normalised input), dW_i = dy_iᵀ·x.
        Ok(Var::from_op_absorbing(y, inputs, move |dy, dx_so_far| {
            Tensor::packed_linear_backward(&x, &values.iter().collect::<Vec<_>>(), dy, dx_so_far)
        }))
    }

    /// The same projections composed from plain ops (one matmul each, joined along the last
    /// dimension): the reference [`Var::packed_linear`] is tested against.
    pub fn packed_linear_reference(&self, weights: &[&Var]) -> Result<Var> {
        let parts: Vec<Var> = weights.iter().map(|w| self.matmul(&w.transpose(0, 1)?)).collect::<Result<_>>()?;
        Var::cat(&parts.iter().collect::<Vec<_>>(), self.shape().len() - 1)
    }
}
