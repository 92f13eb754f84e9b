//! The fused gated projection of Transponder (eq. 8-10), forward and backward, on either
//! device. No autograd here: `autograd`'s `Var::fused_gated_projection` wires these two
//! functions into the graph.
//!
//! `Ẑ = (x·Wᵀ) ⊙ σ̃_αc(φ(x·A_cᵀ + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(x·A_sᵀ + a_s)·B_sᵀ + b_s)`, with
//! `σ̃_α(z) = 2σ(αz)`. The forward is one GEMM over `[W | A_cᵀ | A_sᵀ]` and one pass over
//! rows (`kernels::cpu::fused_gate`; on the GPU `kernels::cuda::fused_gate`, a bf16
//! tensor-core GEMM with the gate in its epilogue). It saves `x`, the parameters (shared
//! views, no copies), the GEMM output `ZU` (`N × (d_out + r_c + r_s)`) and, on the CPU, the
//! modulators' rank-r results; backward recomputes only the channel gate from them.
//! Modulator arguments are `[A, a, B, b, α]` in that order.

use kernels::cpu::fused_gate::{
    fused_gate_backward, fused_gate_forward, FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams,
};
use kernels::cpu::unary::Unary;

use crate::{Error, Result, Tensor};

const OP: &str = "fused_gated_projection";

/// What [`Tensor::fused_gated_projection`] keeps for its backward: the (contiguous) input
/// and parameters, the GEMM output `ZU`, and the device's own extras.
pub struct FusedGateSaved {
    pub(crate) dims: FusedGateDims,
    pub(crate) x: Tensor,
    pub(crate) weight: Tensor,
    pub(crate) channel: Vec<Tensor>,
    pub(crate) scalar: Vec<Tensor>,
    pub(crate) phi: Unary,
    pub(crate) zu: Tensor,
    pub(crate) extra: SavedExtra,
}

/// The device-specific part of [`FusedGateSaved`].
pub(crate) enum SavedExtra {
    /// The CPU kernel's rank-r results and scalar gate.
    Cpu(kernels::cpu::fused_gate::FusedGateSaved),
    /// Nothing beyond the common fields: the GPU backward recomputes from `ZU`.
    #[cfg(feature = "cuda")]
    Cuda,
}

/// Contiguous values of one modulator's `[A, a, B, b, α]`, with its rank, checked against
/// `d_in` and the gate width `m` (d_out for channel, 1 for scalar) and `x`'s device.
fn modulator_values(x: &Tensor, tensors: [&Tensor; 5], d_in: usize, m: usize) -> Result<(Vec<Tensor>, usize)> {
    for t in tensors {
        x.same_device(OP, t)?;
    }
    let values = tensors.iter().map(|t| t.contiguous()).collect::<Result<Vec<_>>>()?;
    let rank = values[0].shape().first().copied().unwrap_or(0);
    let expected: [&[usize]; 4] = [&[rank, d_in], &[rank], &[m, rank], &[m]];
    for (value, shape) in values.iter().zip(expected) {
        if value.shape() != shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: shape.to_vec(), rhs: value.shape().to_vec() });
        }
    }
    if values[4].numel() != 1 {
        return Err(Error::InvalidShape {
            op: OP,
            shape: values[4].shape().to_vec(),
            reason: "α must be one element".into(),
        });
    }
    Ok((values, rank))
}

fn gate_params(v: &[Tensor]) -> Result<GateParams<'_>> {
    Ok(GateParams {
        a_weight: v[0].as_slice()?,
        a_bias: v[1].as_slice()?,
        b_weight: v[2].as_slice()?,
        b_bias: v[3].as_slice()?,
        alpha: v[4].as_slice()?[0],
    })
}

/// Zeroed gradient buffers shaped like a modulator's five parameters.
fn zeros_like_all(v: &[Tensor]) -> Vec<Vec<f32>> {
    v.iter().map(|t| crate::pool::zeros(t.numel())).collect()
}

fn gate_grads(g: &mut [Vec<f32>]) -> Result<GateGrads<'_>> {
    let [a_weight, a_bias, b_weight, b_bias, alpha] = g else {
        return Err(Error::InvalidShape { op: OP, shape: vec![g.len()], reason: "five modulator gradients".into() });
    };
    Ok(GateGrads { a_weight, a_bias, b_weight, b_bias, alpha: &mut alpha[0] })
}

impl Tensor {
    /// Fused `layer-channel-scalar` projection of `self: [..., d_in]` by `weight: [d_out, d_in]`
    /// (eq. 8-10); `channel` and `scalar` are `[A, a, B, b, α]` with `B: [d_out, r_c]` and
    /// `B: [1, r_s]`. Returns `[..., d_out]` and what [`Tensor::fused_gated_projection_backward`]
    /// reads. On a GPU the GEMM reads `x` and the weights in bf16 (f32 accumulation).
    pub fn fused_gated_projection(
        &self,
        weight: &Tensor,
        channel: [&Tensor; 5],
        scalar: [&Tensor; 5],
        phi: Unary,
    ) -> Result<(Tensor, FusedGateSaved)> {
        self.same_device(OP, weight)?;
        let x = self.contiguous()?;
        let w = weight.contiguous()?;
        let (d_out, d_in) = match (w.shape(), x.shape().last()) {
            (&[o, i], Some(&xi)) if i == xi => (o, i),
            _ => return Err(Error::ShapeMismatch { op: OP, lhs: x.shape().to_vec(), rhs: w.shape().to_vec() }),
        };
        if d_in == 0 || d_out == 0 {
            return Err(Error::InvalidShape {
                op: OP,
                shape: w.shape().to_vec(),
                reason: "the projection needs d_in > 0 and d_out > 0".into(),
            });
        }
        let (cv, rank_channel) = modulator_values(&x, channel, d_in, d_out)?;
        let (sv, rank_scalar) = modulator_values(&x, scalar, d_in, 1)?;
        let dims = FusedGateDims { rows: x.numel() / d_in.max(1), d_in, d_out, rank_channel, rank_scalar };
        let mut out_shape = x.shape().to_vec();
        if let Some(last) = out_shape.last_mut() {
            *last = d_out;
        }
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            let forward = crate::cuda::fused_gate::forward(&dims, &x, &w, &cv, &sv, phi, &out_shape)?;
            let (out, x, zu) = forward;
            let extra = SavedExtra::Cuda;
            return Ok((out, FusedGateSaved { dims, x, weight: w, channel: cv, scalar: sv, phi, zu, extra }));
        }
        let (mut zu, mut out) = (crate::pool::buffer(dims.rows * dims.width()), crate::pool::buffer(dims.rows * d_out));
        let saved = {
            let p =
                FusedGateParams { weight: w.as_slice()?, channel: gate_params(&cv)?, scalar: gate_params(&sv)?, phi };
            fused_gate_forward(&dims, x.as_slice()?, &p, &mut zu, &mut out)
        };
        let zu = Tensor::from_vec(zu, &[dims.rows, dims.width()])?;
        let out = Tensor::from_vec(out, &out_shape)?;
        let extra = SavedExtra::Cpu(saved);
        Ok((out, FusedGateSaved { dims, x, weight: w, channel: cv, scalar: sv, phi, zu, extra }))
    }

    /// The backward of [`Tensor::fused_gated_projection`] for the output gradient `dy`:
    /// `[dx, dW, dA_c, da_c, dB_c, db_c, dα_c, dA_s, da_s, dB_s, db_s, dα_s]`, each shaped like
    /// its input.
    pub fn fused_gated_projection_backward(saved: &FusedGateSaved, dy: &Tensor) -> Result<Vec<Tensor>> {
        let x = &saved.x;
        x.same_device(OP, dy)?;
        let mut y_shape = x.shape().to_vec();
        if let Some(last) = y_shape.last_mut() {
            *last = saved.dims.d_out;
        }
        if dy.shape() != y_shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: y_shape, rhs: dy.shape().to_vec() });
        }
        match &saved.extra {
            SavedExtra::Cpu(host) => cpu_backward(saved, host, dy),
            #[cfg(feature = "cuda")]
            SavedExtra::Cuda => {
                let FusedGateSaved { dims, x, weight, channel, scalar, phi, zu, .. } = saved;
                crate::cuda::fused_gate::backward(dims, x, weight, channel, scalar, *phi, zu, dy)
            }
        }
    }
}

/// The CPU backward: `kernels::cpu::fused_gate::fused_gate_backward` into fresh buffers.
fn cpu_backward(
    saved: &FusedGateSaved,
    host: &kernels::cpu::fused_gate::FusedGateSaved,
    dy: &Tensor,
) -> Result<Vec<Tensor>> {
    let FusedGateSaved { dims, x, weight: w, channel: cv, scalar: sv, phi, zu, .. } = saved;
    let dy = dy.contiguous()?;
    let (mut dx, mut dw) = (crate::pool::zeros(x.numel()), crate::pool::zeros(w.numel()));
    let (mut dc, mut ds) = (zeros_like_all(cv), zeros_like_all(sv));
    let p = FusedGateParams { weight: w.as_slice()?, channel: gate_params(cv)?, scalar: gate_params(sv)?, phi: *phi };
    let mut grads =
        FusedGateGrads { x: &mut dx, weight: &mut dw, channel: gate_grads(&mut dc)?, scalar: gate_grads(&mut ds)? };
    // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cpu::fused_gate::fused_gate_backward
    let mut dzu = crate::pool::buffer(zu.numel());
    fused_gate_backward(dims, x.as_slice()?, &p, zu.as_slice()?, host, dy.as_slice()?, &mut dzu, &mut grads);
    crate::pool::recycle(dzu);
    let mut out = vec![Tensor::from_vec(dx, x.shape())?, Tensor::from_vec(dw, w.shape())?];
    for (g, t) in dc.into_iter().zip(cv).chain(ds.into_iter().zip(sv)) {
        out.push(Tensor::from_vec(g, t.shape())?);
    }
    Ok(out)
}
