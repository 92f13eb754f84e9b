//! The fused gated projection of Transponder (eq. 8-10) as one differentiable op, and the
//! composite of unfused ops it must agree with.
//!
//! `Ẑ = (x·Wᵀ) ⊙ σ̃_αc(φ(x·A_cᵀ + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(x·A_sᵀ + a_s)·B_sᵀ + b_s)`, with
//! `σ̃_α(z) = 2σ(αz)`: a projection gated by a channel modulator times a scalar modulator
//! (`layer-channel-scalar`). The forward is one GEMM over `[W | A_cᵀ | A_sᵀ]` and one pass
//! over rows (`kernels::cpu::fused_gate`). It saves `x`, the parameters (shared views, no
//! copies), the GEMM output `ZU` (`N × (d_out + r_c + r_s)`) and the modulators' rank-r
//! results; backward recomputes only the channel gate from them. Modulator arguments are
//! `[A, a, B, b, α]` in that order.

use kernels::cpu::fused_gate::{
    fused_gate_backward, fused_gate_forward, FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams,
};
use tensor::ops::Unary;
use tensor::{Error, Result, Tensor};

use crate::Var;

const OP: &str = "fused_gated_projection";

/// Contiguous values of one modulator's `[A, a, B, b, α]`, with its rank, checked against
/// `d_in` and the gate width `m` (d_out for channel, 1 for scalar).
fn modulator_values(vars: [&Var; 5], d_in: usize, m: usize) -> Result<(Vec<Tensor>, usize)> {
    let values = vars.iter().map(|v| v.value().contiguous()).collect::<Result<Vec<_>>>()?;
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
    v.iter().map(|t| tensor::pool::zeros(t.numel())).collect()
}

fn gate_grads(g: &mut [Vec<f32>]) -> GateGrads<'_> {
    let [a_weight, a_bias, b_weight, b_bias, alpha] = g else { unreachable!("five modulator gradients") };
    GateGrads { a_weight, a_bias, b_weight, b_bias, alpha: &mut alpha[0] }
}

impl Var {
    /// Fused `layer-channel-scalar` projection of `self: [..., d_in]` by `weight: [d_out, d_in]`
    /// (eq. 8-10); `channel` and `scalar` are `[A, a, B, b, α]` with `B: [d_out, r_c]` and
    /// `B: [1, r_s]`. Returns `[..., d_out]`. Agrees with
    /// [`Var::fused_gated_projection_reference`] to float tolerance, forward and backward.
    pub fn fused_gated_projection(
        &self,
        weight: &Var,
        channel: [&Var; 5],
        scalar: [&Var; 5],
        phi: Unary,
    ) -> Result<Var> {
        let x = self.value().contiguous()?;
        let w = weight.value().contiguous()?;
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
        let (cv, rank_channel) = modulator_values(channel, d_in, d_out)?;
        let (sv, rank_scalar) = modulator_values(scalar, d_in, 1)?;
        let dims = FusedGateDims { rows: x.numel() / d_in.max(1), d_in, d_out, rank_channel, rank_scalar };
        let (mut zu, mut out) =
            (tensor::pool::buffer(dims.rows * dims.width()), tensor::pool::buffer(dims.rows * d_out));
        let saved = {
            let p =
                FusedGateParams { weight: w.as_slice()?, channel: gate_params(&cv)?, scalar: gate_params(&sv)?, phi };
            fused_gate_forward(&dims, x.as_slice()?, &p, &mut zu, &mut out)
        };
        let zu = Tensor::from_vec(zu, &[dims.rows, dims.width()])?;
        let mut out_shape = x.shape().to_vec();
        *out_shape.last_mut().expect("x has a last axis") = d_out;
        let inputs =
            [vec![self.clone(), weight.clone()], channel.map(Var::clone).to_vec(), scalar.map(Var::clone).to_vec()];
        Ok(Var::from_op(Tensor::from_vec(out, &out_shape)?, inputs.concat(), move |dy| {
            let dy = dy.contiguous()?;
            let (mut dx, mut dw) = (tensor::pool::zeros(x.numel()), tensor::pool::zeros(w.numel()));
            let (mut dc, mut ds) = (zeros_like_all(&cv), zeros_like_all(&sv));
            let p =
                FusedGateParams { weight: w.as_slice()?, channel: gate_params(&cv)?, scalar: gate_params(&sv)?, phi };
            let mut grads = FusedGateGrads {
                x: &mut dx,
                weight: &mut dw,
                channel: gate_grads(&mut dc),
                scalar: gate_grads(&mut ds),
            };
            // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cpu::fused_gate::fused_gate_backward
            let mut dzu = tensor::pool::buffer(zu.numel());
            fused_gate_backward(&dims, x.as_slice()?, &p, zu.as_slice()?, &saved, dy.as_slice()?, &mut dzu, &mut grads);
            tensor::pool::recycle(dzu);
            let mut out = vec![Tensor::from_vec(dx, x.shape())?, Tensor::from_vec(dw, w.shape())?];
            for (g, t) in dc.into_iter().zip(&cv).chain(ds.into_iter().zip(&sv)) {
                out.push(Tensor::from_vec(g, t.shape())?);
            }
            Ok(out)
        }))
    }

    /// The same projection composed from unfused ops (matmul, add, φ, sigmoid, mul): the
    /// reference [`Var::fused_gated_projection`] is tested against.
    pub fn fused_gated_projection_reference(
        &self,
        weight: &Var,
        channel: [&Var; 5],
        scalar: [&Var; 5],
        phi: Unary,
    ) -> Result<Var> {
        let modulator = |[a_weight, a_bias, b_weight, b_bias, alpha]: [&Var; 5]| -> Result<Var> {
            let hidden = self.matmul(&a_weight.transpose(0, 1)?)?.add(a_bias)?.unary(phi)?;
            hidden.matmul(&b_weight.transpose(0, 1)?)?.add(b_bias)?.mul(alpha)?.sigmoid()?.mul_scalar(2.0)
        };
        let z = self.matmul(&weight.transpose(0, 1)?)?;
        z.mul(&modulator(channel)?)?.mul(&modulator(scalar)?)
    }
}

#[cfg(test)]
mod tests {
    use tensor::Rng;

    use super::*;
    use crate::{gradcheck, F32_TOLERANCE};

    /// `[x, W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]` for a small projection.
    fn inputs(rng: &mut Rng, rows: usize, d_in: usize, d_out: usize, rc: usize, rs: usize) -> Vec<Tensor> {
        let mut t = |shape: &[usize], scale: f32| Tensor::rand_normal(shape, 0.0, scale, rng);
        vec![
            t(&[2, rows, d_in], 1.0),
            t(&[d_out, d_in], 0.5),
            t(&[rc, d_in], 0.5),
            t(&[rc], 0.3),
            t(&[d_out, rc], 0.5),
            t(&[d_out], 0.3),
            Tensor::from_vec(vec![1.2], &[1]).unwrap(),
            t(&[rs, d_in], 0.5),
            t(&[rs], 0.3),
            t(&[1, rs], 0.5),
            t(&[1], 0.3),
            Tensor::from_vec(vec![0.8], &[1]).unwrap(),
        ]
    }

    fn call(v: &[Var], phi: Unary, fused: bool) -> Result<Var> {
        let c = [&v[2], &v[3], &v[4], &v[5], &v[6]];
        let s = [&v[7], &v[8], &v[9], &v[10], &v[11]];
        if fused {
            v[0].fused_gated_projection(&v[1], c, s, phi)
        } else {
            v[0].fused_gated_projection_reference(&v[1], c, s, phi)
        }
    }

    #[test]
    fn forward_and_every_gradient_match_the_reference() {
        let mut rng = Rng::new(3);
        for phi in [Unary::Sigmoid, Unary::Silu, Unary::Relu] {
            let values = inputs(&mut rng, 5, 7, 11, 3, 2);
            let mut results = Vec::new();
            for fused in [true, false] {
                let vars: Vec<Var> = values.iter().cloned().map(Var::parameter).collect();
                let y = call(&vars, phi, fused).unwrap();
                let seed = Tensor::rand_normal(&y.shape(), 0.0, 1.0, &mut Rng::new(9));
                y.backward_with(seed).unwrap();
                results.push((
                    y.value(),
                    vars.iter().map(|v| v.grad().expect("every input gets a gradient")).collect::<Vec<_>>(),
                ));
            }
            let (fused, reference) = (&results[0], &results[1]);
            assert!(fused.0.all_close(&reference.0, 1e-5, 1e-6), "{phi:?}: forward differs");
            for (i, (a, b)) in fused.1.iter().zip(&reference.1).enumerate() {
                assert!(
                    a.all_close(b, 1e-4, 1e-5),
                    "{phi:?}: gradient of input {i} differs: {:?} vs {:?}",
                    a.to_vec(),
                    b.to_vec()
                );
            }
        }
    }

    #[test]
    fn fused_op_passes_gradcheck() {
        let mut rng = Rng::new(5);
        let values = inputs(&mut rng, 3, 4, 10, 2, 3);
        gradcheck(|v| call(v, Unary::Silu, true), &values, F32_TOLERANCE).unwrap();
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut rng = Rng::new(1);
        let mut values = inputs(&mut rng, 2, 4, 3, 2, 2);
        values[4] = Tensor::zeros(&[4, 2]);
        let vars: Vec<Var> = values.into_iter().map(Var::parameter).collect();
        let err = call(&vars, Unary::Sigmoid, true).unwrap_err();
        assert!(err.to_string().contains(OP), "{err}");
    }
}
