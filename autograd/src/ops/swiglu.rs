//! SwiGLU gating `silu(g) ⊙ u` as one graph node (formulas in `kernels::cpu::swiglu`), and
//! the composite of unfused ops it must agree with. The fused op saves only its inputs `g`
//! and `u`: the backward ([`Tensor::swiglu_backward`], on either device) recomputes σ(g),
//! where the composite also keeps `silu(g)`, one more buffer of the FFN's hidden size.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `silu(self) ⊙ up` (PyTorch `F.silu(gate) * up`), `self` being the gate; the shapes
    /// must be equal. Agrees with [`Var::swiglu_reference`] to float tolerance, forward and
    /// backward.
    pub fn swiglu(&self, up: &Var) -> Result<Var> {
        let (g, u) = (self.value().contiguous()?, up.value().contiguous()?);
        let y = g.swiglu(&u)?;
        Ok(Var::from_op(y, vec![self.clone(), up.clone()], move |dy| {
            // d/dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),  d/du = dy·g·σ(g)
            let (dg, du) = Tensor::swiglu_backward(&g, &u, dy)?;
            Ok(vec![dg, du])
        }))
    }

    /// SwiGLU of the two halves of the last dimension: `self: [..., 2F]` with the gate in the
    /// first `F` columns and up in the last `F` (the gate and up projections as one product,
    /// [`Var::packed_linear`]) → `[..., F]`. Agrees with [`Var::swiglu_halves_reference`].
    pub fn swiglu_halves(&self) -> Result<Var> {
        let gate_up = self.value().contiguous()?;
        let y = gate_up.swiglu_halves()?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::swiglu_halves_backward(&gate_up, dy)?])))
    }

    /// [`Var::swiglu_halves`] from the halves as views and [`Var::swiglu`]: its reference.
    pub fn swiglu_halves_reference(&self) -> Result<Var> {
        let (axis, width) = (self.shape().len() - 1, self.shape().last().copied().unwrap_or(0));
        self.narrow(axis, 0, width / 2)?.swiglu(&self.narrow(axis, width / 2, width / 2)?)
    }

    /// The same gating composed from unfused ops, `self.silu()?.mul(up)`: the reference
    /// [`Var::swiglu`] is tested against (it also broadcasts, which `swiglu` does not).
    pub fn swiglu_reference(&self, up: &Var) -> Result<Var> {
        self.silu()?.mul(up)
    }
}
