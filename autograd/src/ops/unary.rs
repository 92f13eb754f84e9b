//! Elementwise functions. The forward and derivative of each live side by side in
//! `kernels::cpu::unary`; this file wires them into the graph.

use tensor::ops::Unary;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Applies `op` elementwise; backward is `dx = dy · f'(x)` from the kernel table.
    pub fn unary(&self, op: Unary) -> Result<Var> {
        let x = self.value().contiguous()?;
        let y = x.unary(op)?;
        let saved_y = y.clone();
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::unary_backward(op, &x, &saved_y, dy)?])))
    }

    /// `-x`
    pub fn neg(&self) -> Result<Var> {
        self.unary(Unary::Neg)
    }
    /// `eˣ`
    pub fn exp(&self) -> Result<Var> {
        self.unary(Unary::Exp)
    }
    /// `ln x`
    pub fn log(&self) -> Result<Var> {
        self.unary(Unary::Log)
    }
    /// `√x`
    pub fn sqrt(&self) -> Result<Var> {
        self.unary(Unary::Sqrt)
    }
    /// `1/√x`
    pub fn rsqrt(&self) -> Result<Var> {
        self.unary(Unary::Rsqrt)
    }
    /// `xᵖ`
    pub fn powf(&self, p: f32) -> Result<Var> {
        self.unary(Unary::Powf(p))
    }
    /// `x²`
    pub fn square(&self) -> Result<Var> {
        self.unary(Unary::Square)
    }
    /// `|x|`
    pub fn abs(&self) -> Result<Var> {
        self.unary(Unary::Abs)
    }
    /// `σ(x) = 1/(1+e⁻ˣ)`
    pub fn sigmoid(&self) -> Result<Var> {
        self.unary(Unary::Sigmoid)
    }
    /// `tanh x`
    pub fn tanh(&self) -> Result<Var> {
        self.unary(Unary::Tanh)
    }
    /// `max(x, 0)`
    pub fn relu(&self) -> Result<Var> {
        self.unary(Unary::Relu)
    }
    /// `x·σ(x)` (SwiGLU's activation)
    pub fn silu(&self) -> Result<Var> {
        self.unary(Unary::Silu)
    }
    /// GELU, exact erf form (PyTorch default)
    pub fn gelu(&self) -> Result<Var> {
        self.unary(Unary::Gelu)
    }
    /// GELU, tanh approximation (PyTorch `approximate="tanh"`)
    pub fn gelu_tanh(&self) -> Result<Var> {
        self.unary(Unary::GeluTanh)
    }
}
