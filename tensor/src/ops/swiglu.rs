//! SwiGLU gating `silu(gate) ⊙ up` in one pass (PyTorch `F.silu(gate) * up`), and its
//! backward, of two tensors or of the two halves of one (the gate and up projections as one
//! product, [`Tensor::packed_linear`]). The formulas, the kernel and its backward live in
//! `kernels::cpu::swiglu` (`kernels::cuda::swiglu` on the GPU).

use kernels::cpu::swiglu::{swiglu_backward, swiglu_forward, swiglu_halves_backward, swiglu_halves_forward};

use crate::{with_last_dim, Error, Result, Tensor};

impl Tensor {
    /// `silu(self) ⊙ up` elementwise, `self` being the gate. The shapes must be equal (no
    /// broadcasting: both operands are projections of the same rows).
    pub fn swiglu(&self, up: &Tensor) -> Result<Tensor> {
        self.same_device("swiglu", up)?;
        if self.shape != up.shape {
            return Err(Error::ShapeMismatch { op: "swiglu", lhs: self.shape.clone(), rhs: up.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::swiglu(self, up);
        }
        let (gate, up) = (self.contiguous()?, up.contiguous()?);
        let mut y = crate::pool::buffer(gate.numel());
        swiglu_forward(gate.as_slice()?, up.as_slice()?, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// The backward of [`Tensor::swiglu`]: `(d/dgate, d/dup)` for the output gradient `dy`,
    /// recomputing σ(gate) from the saved inputs (all three of one shape):
    /// `dgate = dy·up·σ(g)·(1 + g·(1 − σ(g)))`, `dup = dy·g·σ(g)`.
    pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "swiglu_backward";
        for t in [up, dy] {
            gate.same_device(OP, t)?;
            if t.shape != gate.shape {
                return Err(Error::ShapeMismatch { op: OP, lhs: gate.shape.clone(), rhs: t.shape.clone() });
            }
        }
        #[cfg(feature = "cuda")]
        if gate.cuda_storage().is_some() {
            return cuda::swiglu_backward(gate, up, dy);
        }
        let (g, u, dy) = (gate.contiguous()?, up.contiguous()?, dy.contiguous()?);
        let (mut dg, mut du) = (crate::pool::buffer(g.numel()), crate::pool::buffer(u.numel()));
        swiglu_backward(g.as_slice()?, u.as_slice()?, dy.as_slice()?, &mut dg, &mut du);
        Ok((Tensor::from_vec(dg, &g.shape)?, Tensor::from_vec(du, &u.shape)?))
    }
}

/// `cols`, the width of each half of `gate_up: [..., 2·cols]`, checked.
fn half_width(op: &'static str, gate_up: &Tensor) -> Result<usize> {
    match gate_up.shape.last() {
        Some(&width) if width > 0 && width.is_multiple_of(2) => Ok(width / 2),
        _ => Err(Error::InvalidShape {
            op,
            shape: gate_up.shape.clone(),
            reason: "the last dimension must hold two halves (gate, up) of equal width".into(),
        }),
    }
}

impl Tensor {
    /// SwiGLU of the two halves of the last dimension: `self: [..., 2F]`, the gate in the
    /// first `F` columns and up in the last `F` (the gate and up projections as one product,
    /// [`Tensor::packed_linear`]) → `[..., F]`, `silu(gate) ⊙ up`.
    pub fn swiglu_halves(&self) -> Result<Tensor> {
        let cols = half_width("swiglu_halves", self)?;
        let out_shape = with_last_dim(&self.shape, cols);
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::swiglu_halves(self, cols, &out_shape);
        }
        let gate_up = self.contiguous()?;
        let mut y = crate::pool::buffer(gate_up.numel() / 2);
        swiglu_halves_forward(gate_up.as_slice()?, cols, &mut y);
        Tensor::from_vec(y, &out_shape)
    }

    /// The backward of [`Tensor::swiglu_halves`]: the gradient of `gate_up: [..., 2F]` (the
    /// gate's in the first `F` columns, up's in the rest) for the output gradient `dy: [..., F]`.
    pub fn swiglu_halves_backward(gate_up: &Tensor, dy: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu_halves_backward";
        gate_up.same_device(OP, dy)?;
        let cols = half_width(OP, gate_up)?;
        let dy_shape = with_last_dim(&gate_up.shape, cols);
        if dy.shape != dy_shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: dy_shape, rhs: dy.shape.clone() });
        }
        #[cfg(feature = "cuda")]
        if gate_up.cuda_storage().is_some() {
            return cuda::swiglu_halves_backward(gate_up, dy, cols);
        }
        let (gate_up, dy) = (gate_up.contiguous()?, dy.contiguous()?);
        let mut d_gate_up = crate::pool::buffer(gate_up.numel());
        swiglu_halves_backward(gate_up.as_slice()?, dy.as_slice()?, cols, &mut d_gate_up);
        Tensor::from_vec(d_gate_up, &gate_up.shape)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/swiglu.rs`: SwiGLU gating `silu(g) ⊙ u` and its backward, of
    //! two tensors or of the halves of one.

    use kernels::cuda::swiglu as launch;
    use kernels::cuda::Values;

    use crate::cuda::{product_only_output, product_only_storage};
    use crate::{Result, Tensor};

    /// `silu(gate) ⊙ up`, both of one shape.
    pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu";
        let dev = gate.cuda_device(OP)?;
        let (gate, up) = (gate.dense()?, up.dense()?);
        // The result feeds only the FFN's down projection: bf16 alone under bf16 products.
        product_only_output(&dev, OP, gate.shape(), |y| {
            Ok(launch::swiglu_forward(&dev, gate.cuda_f32(OP)?, up.cuda_f32(OP)?, (y, None))?)
        })
    }

    /// `(d/dgate, d/dup)` of `silu(gate) ⊙ up` for the output gradient `dy` (one shape).
    pub(crate) fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "swiglu_backward";
        let dev = gate.cuda_device(OP)?;
        let (gate, up, dy) = (gate.dense()?, up.dense()?, dy.dense()?);
        let (gate_values, up_values, dy) = (gate.cuda_f32(OP)?, up.cuda_f32(OP)?, dy.cuda_f32(OP)?);
        // Both feed the gate and up projections' backward products: bf16 alone under bf16.
        let mut dgate = product_only_storage(&dev, gate.numel())?;
        let mut dup = product_only_storage(&dev, up.numel())?;
        launch::swiglu_backward(&dev, gate_values, up_values, dy, dgate.values_mut(OP)?, dup.values_mut(OP)?)?;
        Ok((Tensor::from_cuda(dgate, gate.shape())?, Tensor::from_cuda(dup, up.shape())?))
    }

    /// SwiGLU of the halves of `gate_up: [..., 2·cols]` into `[..., cols]` (`out_shape`).
    pub(crate) fn swiglu_halves(gate_up: &Tensor, cols: usize, out_shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "swiglu_halves";
        let dev = gate_up.cuda_device(OP)?;
        let gate_up = gate_up.dense()?;
        // The result feeds only the FFN's down projection: bf16 alone under bf16 products.
        product_only_output(&dev, OP, out_shape, |y| {
            Ok(launch::swiglu_halves_forward(&dev, gate_up.cuda_values(OP)?, cols, (y, None))?)
        })
    }

    /// The gradient of `gate_up: [..., 2·cols]` for the output gradient `dy: [..., cols]`.
    pub(crate) fn swiglu_halves_backward(gate_up: &Tensor, dy: &Tensor, cols: usize) -> Result<Tensor> {
        const OP: &str = "swiglu_halves_backward";
        let dev = gate_up.cuda_device(OP)?;
        let (gate_up, dy) = (gate_up.dense()?, dy.dense()?);
        // It feeds the gate and up product's backward (or the fused gate's, which reads bf16
        // too): bf16 alone under bf16 products.
        product_only_output(&dev, OP, gate_up.shape(), |d| {
            let gate_up = gate_up.cuda_values(OP)?;
            // dy as held (bf16 alone from the down product's backward) beside bf16 gate and up.
            let dy = if gate_up.is_bf16() { dy.cuda_values(OP)? } else { Values::F32(dy.cuda_f32(OP)?) };
            Ok(launch::swiglu_halves_backward(&dev, gate_up, dy, cols, d)?)
        })
    }
}
