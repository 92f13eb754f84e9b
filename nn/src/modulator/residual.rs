//! How a decoder block's two sublayers join the residual stream (Transponder eq. 1; the
//! baselines of SPEC §5). `F` is a sublayer, `l` the 1-based layer index, `N` the depth.
//!
//! | rule | per sublayer |
//! |---|---|
//! | [`ResidualRule::PreNorm`] | `x + F(s·Norm(x))`: pre-ln (s = 1), ln-scaling (s = 1/√l), dyt (DyT norms) |
//! | [`ResidualRule::PostNorm`] | `Norm(α·x + F(x))`: post-ln (α = 1), DeepNorm (α = (2N)^¼) |
//! | [`ResidualRule::ReZero`] | `x + α_l·F(x)`, one α_l per block (init 0, as the ReZero code shares it), no norm |
//! | [`ResidualRule::LaurelRw`] | `α·F(Norm(x)) + β·x`, α, β per sublayer (init 1) |
//! | [`ResidualRule::LaurelLr`] | `F(Norm(x)) + x + B·A·x`, A: r×d Kaiming-uniform, B: d×r zero |
//! | [`ResidualRule::LaurelPa`] | `x + F(Norm(x))`, then the block adds `Σ_j γ_j·x_j` (γ init 0) |
//!
//! LAuReL-PA's earlier activations are those before the block's own input (which already
//! has the identity path): the embedding output and the outputs of blocks 1..l−2, so block
//! l has l − 1 weights γ (LAuReL §2.3). Norm names follow Hugging Face: `input_layernorm`
//! (before or after attention) and `post_attention_layernorm` (around the FFN).

use autograd::{Result, Var};
use tensor::{Error, Rng};

use super::GatedOutput;
use crate::init;
use crate::layers::Norm;
use crate::module::{join, Module};

/// The residual rule of one block; see the module table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ResidualRule {
    /// `x + F(scale·Norm(x))`.
    PreNorm {
        /// 1, or 1/√l for LayerNorm Scaling.
        scale: f32,
    },
    /// `Norm(alpha·x + F(x))`.
    PostNorm {
        /// 1, or (2N)^¼ for DeepNorm.
        alpha: f32,
    },
    /// `x + α_l·F(x)`, no norm.
    ReZero,
    /// `α·F(Norm(x)) + β·x`.
    LaurelRw,
    /// `F(Norm(x)) + x + B·A·x`.
    LaurelLr {
        /// r of `A: r × d`, `B: d × r`.
        rank: usize,
    },
    /// `x + F(Norm(x))` per sublayer, `+ Σ_j γ_j·x_j` per block.
    LaurelPa {
        /// How many earlier activations the block mixes in (l − 1 for block l).
        earlier: usize,
    },
}

/// A sublayer's output as the residual stream holds it until it is added: a value, or a gated
/// output projection not yet run ([`GatedOutput`]: Transponder's o and down projections under
/// bf16 products on a GPU), which the RMSNorm reading the stream runs in one launch with the
/// add ([`Stream::normed`]).
#[derive(Clone)]
pub enum Delta {
    /// The output.
    Value(Var),
    /// The projection that makes it.
    Gated(GatedOutput),
}

impl Delta {
    /// The output (running a deferred projection now).
    pub fn value(&self) -> Result<Var> {
        match self {
            Delta::Value(v) => Ok(v.clone()),
            Delta::Gated(g) => g.value(),
        }
    }
}

/// The residual stream between sublayers and blocks: `base + delta`, with the add of the last
/// sublayer's output left pending so that the RMSNorm reading the stream runs it fused (the
/// pre-ln LLaMA block's `x + F(Norm(x))`, read by the next block's `input_layernorm` or the
/// final norm), or a plain value (`delta` is `None`).
#[derive(Clone)]
pub struct Stream {
    /// The stream before the pending output is added.
    pub base: Var,
    /// The last sublayer's output, not yet added.
    pub delta: Option<Delta>,
}

impl Stream {
    /// The stream `x`, nothing pending.
    pub fn new(x: Var) -> Stream {
        Stream { base: x, delta: None }
    }

    /// The stream's value: `base + delta`, added now when pending.
    pub fn value(&self) -> Result<Var> {
        match &self.delta {
            Some(delta) => self.base.add(&delta.value()?),
            None => Ok(self.base.clone()),
        }
    }

    /// `(value, norm(value))`; a pending add runs fused with an RMSNorm
    /// ([`crate::layers::RmsNorm::forward_after_add`]), and a pending gated projection too
    /// ([`GatedOutput::add_rms_norm`]), with the same values as apart.
    pub fn normed(&self, norm: &Norm) -> Result<(Var, Var)> {
        match (norm, &self.delta) {
            (Norm::Rms(norm), Some(Delta::Value(delta))) => norm.forward_after_add(&self.base, delta),
            (Norm::Rms(norm), Some(Delta::Gated(gated))) => gated.add_rms_norm(&self.base, &norm.weight, norm.eps),
            _ => {
                let x = self.value()?;
                let normed = norm.forward(&x)?;
                Ok((x, normed))
            }
        }
    }
}

/// A block's residual rule with the parameters it owns (norms, α_l, LAuReL weights).
pub struct Residual {
    /// Which rule.
    pub rule: ResidualRule,
    /// `input_layernorm` (absent for ReZero).
    pub input_norm: Option<Norm>,
    /// `post_attention_layernorm` (absent for ReZero).
    pub post_attention_norm: Option<Norm>,
    /// ReZero's α_l.
    pub resweight: Option<Var>,
    /// LAuReL-RW `[alpha, beta]` or LAuReL-LR `[A, B]` of the attention sublayer.
    pub attn_laurel: Vec<(&'static str, Var)>,
    /// The same for the FFN sublayer.
    pub mlp_laurel: Vec<(&'static str, Var)>,
    /// LAuReL-PA's γ over earlier activations.
    pub gamma: Option<Var>,
}

impl Residual {
    /// The rule for a width-`dim` block; `make_norm` builds each norm (RMSNorm or DyT).
    pub fn new(rule: ResidualRule, dim: usize, make_norm: impl Fn() -> Norm, rng: &mut Rng) -> Residual {
        let has_norm = rule != ResidualRule::ReZero;
        let laurel = |rng: &mut Rng| -> Vec<(&'static str, Var)> {
            match rule {
                ResidualRule::LaurelRw => vec![("alpha", init::ones(&[1])), ("beta", init::ones(&[1]))],
                ResidualRule::LaurelLr { rank } => {
                    vec![("A", init::kaiming_uniform(&[rank, dim], dim, rng)), ("B", init::zeros(&[dim, rank]))]
                }
                _ => Vec::new(),
            }
        };
        let (attn_laurel, mlp_laurel) = (laurel(rng), laurel(rng));
        Residual {
            rule,
            input_norm: has_norm.then(&make_norm),
            post_attention_norm: has_norm.then(&make_norm),
            resweight: (rule == ResidualRule::ReZero).then(|| init::zeros(&[1])),
            attn_laurel,
            mlp_laurel,
            gamma: match rule {
                ResidualRule::LaurelPa { earlier } if earlier > 0 => Some(init::zeros(&[earlier])),
                _ => None,
            },
        }
    }

    /// One block on the residual stream `x`: `attention` sublayer, then `between` (the
    /// per-token transform: `x + between(x)`, when given), then the `mlp` sublayer. `earlier`
    /// holds LAuReL-PA's earlier activations (ignored by the other rules). Under a pre-norm
    /// rule with RMSNorms (pre-ln LLaMA) every residual add runs fused with the RMSNorm that
    /// reads it ([`Stream::normed`]): the block's input add (left pending by the block
    /// before) with `input_layernorm`, the attention's with `post_attention_layernorm`, and
    /// the FFN's is left pending in the returned stream for the next norm.
    pub fn forward(
        &self,
        x: &Stream,
        earlier: &[Var],
        attention: impl FnOnce(&Var) -> Result<Delta>,
        between: Option<impl FnOnce(&Var) -> Result<Var>>,
        mlp: impl FnOnce(&Var) -> Result<Delta>,
    ) -> Result<Stream> {
        let out = match (self.pre_norm_scale(), &self.input_norm, &self.post_attention_norm) {
            (Some(scale), Some(input_norm), Some(post_attention_norm @ Norm::Rms(_))) => {
                let (x, h) = x.normed(input_norm)?;
                let attn = attention(&scaled(h, scale)?)?;
                let stream = match between {
                    Some(between) => {
                        let x = x.add(&attn.value()?)?;
                        let delta = between(&x)?;
                        Stream { base: x, delta: Some(Delta::Value(delta)) }
                    }
                    None => Stream { base: x, delta: Some(attn) },
                };
                let (x, h) = stream.normed(post_attention_norm)?;
                Stream { base: x, delta: Some(mlp(&scaled(h, scale)?)?) }
            }
            _ => {
                let attention = |h: &Var| attention(h)?.value();
                let x = self.sublayer(&x.value()?, self.input_norm.as_ref(), &self.attn_laurel, attention)?;
                let x = match between {
                    Some(between) => x.add(&between(&x)?)?,
                    None => x,
                };
                let mlp = |h: &Var| mlp(h)?.value();
                Stream::new(self.sublayer(&x, self.post_attention_norm.as_ref(), &self.mlp_laurel, mlp)?)
            }
        };
        let Some(gamma) = &self.gamma else { return Ok(out) };
        if earlier.len() != gamma.value_ref().numel() {
            return Err(Error::ShapeMismatch { op: "laurel-pa", lhs: gamma.shape(), rhs: vec![earlier.len()] });
        }
        let mut x = out.value()?;
        for (j, activation) in earlier.iter().enumerate() {
            x = x.add(&activation.mul(&gamma.narrow(0, j, 1)?)?)?;
        }
        Ok(Stream::new(x))
    }

    /// Whether [`Residual::forward`] adds each sublayer's output to the stream only through
    /// the fused add + RMSNorm ([`Stream::normed`]): a pre-norm rule whose norms are RMSNorms,
    /// with no LAuReL-PA sum over earlier activations (the FFN's output is left pending for
    /// the next block's input norm or the model's final one).
    pub fn adds_fused(&self) -> bool {
        let rms = |norm: &Option<Norm>| matches!(norm, Some(Norm::Rms(_)));
        self.pre_norm_scale().is_some()
            && self.gamma.is_none()
            && rms(&self.input_norm)
            && rms(&self.post_attention_norm)
    }

    /// The `s` of `x + F(s·Norm(x))` for the pre-norm rules (LAuReL-PA's sublayers are
    /// pre-ln's, s = 1); `None` for the others.
    fn pre_norm_scale(&self) -> Option<f32> {
        match self.rule {
            ResidualRule::PreNorm { scale } => Some(scale),
            ResidualRule::LaurelPa { .. } => Some(1.0),
            _ => None,
        }
    }

    fn sublayer(
        &self,
        x: &Var,
        norm: Option<&Norm>,
        laurel: &[(&'static str, Var)],
        f: impl FnOnce(&Var) -> Result<Var>,
    ) -> Result<Var> {
        let normed = |x: &Var| -> Result<Var> {
            match norm {
                Some(n) => n.forward(x),
                None => Ok(x.clone()),
            }
        };
        match (self.rule, laurel) {
            (ResidualRule::PreNorm { scale }, _) if scale != 1.0 => x.add(&f(&normed(x)?.mul_scalar(scale)?)?),
            (ResidualRule::PostNorm { alpha }, _) if alpha != 1.0 => normed(&x.mul_scalar(alpha)?.add(&f(x)?)?),
            (ResidualRule::PostNorm { .. }, _) => normed(&x.add(&f(x)?)?),
            (ResidualRule::PreNorm { .. } | ResidualRule::LaurelPa { .. }, _) => x.add(&f(&normed(x)?)?),
            (ResidualRule::ReZero, _) => match &self.resweight {
                Some(weight) => x.add(&f(x)?.mul(weight)?),
                None => Err(missing_parameters(self.rule, x)),
            },
            (ResidualRule::LaurelRw, [(_, alpha), (_, beta)]) => f(&normed(x)?)?.mul(alpha)?.add(&x.mul(beta)?),
            (ResidualRule::LaurelLr { .. }, [(_, a), (_, b)]) => {
                let low_rank = x.matmul(&a.transpose(0, 1)?)?.matmul(&b.transpose(0, 1)?)?;
                f(&normed(x)?)?.add(x)?.add(&low_rank)
            }
            (rule, _) => Err(missing_parameters(rule, x)),
        }
    }
}

/// `scale·x` (LayerNorm Scaling), or `x` when `scale` is 1.
fn scaled(x: Var, scale: f32) -> Result<Var> {
    if scale == 1.0 {
        Ok(x)
    } else {
        x.mul_scalar(scale)
    }
}

fn missing_parameters(rule: ResidualRule, x: &Var) -> Error {
    Error::InvalidShape {
        op: "residual",
        shape: x.shape(),
        reason: format!("{rule:?} is missing its parameters (build it with Residual::new)"),
    }
}

impl Module for Residual {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        if let Some(n) = &self.input_norm {
            n.visit_parameters(&join(prefix, "input_layernorm."), visit);
        }
        if let Some(n) = &self.post_attention_norm {
            n.visit_parameters(&join(prefix, "post_attention_layernorm."), visit);
        }
        if let Some(w) = &self.resweight {
            visit(join(prefix, "resweight"), w);
        }
        for (sublayer, params) in [("attn_laurel.", &self.attn_laurel), ("mlp_laurel.", &self.mlp_laurel)] {
            for (name, var) in params {
                visit(join(prefix, &format!("{sublayer}{name}")), var);
            }
        }
        if let Some(g) = &self.gamma {
            visit(join(prefix, "laurel_pa.gamma"), g);
        }
    }
}
