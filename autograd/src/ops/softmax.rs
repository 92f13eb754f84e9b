//! Softmax and log-softmax over the last axis. Both save only their output: the
//! derivative is expressed through it (`Tensor::softmax_backward`, `log_softmax_backward`).

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Softmax over the last axis (PyTorch `x.softmax(-1)`).
    pub fn softmax(&self) -> Result<Var> {
        let y = self.value_ref().softmax()?;
        let saved = y.clone();
        // d/dx: dx = y ⊙ (dy − Σ dy⊙y)
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::softmax_backward(&saved, dy)?])))
    }

    /// Log-softmax over the last axis (PyTorch `x.log_softmax(-1)`).
    pub fn log_softmax(&self) -> Result<Var> {
        let y = self.value_ref().log_softmax()?;
        let saved = y.clone();
        // d/dx: dx = dy − softmax(x)·Σ dy, with softmax(x) = exp(y)
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![Tensor::log_softmax_backward(&saved, dy)?])))
    }
}
