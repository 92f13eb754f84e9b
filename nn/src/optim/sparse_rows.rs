//! Row-sparse updates for per-token tables (the `per-token` `M: [V, r, r]` and the
//! `token-scale` `E: [V, C]`, SPEC §4): only the rows of tokens seen in the batch are
//! touched by the step. A row counts as seen when its gradient has a nonzero element (the
//! embedding backward leaves unseen rows exactly zero).
//!
//! Exactness, per rule:
//! - [`RowRule::Sgd`] with momentum 0 and weight decay 0 (plain SGD): exact. An unseen row's
//!   dense update is `p −= lr·0`, so skipping it changes nothing; the sparse step only saves
//!   the pass over the untouched rows.
//! - [`RowRule::Sgd`] with momentum or decay, and [`RowRule::Adam`] ("lazy Adam", as
//!   TensorFlow Addons' `LazyAdam`): not exact. Dense Adam keeps moving an unseen row (its
//!   moments decay but `m̂/√v̂` stays nonzero) and decays it; here unseen rows, their moments
//!   and their momentum buffers stay frozen until the token appears again. Bias corrections
//!   use the global step count. This is the documented approximation a sparse embedding
//!   update makes, and it is opt-in (`lazy_tables`).
//!
//! Every other parameter goes through the wrapped dense optimizer unchanged.
//!
//! Host only: the tables must stay on the CPU (a table on a GPU is an
//! [`tensor::Error::UnsupportedDevice`] error before anything is updated). On a GPU, use
//! the dense optimizer for the tables, which is exact where this is (plain SGD).

use autograd::Result;
use kernels::cpu::optim::{adam_step, adamw_step, sgd_step, AdamHyper};
use tensor::{Device, Tensor};

use super::{find_state, gradient_of, AdamConfig, Optimizer, StepGuard};
use crate::NamedParameter;

/// How the table rows are updated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowRule {
    /// `torch.optim.SGD` per row: exact when momentum and weight decay are 0.
    Sgd {
        /// Momentum μ (0 = plain SGD).
        momentum: f32,
        /// Coupled weight decay λ.
        weight_decay: f32,
    },
    /// Adam / AdamW per row with the global step ("lazy Adam"); decay as [`super::Adam`]
    /// (tables are matrices, so they decay).
    Adam(AdamConfig),
}

impl RowRule {
    /// True when skipping unseen rows gives exactly the dense update.
    pub fn is_exact(self) -> bool {
        matches!(self, RowRule::Sgd { momentum, weight_decay } if momentum == 0.0 && weight_decay == 0.0)
    }
}

/// A dense optimizer for most parameters plus row-sparse updates for the tables.
pub struct SparseRows {
    dense: Box<dyn Optimizer>,
    tables: Vec<NamedParameter>,
    rule: RowRule,
    /// Dense parameters followed by the tables (for clipping and `zero_grad`).
    all: Vec<NamedParameter>,
    /// Per table: SGD momentum buffer or Adam first moment.
    first: Vec<Vec<f32>>,
    /// Per table: Adam second moment (empty for SGD).
    second: Vec<Vec<f32>>,
    step: u64,
    /// The learning rate of the staged update.
    lr: f32,
    rows_touched: usize,
}

impl SparseRows {
    /// `dense` optimises its own parameters; `tables` (each `[V, ...]`, one row per token)
    /// follow `rule` row by row.
    pub fn new(dense: Box<dyn Optimizer>, tables: Vec<NamedParameter>, rule: RowRule) -> SparseRows {
        let zeros = |p: &NamedParameter| vec![0.0; p.var.value_ref().numel()];
        let first = tables.iter().map(zeros).collect();
        let second = match rule {
            RowRule::Adam(_) => tables.iter().map(zeros).collect(),
            RowRule::Sgd { .. } => tables.iter().map(|_| Vec::new()).collect(),
        };
        let all = dense.parameters().iter().chain(&tables).cloned().collect();
        SparseRows { dense, tables, rule, all, first, second, step: 0, lr: 0.0, rows_touched: 0 }
    }

    /// Table rows updated by the last step (summed over tables).
    pub fn rows_touched(&self) -> usize {
        self.rows_touched
    }
}

impl Optimizer for SparseRows {
    /// Stages the dense optimizer's update and counts the tables' step.
    fn stage(&mut self, lr: f32) -> Result<()> {
        self.dense.stage(lr)?;
        self.step += 1;
        self.lr = lr;
        Ok(())
    }

    /// The dense update, then the tables' seen rows; a guard is applied on the host, to the
    /// tables and the dense parameters alike.
    fn apply_staged(&mut self, guard: Option<&StepGuard>) -> Result<()> {
        for p in &self.tables {
            let device = p.var.value_ref().device();
            if device != Device::Cpu {
                return Err(tensor::Error::UnsupportedDevice { op: "row-sparse table update (SparseRows)", device });
            }
        }
        if let Some(guard) = guard {
            if !super::guard::apply_on_host(&self.all, guard)? {
                return Ok(());
            }
        }
        self.dense.apply_staged(None)?;
        let lr = self.lr;
        self.rows_touched = 0;
        for (i, p) in self.tables.iter().enumerate() {
            let Some(grad) = gradient_of(p)? else { continue };
            let grad = grad.as_slice()?;
            let width = grad.len() / p.var.shape()[0].max(1);
            let mut value = p.var.value_mut();
            let param = value.as_mut_slice()?;
            for (row, g) in grad.chunks(width.max(1)).enumerate() {
                if g.iter().all(|&v| v == 0.0) {
                    continue;
                }
                self.rows_touched += 1;
                let span = row * width..(row + 1) * width;
                let w = &mut param[span.clone()];
                match self.rule {
                    RowRule::Sgd { momentum, weight_decay } => {
                        let buffer = if momentum == 0.0 { &mut [][..] } else { &mut self.first[i][span] };
                        sgd_step(w, g, buffer, lr, momentum, weight_decay, false);
                    }
                    RowRule::Adam(config) => {
                        let hyper = AdamHyper {
                            lr,
                            beta1: config.beta1,
                            beta2: config.beta2,
                            eps: config.eps,
                            weight_decay: config.weight_decay,
                            step: self.step,
                        };
                        let update = if config.decoupled { adamw_step } else { adam_step };
                        update(w, g, &mut self.first[i][span.clone()], &mut self.second[i][span], &hyper);
                    }
                }
            }
        }
        Ok(())
    }

    fn parameters(&self) -> &[NamedParameter] {
        &self.all
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = self.dense.state();
        out.push(("sparse_rows.step".to_string(), Tensor::scalar(self.step as f32)));
        for (i, p) in self.tables.iter().enumerate() {
            let shape = p.var.shape();
            let tensor = |m: &Vec<f32>| Tensor::from_vec(m.clone(), &shape).expect("state matches its parameter");
            match self.rule {
                RowRule::Sgd { momentum, .. } if momentum != 0.0 => {
                    out.push((format!("{}.momentum_buffer", p.name), tensor(&self.first[i])));
                }
                RowRule::Sgd { .. } => {}
                RowRule::Adam(_) => {
                    out.push((format!("{}.exp_avg", p.name), tensor(&self.first[i])));
                    out.push((format!("{}.exp_avg_sq", p.name), tensor(&self.second[i])));
                }
            }
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        self.dense.load_state(state)?;
        self.step = find_state(state, "sparse_rows.step", 1)?[0] as u64;
        for (i, p) in self.tables.iter().enumerate() {
            let numel = p.var.value_ref().numel();
            match self.rule {
                RowRule::Sgd { momentum, .. } if momentum != 0.0 => {
                    self.first[i] = find_state(state, &format!("{}.momentum_buffer", p.name), numel)?;
                }
                RowRule::Sgd { .. } => {}
                RowRule::Adam(_) => {
                    self.first[i] = find_state(state, &format!("{}.exp_avg", p.name), numel)?;
                    self.second[i] = find_state(state, &format!("{}.exp_avg_sq", p.name), numel)?;
                }
            }
        }
        Ok(())
    }
}
