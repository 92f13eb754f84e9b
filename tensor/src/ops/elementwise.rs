//! Elementwise ops: unary functions, broadcasting binary ops, scalar ops and `select`.

use std::sync::Arc;

use kernels::cpu::binary::{add_assign, binary_forward, scalar_forward, select, Binary};
use kernels::cpu::unary::{unary_backward, unary_forward, Unary};

use crate::shape::broadcast_shapes;
use crate::{Error, Result, Storage, Tensor};

impl Tensor {
    /// Applies `op` elementwise (PyTorch `torch.exp`, `torch.sigmoid`, ...).
    pub fn unary(&self, op: Unary) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::unary(self, op);
        }
        let x = self.contiguous()?;
        let mut y = crate::pool::buffer(x.numel());
        unary_forward(op, x.as_slice()?, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// `dy · f'(x)` for `y = f(x)`: the backward of [`Tensor::unary`], from its saved input
    /// and output (all three of one shape).
    pub fn unary_backward(op: Unary, x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        for t in [y, dy] {
            x.same_device("unary_backward", t)?;
            if t.shape != x.shape {
                return Err(Error::ShapeMismatch { op: "unary_backward", lhs: x.shape.clone(), rhs: t.shape.clone() });
            }
        }
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            return cuda::unary_backward(op, x, y, dy);
        }
        let (x, y, dy) = (x.contiguous()?, y.contiguous()?, dy.contiguous()?);
        let mut dx = crate::pool::buffer(x.numel());
        unary_backward(op, x.as_slice()?, y.as_slice()?, dy.as_slice()?, &mut dx);
        Tensor::from_vec(dx, &x.shape)
    }

    /// `self op rhs` with NumPy broadcasting.
    pub fn binary(&self, rhs: &Tensor, op: Binary) -> Result<Tensor> {
        self.same_device(op_name(op), rhs)?;
        let shape = broadcast_shapes(op_name(op), &self.shape, &rhs.shape)?;
        let (a, b) = (self.expand(&shape)?, rhs.expand(&shape)?);
        #[cfg(feature = "cuda")]
        if a.cuda_storage().is_some() {
            return cuda::binary(&a, &b, op, &shape);
        }
        let mut out = crate::pool::buffer(shape.iter().product());
        binary_forward(
            op,
            a.f32_storage(op_name(op))?,
            a.offset,
            &a.strides,
            b.f32_storage(op_name(op))?,
            b.offset,
            &b.strides,
            &shape,
            &mut out,
        );
        Tensor::from_vec(out, &shape)
    }

    /// `self op s` for a scalar `s`.
    pub fn scalar_op(&self, op: Binary, s: f32) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            return cuda::scalar_op(self, op, s);
        }
        let x = self.contiguous()?;
        let mut y = crate::pool::buffer(x.numel());
        scalar_forward(op, x.as_slice()?, s, &mut y);
        Tensor::from_vec(y, &self.shape)
    }

    /// Elementwise sum with broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, Binary::Add)
    }

    /// `self + rhs` for gradient accumulation: when the shapes match, the sum is written in
    /// place into whichever operand is the only owner of a contiguous buffer, so a backward
    /// pass that sums the gradients of a value used twice (residual streams, q/k/v reading
    /// one input) allocates nothing. Falls back to [`Tensor::add`] (broadcasting, new buffer)
    /// when both buffers are shared.
    pub fn accumulate(mut self, mut rhs: Tensor) -> Result<Tensor> {
        self.same_device("accumulate", &rhs)?;
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() && self.shape == rhs.shape {
            if cuda::add_in_place(&mut self, &rhs)?.is_some() {
                return Ok(self);
            }
            if cuda::add_in_place(&mut rhs, &self)?.is_some() {
                return Ok(rhs);
            }
        }
        if self.shape == rhs.shape {
            if let Some(dst) = self.owned_slice_mut() {
                add_assign(dst, rhs.contiguous()?.as_slice()?);
                return Ok(self);
            }
            if let Some(dst) = rhs.owned_slice_mut() {
                add_assign(dst, self.contiguous()?.as_slice()?);
                return Ok(rhs);
            }
        }
        self.add(&rhs)
    }

    /// The elements for writing in place, when this view is the sole owner of a contiguous
    /// f32 buffer that holds exactly its elements; `None` otherwise (never copies).
    pub(crate) fn owned_slice_mut(&mut self) -> Option<&mut [f32]> {
        if !self.is_contiguous() || self.offset != 0 || self.storage.len() != self.numel() {
            return None;
        }
        match Arc::get_mut(&mut self.storage)? {
            Storage::F32(v) => Some(v.as_mut_slice()),
            _ => None,
        }
    }

    /// Elementwise difference with broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, Binary::Sub)
    }

    /// Elementwise product with broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, Binary::Mul)
    }

    /// Elementwise quotient with broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, Binary::Div)
    }

    /// `cond ? a : b` elementwise (cond nonzero = true), all three broadcast together
    /// (PyTorch `torch.where`).
    pub fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        cond.same_device("select", a)?;
        a.same_device("select", b)?;
        let shape = broadcast_shapes("select", &broadcast_shapes("select", &cond.shape, &a.shape)?, &b.shape)?;
        #[cfg(feature = "cuda")]
        if a.cuda_storage().is_some() {
            return cuda::select(&cond.expand(&shape)?, &a.expand(&shape)?, &b.expand(&shape)?);
        }
        let gather = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.expand(&shape)?.to_vec()) };
        let mut out = crate::pool::buffer(shape.iter().product());
        select(&gather(cond)?, &gather(a)?, &gather(b)?, &mut out);
        Tensor::from_vec(out, &shape)
    }
}

fn op_name(op: Binary) -> &'static str {
    match op {
        Binary::Add => "add",
        Binary::Sub => "sub",
        Binary::Mul => "mul",
        Binary::Div => "div",
        Binary::Maximum => "maximum",
        Binary::Minimum => "minimum",
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/elementwise.rs`: unary functions and their backward,
    //! broadcasting binary ops, scalar ops, in-place accumulation and `select`.

    use kernels::cuda::elementwise as launch;
    use kernels::cuda::elementwise::{Binary, Unary};

    use crate::cuda::output;
    use crate::{Result, Tensor};

    /// `f(x)` elementwise.
    pub(crate) fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
        let dev = x.cuda_device("unary")?;
        let x = x.dense()?;
        output(&dev, "unary", x.shape(), |y| Ok(launch::unary_forward(&dev, op, x.cuda_f32("unary")?, y)?))
    }

    /// `dy · f'(x)` from the saved input and output.
    pub(crate) fn unary_backward(op: Unary, x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        const OP: &str = "unary_backward";
        let dev = x.cuda_device(OP)?;
        let (x, y, dy) = (x.dense()?, y.dense()?, dy.dense()?);
        output(&dev, OP, x.shape(), |dx| {
            Ok(launch::unary_backward(&dev, op, x.cuda_f32(OP)?, y.cuda_f32(OP)?, dy.cuda_f32(OP)?, dx)?)
        })
    }

    /// `a op b` over `shape`, both already expanded to it (strides 0 where broadcast).
    pub(crate) fn binary(a: &Tensor, b: &Tensor, op: Binary, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "binary";
        let dev = a.cuda_device(OP)?;
        let (a_buffer, b_buffer) = (buffer_of(a, OP)?, buffer_of(b, OP)?);
        output(&dev, OP, shape, |out| {
            Ok(launch::binary_forward(
                &dev, op, a_buffer, a.offset, &a.strides, b_buffer, b.offset, &b.strides, shape, out,
            )?)
        })
    }

    /// `x op s` for a scalar `s`.
    pub(crate) fn scalar_op(x: &Tensor, op: Binary, s: f32) -> Result<Tensor> {
        const OP: &str = "scalar_op";
        let dev = x.cuda_device(OP)?;
        let x = x.dense()?;
        output(&dev, OP, x.shape(), |out| Ok(launch::scalar_forward(&dev, op, x.cuda_f32(OP)?, s, out)?))
    }

    /// `dst += src` in place when `dst` solely owns a dense buffer (gradient accumulation);
    /// `None` when it does not, and the caller allocates a new sum instead.
    pub(crate) fn add_in_place(dst: &mut Tensor, src: &Tensor) -> Result<Option<()>> {
        const OP: &str = "accumulate";
        let dev = dst.cuda_device(OP)?;
        let Some(storage) = dst.sole_dense_cuda_storage() else { return Ok(None) };
        let src = src.dense()?;
        // A sum of gradients is often what products read next (the residual stream's gradient
        // feeds the projections' backward products): in bf16 too under bf16 products.
        let (dst_buffer, dst_bf16) = crate::cuda::product_input_buffers(storage, OP)?;
        launch::add_assign(&dev, dst_buffer, src.cuda_f32(OP)?, dst_bf16)?;
        Ok(Some(()))
    }

    /// `cond ? a : b`, all three dense and of one shape.
    pub(crate) fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "select";
        let dev = a.cuda_device(OP)?;
        let (cond, a, b) = (cond.dense()?, a.dense()?, b.dense()?);
        output(&dev, OP, a.shape(), |out| {
            Ok(launch::select(&dev, cond.cuda_f32(OP)?, a.cuda_f32(OP)?, b.cuda_f32(OP)?, out)?)
        })
    }

    /// The whole f32 device buffer behind a (possibly strided or broadcast) view.
    fn buffer_of<'t>(t: &'t Tensor, op: &'static str) -> Result<&'t kernels::cuda::DeviceBuffer<f32>> {
        let storage = t.cuda_storage().ok_or(crate::Error::UnsupportedDevice { op, device: t.device })?;
        storage.f32_buffer(op)
    }
}
