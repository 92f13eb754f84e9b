//! SwiGLU gating `silu(gate) ⊙ up` in one pass (PyTorch `F.silu(gate) * up`), and its
//! backward. The formulas, the kernel and its backward live in `kernels::cpu::swiglu`
//! (`kernels::cuda::swiglu` on the GPU).

use kernels::cpu::swiglu::{swiglu_backward, swiglu_forward};

use crate::{Error, Result, Tensor};

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

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/swiglu.rs`: SwiGLU gating `silu(g) ⊙ u` and its backward.

    use kernels::cuda::swiglu as launch;

    use crate::cuda::{product_input_buffers, product_input_output, CudaStorage};
    use crate::{Result, Tensor};

    /// `silu(gate) ⊙ up`, both of one shape.
    pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu";
        let dev = gate.cuda_device(OP)?;
        let (gate, up) = (gate.dense()?, up.dense()?);
        // The result feeds the FFN's down projection: with bf16 products, written in bf16 too.
        product_input_output(&dev, OP, gate.shape(), |y, y_bf16| {
            Ok(launch::swiglu_forward(&dev, gate.cuda_f32(OP)?, up.cuda_f32(OP)?, y, y_bf16)?)
        })
    }

    /// `(d/dgate, d/dup)` of `silu(gate) ⊙ up` for the output gradient `dy` (one shape).
    pub(crate) fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "swiglu_backward";
        let dev = gate.cuda_device(OP)?;
        let (gate, up, dy) = (gate.dense()?, up.dense()?, dy.dense()?);
        let (mut dgate, mut dup) = (CudaStorage::alloc(&dev, gate.numel())?, CudaStorage::alloc(&dev, up.numel())?);
        // Both feed the gate and up projections' backward products: in bf16 too under bf16.
        let ((dg, dg_bf16), (du, du_bf16)) =
            (product_input_buffers(&mut dgate, OP)?, product_input_buffers(&mut dup, OP)?);
        let (gate_values, up_values, dy) = (gate.cuda_f32(OP)?, up.cuda_f32(OP)?, dy.cuda_f32(OP)?);
        launch::swiglu_backward(&dev, gate_values, up_values, dy, dg, du, (dg_bf16, du_bf16))?;
        Ok((Tensor::from_cuda(dgate, gate.shape())?, Tensor::from_cuda(dup, up.shape())?))
    }
}
