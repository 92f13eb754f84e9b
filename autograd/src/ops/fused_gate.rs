//! The fused gated projection of Transponder (eq. 8-10) as one differentiable op, and the
//! composite of unfused ops it must agree with.
//!
//! `Ẑ = (x·Wᵀ) ⊙ σ̃_αc(φ(x·A_cᵀ + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(x·A_sᵀ + a_s)·B_sᵀ + b_s)`, with
//! `σ̃_α(z) = 2σ(αz)`: a projection gated by a channel modulator times a scalar modulator
//! (`layer-channel-scalar`). The forward and backward are tensor-level functions
//! ([`Tensor::fused_gated_projection`] and [`Tensor::fused_gated_projection_backward`], on
//! the CPU or a GPU); the forward's saved state (`x`, the parameters as shared views, the
//! GEMM output `ZU` and the modulators' rank-r results) lives in the graph node until the
//! backward. Modulator arguments are `[A, a, B, b, α]` in that order.

use tensor::ops::{AddRmsNormOutput, GatedProjection, ProductOutput, Unary};
use tensor::{Result, Tensor};

use crate::Var;

/// One projection of [`Var::fused_gated_projections`]: its weight `[d_out, d_in]` and its
/// channel and scalar modulators' `[A, a, B, b, α]`.
#[derive(Clone, Copy)]
pub struct GatedProjectionVars<'a> {
    /// `W: [d_out, d_in]`.
    pub weight: &'a Var,
    /// The channel modulator's `[A, a, B, b, α]` (`B: [d_out, r_c]`).
    pub channel: [&'a Var; 5],
    /// The scalar modulator's `[A, a, B, b, α]` (`B: [1, r_s]`).
    pub scalar: [&'a Var; 5],
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
        self.fused_gated_projections(&[GatedProjectionVars { weight, channel, scalar }], phi, ProductOutput::F32)
    }

    /// [`Var::fused_gated_projection`] of `self` by each of `projections` (one φ and one pair
    /// of ranks for all), their outputs side by side: `[..., Σ d_out]`. On a GPU the group is
    /// one GEMM and one gate launch forward (LLaMA's q, k and v, or gate and up, which read
    /// one input), where each projection alone would take its own.
    /// `output` says how the outputs are stored ([`Tensor::fused_gated_projections`]).
    pub fn fused_gated_projections(
        &self,
        projections: &[GatedProjectionVars],
        phi: Unary,
        output: ProductOutput,
    ) -> Result<Var> {
        let values = projection_values(projections);
        let (y, saved) = self.value().fused_gated_projections(&borrowed(&values), phi, output)?;
        // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cpu::fused_gate::fused_gate_backward.
        // The backward takes over x's gradient so far (q, k and v read one normalised input):
        // on the GPU its dx product adds onto it (β = 1) instead of a separate add after.
        Ok(Var::from_op_absorbing(y, self.group_inputs(projections), move |dy, dx_so_far| {
            Tensor::fused_gated_projection_backward(&saved, dy, dx_so_far)
        }))
    }

    /// Attention over gated q, k and v as one op: [`Var::fused_gated_projections`] of
    /// `self: [B, T, d_in]` by `projections` (q, k and v, one width `heads·D`), then
    /// [`Var::rotary_causal_attention_packed`] of their packed output; returns `[B, T, H, D]`.
    /// On a GPU under bf16 products the gate kernel writes q, k and v rotated
    /// ([`Tensor::fused_gated_rope_qkv`]) and attention's backward writes the packed output's
    /// gradient ([`Tensor::rotary_attention_backward_packed`]), so the packed output is never
    /// stored and RoPE takes no launch of its own, forward or backward.
    pub fn fused_gated_rotary_attention(
        &self,
        projections: &[GatedProjectionVars; 3],
        phi: Unary,
        heads: usize,
        scale: f32,
        theta: f32,
    ) -> Result<Var> {
        let values = projection_values(projections);
        let tensors = borrowed(&values);
        let tensors = [tensors[0], tensors[1], tensors[2]];
        let (q, k, v, saved) = self.value().fused_gated_rope_qkv(&tensors, phi, heads, theta)?;
        let (out, lse) = Tensor::causal_attention(&q, &k, &v, scale)?;
        let saved_out = out.clone();
        Ok(Var::from_op_absorbing(out, self.group_inputs(projections), move |dout, dx_so_far| {
            let dqkv = Tensor::rotary_attention_backward_packed(&q, &k, &v, &saved_out, &lse, dout, scale, theta)?;
            Tensor::fused_gated_projection_backward(&saved, &dqkv, dx_so_far)
        }))
    }

    /// The FFN's gated gate and up projections and SwiGLU as one op:
    /// [`Var::fused_gated_projections`] of `self: [..., d_in]` by `projections` (gate and up,
    /// one width F), then [`Var::swiglu_halves`] of their output; returns `[..., F]`. On a GPU
    /// under bf16 products the gate kernel writes SwiGLU's output too
    /// ([`Tensor::fused_gated_swiglu`]) and the gate's backward computes SwiGLU's
    /// ([`Tensor::fused_gated_swiglu_backward`]): the same bits as the two ops, one launch
    /// fewer each way.
    pub fn fused_gated_swiglu(&self, projections: &[GatedProjectionVars; 2], phi: Unary) -> Result<Var> {
        let values = projection_values(projections);
        let tensors = borrowed(&values);
        let (y, gated, saved) = self.value().fused_gated_swiglu(&[tensors[0], tensors[1]], phi)?;
        Ok(Var::from_op_absorbing(y, self.group_inputs(projections), move |dy, dx_so_far| {
            Tensor::fused_gated_swiglu_backward(&saved, &gated, dy, dx_so_far)
        }))
    }

    /// A gated output projection (Transponder's o and down) and the residual stream's add and
    /// next RMSNorm as one op: with `Ẑ` = [`Var::fused_gated_projections`] of `self: [..., d_in]`
    /// by `projection` (stored in bf16), `(sum, normed)` = [`Var::add_rms_norm`] of `stream`
    /// (`[..., d_out]`, as many rows) and `Ẑ` reshaped to it. On a GPU under bf16 products the
    /// gate's launch adds and normalises too ([`Tensor::fused_gated_add_rms_norm`]), and the
    /// backward finishes the norm's weight gradient in the gate's column-sum launch
    /// ([`Tensor::fused_gated_add_rms_norm_backward`]): the same bits as the two ops, a launch
    /// fewer each way and `Ẑ` never stored; elsewhere the two ops.
    pub fn fused_gated_add_rms_norm(
        &self,
        projection: GatedProjectionVars,
        phi: Unary,
        stream: &Var,
        weight: &Var,
        eps: f32,
    ) -> Result<(Var, Var)> {
        let values = projection_values(&[projection]);
        let w = weight.value().contiguous()?;
        let fused = self.value().fused_gated_add_rms_norm(&borrowed(&values)[0], phi, &stream.value(), &w, eps)?;
        let Some((out, saved)) = fused else {
            let delta = self.fused_gated_projections(&[projection], phi, ProductOutput::Bf16)?;
            return stream.add_rms_norm(&delta.reshape(&stream.shape())?, weight, eps);
        };
        // sum = stream + Ẑ: the stream's gradient is d/d sum, which the norm's node computes
        // (adding the gradient the sum has from the later residual add, in the same pass)
        // with the gate's backward of it for the projection's input and parameters, and the
        // norm's weight gradient finished in the gate's column-sum launch: one node for the
        // whole backward, the sum's node passing d/d sum on to the stream.
        let AddRmsNormOutput { sum, y, rstd } = out;
        let saved_sum = sum.clone();
        let sum_var = Var::from_op(sum, vec![stream.clone()], |dsum| Ok(vec![dsum.clone()]));
        let mut inputs = vec![sum_var.clone(), weight.clone()];
        inputs.extend(self.group_inputs(&[projection]));
        let normed = Var::from_op_absorbing(y, inputs, move |dy, dsum_so_far| {
            let norm = (&saved_sum, &w, &rstd);
            let (dsum, dw, grads) = Tensor::fused_gated_add_rms_norm_backward(&saved, norm, dy, dsum_so_far.as_ref())?;
            Ok([dsum, dw].into_iter().chain(grads).collect())
        });
        Ok((sum_var, normed))
    }

    /// The inputs of a fused gated group's op, in the order its backward returns their
    /// gradients: `self`, then each projection's weight and its modulators' `[A, a, B, b, α]`.
    fn group_inputs(&self, projections: &[GatedProjectionVars]) -> Vec<Var> {
        let mut inputs = vec![self.clone()];
        for p in projections {
            inputs.push(p.weight.clone());
            inputs.extend(p.channel.map(Var::clone));
            inputs.extend(p.scalar.map(Var::clone));
        }
        inputs
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

/// Each projection's weight and modulators' current values.
fn projection_values(projections: &[GatedProjectionVars]) -> Vec<(Tensor, [Tensor; 5], [Tensor; 5])> {
    projections.iter().map(|p| (p.weight.value(), p.channel.map(Var::value), p.scalar.map(Var::value))).collect()
}

/// [`projection_values`] as the tensor-level op takes them.
fn borrowed(values: &[(Tensor, [Tensor; 5], [Tensor; 5])]) -> Vec<GatedProjection<'_>> {
    values
        .iter()
        .map(|(weight, channel, scalar)| GatedProjection {
            weight,
            channel: channel.each_ref(),
            scalar: scalar.each_ref(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use tensor::Rng;

    use super::*;
    use crate::gradcheck;

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
        if let Err(failure) = gradcheck(|v| call(v, Unary::Silu, true), &values) {
            panic!("{failure}");
        }
    }

    /// One projection's eleven parameters `[W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]`.
    fn projection(p: &[Var]) -> GatedProjectionVars<'_> {
        GatedProjectionVars {
            weight: &p[0],
            channel: [&p[1], &p[2], &p[3], &p[4], &p[5]],
            scalar: [&p[6], &p[7], &p[8], &p[9], &p[10]],
        }
    }

    /// A group is its projections one by one: outputs side by side, `dx` summed, the same
    /// parameter gradients (the CPU runs each projection's kernel in turn).
    #[test]
    fn a_group_is_its_projections_one_by_one() {
        let mut rng = Rng::new(7);
        let mut values = inputs(&mut rng, 4, 6, 5, 3, 2);
        values.extend(inputs(&mut rng, 4, 6, 9, 3, 2).into_iter().skip(1));
        let run = |grouped: bool| {
            let vars: Vec<Var> = values.iter().cloned().map(Var::parameter).collect();
            let (first, second) = (projection(&vars[1..12]), projection(&vars[12..23]));
            let y = if grouped {
                vars[0].fused_gated_projections(&[first, second], Unary::Silu, ProductOutput::F32).unwrap()
            } else {
                let each = |p: GatedProjectionVars| {
                    vars[0].fused_gated_projection(p.weight, p.channel, p.scalar, Unary::Silu).unwrap()
                };
                Var::cat(&[&each(first), &each(second)], 2).unwrap()
            };
            let seed = Tensor::rand_normal(&y.shape(), 0.0, 1.0, &mut Rng::new(9));
            y.backward_with(seed).unwrap();
            (y.value().to_vec(), vars.iter().map(|v| v.grad().unwrap().to_vec()).collect::<Vec<_>>())
        };
        let (grouped, alone) = (run(true), run(false));
        assert_eq!(grouped.0, alone.0, "forward differs");
        for (i, (g, a)) in grouped.1.iter().zip(&alone.1).enumerate() {
            let close = g.iter().zip(a).all(|(g, a)| (g - a).abs() <= 1e-5 + 1e-5 * a.abs());
            assert!(close, "gradient of input {i} differs: {g:?} vs {a:?}");
        }
    }

    #[test]
    fn a_group_passes_gradcheck() {
        let mut rng = Rng::new(8);
        let mut values = inputs(&mut rng, 2, 3, 4, 2, 1);
        values.extend(inputs(&mut rng, 2, 3, 2, 2, 1).into_iter().skip(1));
        let group = |v: &[Var]| {
            v[0].fused_gated_projections(
                &[projection(&v[1..12]), projection(&v[12..23])],
                Unary::Sigmoid,
                ProductOutput::F32,
            )
        };
        if let Err(failure) = gradcheck(group, &values) {
            panic!("{failure}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut rng = Rng::new(1);
        let mut values = inputs(&mut rng, 2, 4, 3, 2, 2);
        values[4] = Tensor::zeros(&[4, 2]);
        let vars: Vec<Var> = values.into_iter().map(Var::parameter).collect();
        let err = call(&vars, Unary::Sigmoid, true).unwrap_err();
        assert!(err.to_string().contains("fused_gated_projection"), "{err}");
    }
}
