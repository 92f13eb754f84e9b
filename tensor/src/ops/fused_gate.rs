//! The fused gated projection of Transponder (eq. 8-10), forward and backward, on either
//! device, for one projection or a group of projections of one input (q, k and v; gate and
//! up). No autograd here: `autograd`'s `Var::fused_gated_projection(s)` wires these two
//! functions into the graph.
//!
//! `Ẑ = (x·Wᵀ) ⊙ σ̃_αc(φ(x·A_cᵀ + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(x·A_sᵀ + a_s)·B_sᵀ + b_s)`, with
//! `σ̃_α(z) = 2σ(αz)`, for each projection; a group's outputs sit side by side along the last
//! dimension. On the CPU each projection is one GEMM over `[W | A_cᵀ | A_sᵀ]` and one pass over
//! rows (`kernels::cpu::fused_gate`); on the GPU the whole group is one bf16 tensor-core GEMM
//! over every projection's `[W; A_c; A_s]` packed together, and one gate kernel
//! (`kernels::cuda::fused_gate`). The forward saves `x`, the parameters (shared views, no
//! copies), the GEMM output `ZU` and, on the CPU, the modulators' rank-r results (on the GPU,
//! the packed bf16 weight the GEMM read); backward recomputes only the channel gate from them.
//! Modulator arguments are `[A, a, B, b, α]` in that order.

use kernels::cpu::fused_gate::{
    fused_gate_backward, fused_gate_forward, FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams,
};
use kernels::cpu::unary::Unary;

use super::{AddRmsNormOutput, ProductOutput};
use crate::{with_last_dim, Error, Result, Tensor};

const OP: &str = "fused_gated_projection";

/// One projection of a fused gated group: its weight `[d_out, d_in]` and its channel and
/// scalar modulators' `[A, a, B, b, α]` (`B: [d_out, r_c]` and `B: [1, r_s]`).
#[derive(Clone, Copy, Debug)]
pub struct GatedProjection<'a> {
    /// `W: [d_out, d_in]`.
    pub weight: &'a Tensor,
    /// The channel modulator's `[A, a, B, b, α]`.
    pub channel: [&'a Tensor; 5],
    /// The scalar modulator's `[A, a, B, b, α]`.
    pub scalar: [&'a Tensor; 5],
}

/// One projection's contiguous parameters, checked, with its sizes.
struct Checked {
    dims: FusedGateDims,
    weight: Tensor,
    channel: Vec<Tensor>,
    scalar: Vec<Tensor>,
}

/// What [`Tensor::fused_gated_projections`] keeps for its backward: the (contiguous) input,
/// every projection's parameters and sizes, and the device's own extras.
pub struct FusedGateSaved {
    projections: Vec<Checked>,
    x: Tensor,
    phi: Unary,
    extra: SavedExtra,
}

#[cfg(feature = "cuda")]
impl FusedGateSaved {
    /// What a GPU forward keeps: `x` as the backward reads it (only in its weight gradient's
    /// product: under bf16 products the bf16 copy alone is kept) and the forward's `state`.
    fn on_device(
        projections: Vec<Checked>,
        x: &Tensor,
        phi: Unary,
        state: cuda::DeviceState,
    ) -> Result<FusedGateSaved> {
        let (zu, packed) = state;
        let x = x.to_dtype(crate::DType::F32)?.dense()?.saved_for_products();
        Ok(FusedGateSaved { projections, x, phi, extra: SavedExtra::Cuda { zu, packed } })
    }
}

/// The device-specific part of [`FusedGateSaved`].
enum SavedExtra {
    /// Each projection's GEMM output `ZU` and the CPU kernel's rank-r results.
    Cpu(Vec<(Tensor, kernels::cpu::fused_gate::FusedGateSaved)>),
    /// The group's GEMM output `ZU` (`[N, K]`, every projection's columns in turn; bf16 under
    /// bf16 products, as autocast saves a product) and the packed bf16 weight it read, which
    /// the backward's bf16 products read too.
    #[cfg(feature = "cuda")]
    Cuda { zu: kernels::cuda::DeviceValues, packed: std::sync::Arc<kernels::cuda::DeviceBuffer<half::bf16>> },
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

/// Checks one projection of `x: [..., d_in]`: devices, shapes, and (in a group) the first
/// projection's ranks.
fn check_projection(x: &Tensor, p: &GatedProjection, first: Option<&Checked>) -> Result<Checked> {
    x.same_device(OP, p.weight)?;
    let weight = p.weight.contiguous()?;
    let (d_out, d_in) = match (weight.shape(), x.shape().last()) {
        (&[o, i], Some(&xi)) if i == xi => (o, i),
        _ => return Err(Error::ShapeMismatch { op: OP, lhs: x.shape().to_vec(), rhs: weight.shape().to_vec() }),
    };
    if d_in == 0 || d_out == 0 {
        return Err(Error::InvalidShape {
            op: OP,
            shape: weight.shape().to_vec(),
            reason: "the projection needs d_in > 0 and d_out > 0".into(),
        });
    }
    let (channel, rank_channel) = modulator_values(x, p.channel, d_in, d_out)?;
    let (scalar, rank_scalar) = modulator_values(x, p.scalar, d_in, 1)?;
    let dims = FusedGateDims { rows: x.numel() / d_in, d_in, d_out, rank_channel, rank_scalar };
    if let Some(first) = first {
        if (rank_channel, rank_scalar) != (first.dims.rank_channel, first.dims.rank_scalar) {
            return Err(Error::InvalidShape {
                op: OP,
                shape: vec![rank_channel, rank_scalar],
                reason: format!(
                    "the projections of a group share their ranks ({} and {} first)",
                    first.dims.rank_channel, first.dims.rank_scalar
                ),
            });
        }
    }
    Ok(Checked { dims, weight, channel, scalar })
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

/// Fresh gradient buffers shaped like a modulator's five parameters (the backward writes them).
fn fresh_like_all(v: &[Tensor]) -> Vec<Vec<f32>> {
    v.iter().map(|t| crate::pool::buffer(t.numel())).collect()
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
        self.fused_gated_projections(&[GatedProjection { weight, channel, scalar }], phi, ProductOutput::F32)
    }

    /// [`Tensor::fused_gated_projection`] of `self` by each of `projections` (one φ and one
    /// pair of ranks for all), the outputs side by side: `[..., Σ d_out]`, stored as `output`
    /// says (bf16 only on a GPU under bf16 products). On a GPU the group is one GEMM and one
    /// gate launch forward, and its backward one launch of each kind.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn fused_gated_projections(
        &self,
        projections: &[GatedProjection],
        phi: Unary,
        output: ProductOutput,
    ) -> Result<(Tensor, FusedGateSaved)> {
        let (x, checked) = self.checked_group(projections)?;
        let total: usize = checked.iter().map(|p| p.dims.d_out).sum();
        let out_shape = with_last_dim(x.shape(), total);
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            let (out, state) = cuda::forward(&x, &checked, phi, &out_shape, output)?;
            return Ok((out, FusedGateSaved::on_device(checked, &x, phi, state)?));
        }
        let mut outs = Vec::with_capacity(checked.len());
        let mut saved = Vec::with_capacity(checked.len());
        for p in &checked {
            let dims = p.dims;
            let (mut zu, mut out) =
                (crate::pool::buffer(dims.rows * dims.width()), crate::pool::buffer(dims.rows * dims.d_out));
            let host = {
                let params = FusedGateParams {
                    weight: p.weight.as_slice()?,
                    channel: gate_params(&p.channel)?,
                    scalar: gate_params(&p.scalar)?,
                    phi,
                };
                fused_gate_forward(&dims, x.as_slice()?, &params, &mut zu, &mut out)
            };
            saved.push((Tensor::from_vec(zu, &[dims.rows, dims.width()])?, host));
            outs.push(Tensor::from_vec(out, &with_last_dim(x.shape(), dims.d_out))?);
        }
        let out = match outs.as_slice() {
            [single] => single.clone(),
            _ => Tensor::cat(&outs.iter().collect::<Vec<_>>(), x.shape().len() - 1)?,
        };
        Ok((out.reshape(&out_shape)?, FusedGateSaved { projections: checked, x, phi, extra: SavedExtra::Cpu(saved) }))
    }

    /// Attention's gated q, k and v: [`Tensor::fused_gated_projections`] of `self: [B, T, d_in]`
    /// by three projections of one width `heads·D`, then [`Tensor::rope_qkv`] of the packed
    /// output, `(R q, R k, v)`, each `[B, T, H, D]`, with what the group's backward reads
    /// ([`Tensor::fused_gated_projection_backward`] of the packed output's gradient, which
    /// [`Tensor::rotary_attention_backward_packed`] gives). On a GPU under bf16 products, for a
    /// head dim attention's tensor cores take, the gate kernel writes the three itself, q and k
    /// rotated before they are rounded to bf16: the GEMM and one launch, where the two ops take
    /// three. Elsewhere the two ops run in turn (the packed output in bf16 where that applies).
    pub fn fused_gated_rope_qkv(
        &self,
        projections: &[GatedProjection; 3],
        phi: Unary,
        heads: usize,
        theta: f32,
    ) -> Result<(Tensor, Tensor, Tensor, FusedGateSaved)> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let (x, checked) = self.checked_group(projections)?;
            if let Some(((q, k, v), state)) = cuda::forward_rotary_qkv(&x, &checked, phi, heads, theta)? {
                return Ok((q, k, v, FusedGateSaved::on_device(checked, &x, phi, state)?));
            }
        }
        let (packed, saved) = self.fused_gated_projections(projections, phi, ProductOutput::Bf16)?;
        let (q, k, v) = Tensor::rope_qkv(&packed, heads, theta)?;
        Ok((q, k, v, saved))
    }

    /// The FFN's gated gate and up projections: [`Tensor::fused_gated_projections`] of
    /// `self: [..., d_in]` by two projections of one width F, then [`Tensor::swiglu_halves`] of
    /// the output: `(y [..., F], the gated output [..., 2F], what the group's backward reads)`
    /// (the gated output is what [`Tensor::swiglu_halves_backward`] reads). On a GPU under bf16
    /// products the gate kernel writes both (the GEMM and one launch, where the two ops take
    /// three, and the same bits); elsewhere the two ops run in turn.
    pub fn fused_gated_swiglu(
        &self,
        projections: &[GatedProjection; 2],
        phi: Unary,
    ) -> Result<(Tensor, Tensor, FusedGateSaved)> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() {
            let (x, checked) = self.checked_group(projections)?;
            if let Some(((y, gated), state)) = cuda::forward_swiglu(&x, &checked, phi)? {
                return Ok((y, gated, FusedGateSaved::on_device(checked, &x, phi, state)?));
            }
        }
        let (gated, saved) = self.fused_gated_projections(projections, phi, ProductOutput::Bf16)?;
        Ok((gated.swiglu_halves()?, gated, saved))
    }

    /// A gated output projection (Transponder's o and down: one projection) and the residual
    /// stream's add and next RMSNorm as one op: `Ẑ` = [`Tensor::fused_gated_projections`] of
    /// `self: [..., d_in]` by `projection`, stored in bf16, then [`Tensor::add_rms_norm`] of
    /// `stream` (`[..., d_out]`, as many rows) and `Ẑ`: `(its output, what the group's backward
    /// reads)`. On a GPU under bf16 products one launch after the GEMM gates each row, adds it
    /// and normalises the sum, without storing `Ẑ` (the same bits as the two ops, one launch
    /// fewer); `None` elsewhere, where the caller runs the two ops.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn fused_gated_add_rms_norm(
        &self,
        projection: &GatedProjection,
        phi: Unary,
        stream: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<Option<(AddRmsNormOutput, FusedGateSaved)>> {
        #[cfg(feature = "cuda")]
        if self.cuda_storage().is_some() && crate::cuda::matmul_precision() == crate::cuda::MatmulPrecision::Bf16 {
            let (x, checked) = self.checked_group(std::slice::from_ref(projection))?;
            let (out, state) = cuda::forward_add_rms_norm(&x, &checked, phi, stream, weight, eps)?;
            return Ok(Some((out, FusedGateSaved::on_device(checked, &x, phi, state)?)));
        }
        Ok(None)
    }

    /// `self` made contiguous, and each of `projections` checked against it and the first
    /// (one φ's inputs, one pair of ranks): a group of at least one.
    fn checked_group(&self, projections: &[GatedProjection]) -> Result<(Tensor, Vec<Checked>)> {
        let x = self.contiguous()?;
        let mut checked: Vec<Checked> = Vec::with_capacity(projections.len());
        for p in projections {
            let projection = check_projection(&x, p, checked.first())?;
            checked.push(projection);
        }
        if checked.is_empty() {
            return Err(Error::InvalidShape { op: OP, shape: vec![0], reason: "a group of no projections".into() });
        }
        Ok((x, checked))
    }

    /// The backward of [`Tensor::fused_gated_add_rms_norm`] for the normalised output's
    /// gradient `dy`, from the forward's `sum`, the norm's `weight` and `rstd`, and what the
    /// group saved: `(d sum, d weight, the group's gradients)`, `d sum` with `dsum_so_far` (the
    /// gradient the sum has from the later residual add) added in the norm's pass, the group's
    /// gradients those of [`Tensor::fused_gated_projection_backward`] of `d sum`. The same
    /// values as [`Tensor::rms_norm_backward`] then that; on the GPU the norm's weight gradient
    /// is finished in the gate's column-sum launch (one launch fewer, the same bits).
    pub fn fused_gated_add_rms_norm_backward(
        saved: &FusedGateSaved,
        (sum, weight, rstd): (&Tensor, &Tensor, &Tensor),
        dy: &Tensor,
        dsum_so_far: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
        const NORM: &str = "fused_gated_add_rms_norm_backward";
        let dims = sum.rms_norm_backward_dims(NORM, weight, rstd, dy, dsum_so_far)?;
        let cols = dims.cols;
        let output_shape = with_last_dim(saved.x.shape(), cols);
        match &saved.extra {
            #[cfg(feature = "cuda")]
            SavedExtra::Cuda { zu, packed } => {
                let grads_of = (dy, dsum_so_far);
                let (dsum, partials) =
                    super::norm::cuda::rms_norm_backward_partial(sum, weight, rstd, grads_of, &dims)?;
                let mut dw = crate::cuda::CudaStorage::alloc(&sum.cuda_device(NORM)?, cols)?;
                let dy = dsum.reshape(&output_shape)?;
                let finish = (&partials, dw.f32_buffer_mut(NORM)?);
                let grads = cuda::backward(saved, zu, packed, cuda::GradSource::Direct(&dy), None, Some(finish))?;
                Ok((dsum, Tensor::from_cuda(dw, &[cols])?, grads))
            }
            SavedExtra::Cpu(_) => {
                let (dsum, dw) = Tensor::rms_norm_backward(sum, weight, rstd, dy, dsum_so_far)?;
                let grads = Tensor::fused_gated_projection_backward(saved, &dsum.reshape(&output_shape)?, None)?;
                Ok((dsum, dw, grads))
            }
        }
    }

    /// The backward of [`Tensor::fused_gated_projections`] for the output gradient `dy`:
    /// `dx`, then each projection's `[dW, dA_c, da_c, dB_c, db_c, dα_c, dA_s, da_s, dB_s, db_s,
    /// dα_s]`, each shaped like its input. With `dx_so_far` (the gradient `x` has from the
    /// other ops that read it), the first entry is that plus this group's `dx`: on the GPU the
    /// `dx` product adds onto `dx_so_far`'s buffer in place (β = 1) when it is its only owner.
    /// On the GPU the weights' gradients are views of one buffer (one product writes them).
    pub fn fused_gated_projection_backward(
        saved: &FusedGateSaved,
        dy: &Tensor,
        dx_so_far: Option<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let x = &saved.x;
        x.same_device(OP, dy)?;
        let total: usize = saved.projections.iter().map(|p| p.dims.d_out).sum();
        let y_shape = with_last_dim(x.shape(), total);
        if dy.shape() != y_shape {
            return Err(Error::ShapeMismatch { op: OP, lhs: y_shape, rhs: dy.shape().to_vec() });
        }
        match &saved.extra {
            SavedExtra::Cpu(host) => {
                let mut grads = cpu_backward(saved, host, dy)?;
                if let Some(so_far) = dx_so_far {
                    let dx = grads.remove(0);
                    grads.insert(0, so_far.accumulate(dx)?);
                }
                Ok(grads)
            }
            #[cfg(feature = "cuda")]
            SavedExtra::Cuda { zu, packed } => {
                cuda::backward(saved, zu, packed, cuda::GradSource::Direct(dy), dx_so_far, None)
            }
        }
    }

    /// The backward of [`Tensor::fused_gated_swiglu`] for SwiGLU's output gradient `dy`
    /// (`[..., F]`), from the forward's gated output `gated` (`[..., 2F]`) and saved state:
    /// [`Tensor::swiglu_halves_backward`], then [`Tensor::fused_gated_projection_backward`] of
    /// its result, and the same values. On a GPU under bf16 products (a bf16 ZU, `gated` and
    /// `dy` held in bf16, as the forward and the down product's backward write them) the
    /// gate's row kernel computes SwiGLU's backward itself: one launch and one `[..., 2F]`
    /// gradient fewer, the same bits.
    pub fn fused_gated_swiglu_backward(
        saved: &FusedGateSaved,
        gated: &Tensor,
        dy: &Tensor,
        dx_so_far: Option<Tensor>,
    ) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if let SavedExtra::Cuda { zu, packed } = &saved.extra {
            if cuda::swiglu_in_gate(saved, zu, gated, dy) {
                let source = cuda::GradSource::Swiglu { dy, gated };
                return cuda::backward(saved, zu, packed, source, dx_so_far, None);
            }
        }
        let dgated = Tensor::swiglu_halves_backward(gated, dy)?;
        Tensor::fused_gated_projection_backward(saved, &dgated, dx_so_far)
    }
}

/// The CPU backward: `kernels::cpu::fused_gate::fused_gate_backward` of each projection, on
/// its columns of `dy`, into fresh buffers; `dx` summed over the projections in their order.
fn cpu_backward(
    saved: &FusedGateSaved,
    host: &[(Tensor, kernels::cpu::fused_gate::FusedGateSaved)],
    dy: &Tensor,
) -> Result<Vec<Tensor>> {
    let FusedGateSaved { projections, x, phi, .. } = saved;
    let last = x.shape().len() - 1;
    let mut dx_total: Option<Tensor> = None;
    let mut out = Vec::with_capacity(1 + 11 * projections.len());
    let mut at = 0;
    for (p, (zu, kernel_saved)) in projections.iter().zip(host) {
        let Checked { dims, weight: w, channel: cv, scalar: sv } = p;
        let dy_part = dy.narrow(last, at, dims.d_out)?.contiguous()?;
        at += dims.d_out;
        let (mut dx, mut dw) = (crate::pool::buffer(x.numel()), crate::pool::buffer(w.numel()));
        let (mut dc, mut ds) = (fresh_like_all(cv), fresh_like_all(sv));
        let params =
            FusedGateParams { weight: w.as_slice()?, channel: gate_params(cv)?, scalar: gate_params(sv)?, phi: *phi };
        let mut grads =
            FusedGateGrads { x: &mut dx, weight: &mut dw, channel: gate_grads(&mut dc)?, scalar: gate_grads(&mut ds)? };
        // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cpu::fused_gate::fused_gate_backward
        let mut dzu = crate::pool::buffer(zu.numel());
        let (x_values, zu_values, dy_values) = (x.as_slice()?, zu.as_slice()?, dy_part.as_slice()?);
        fused_gate_backward(dims, x_values, &params, zu_values, kernel_saved, dy_values, &mut dzu, &mut grads);
        crate::pool::recycle(dzu);
        let dx = Tensor::from_vec(dx, x.shape())?;
        dx_total = Some(match dx_total {
            Some(sum) => sum.accumulate(dx)?,
            None => dx,
        });
        out.push(Tensor::from_vec(dw, w.shape())?);
        for (g, t) in dc.into_iter().zip(cv).chain(ds.into_iter().zip(sv)) {
            out.push(Tensor::from_vec(g, t.shape())?);
        }
    }
    out.insert(0, dx_total.expect("a group has a projection (checked by the forward)"));
    Ok(out)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/fused_gate.rs`: a group of fused gated projections of one input
    //! (Transponder eq. 8-10) through `kernels::cuda::fused_gate`.
    //!
    //! The forward reads every projection's `[W; A_c; A_s]` as one packed bf16 buffer, which is
    //! the weights' shared bf16 copy (`CudaStorage::shared_packed_bf16_copy`): packed once (one
    //! conversion launch) the first time, and after any write to a weight other than the
    //! optimizer's step; the step rewrites each weight's rows in place (AdamW writes the new
    //! values rounded beside the f32 ones), so a training step converts no weight. It converts
    //! `x` to bf16 (the copy its storage keeps), and runs one cuBLAS bf16 GEMM for `ZU` (kept
    //! for the backward; written in bf16 under bf16 products, as autocast keeps a product's
    //! output, else f32) and one gate launch. The backward reads `ZU`, the f32 `x` and
    //! the f32 weights; its products run in f32, or under bf16 products (`--bf16`) on the
    //! tensor cores from the same bf16 `x` and packed weight. The α's are read on the device.

    use std::sync::Arc;

    use half::bf16;
    use kernels::cpu::matmul::Store;
    use kernels::cuda::fused_gate::{
        fused_gate_backward_with_norm, fused_gate_forward_add_rms_norm, fused_gate_forward_rotary_qkv,
        fused_gate_forward_swiglu, fused_gate_forward_unfused, pack_weight, DeviceFusedGateGrads,
        DeviceFusedGateParams, DeviceGateGrads, DeviceGateParams, GateGroup, GateProducts, OutputGrad, ResidualNorm,
        RotaryQkv, Unary,
    };
    use kernels::cuda::norm::RmsNormWeightPartials;
    use kernels::cuda::{CudaDevice, DeviceBuffer, DeviceValues, Values, ValuesMut};

    use super::{AddRmsNormOutput, Checked, FusedGateSaved, ProductOutput};
    use crate::cuda::{product_only_output, CudaStorage};
    use crate::{with_last_dim, DType, Error, Result, Tensor};

    const OP: &str = "fused_gated_projection";

    /// One modulator's `[A, a, B, b, α]` as device buffers (each a dense f32 tensor).
    fn device_gate(values: &[Tensor]) -> Result<DeviceGateParams<'_>> {
        Ok(DeviceGateParams {
            a_weight: values[0].cuda_f32(OP)?,
            a_bias: values[1].cuda_f32(OP)?,
            b_weight: values[2].cuda_f32(OP)?,
            b_bias: values[3].cuda_f32(OP)?,
            alpha: values[4].cuda_f32(OP)?,
        })
    }

    /// A projection's parameters as dense f32 device tensors (the tensors themselves when
    /// already so): `[W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]`.
    fn dense_f32(p: &Checked) -> Result<Vec<Tensor>> {
        let all = std::iter::once(&p.weight).chain(&p.channel).chain(&p.scalar);
        all.map(|t| t.to_dtype(DType::F32)?.dense()).collect()
    }

    /// The group's launcher view of `dense` ([`dense_f32`] of each projection).
    fn groups<'a>(projections: &[Checked], dense: &'a [Vec<Tensor>], phi: Unary) -> Result<Vec<GateGroup<'a>>> {
        projections
            .iter()
            .zip(dense)
            .map(|(p, d)| {
                let params = DeviceFusedGateParams {
                    weight: d[0].cuda_f32(OP)?,
                    channel: device_gate(&d[1..6])?,
                    scalar: device_gate(&d[6..11])?,
                    phi,
                };
                Ok(GateGroup { dims: p.dims, params })
            })
            .collect()
    }

    /// The packed bf16 weight of a group (each projection's `[W; A_c; A_s]` in turn), from the
    /// dense f32 parameters `dense`: the weights' shared bf16 copy when they have one, else
    /// packed now (one launch) and made their shared copy, for the next forwards and for the
    /// optimizer's step to rewrite.
    fn packed_weight(dev: &CudaDevice, dense: &[Vec<Tensor>], group: &[GateGroup]) -> Result<Arc<DeviceBuffer<bf16>>> {
        let members: Vec<&CudaStorage> =
            dense.iter().flat_map(|d| [&d[0], &d[1], &d[6]]).map(storage_of).collect::<Result<_>>()?;
        if let Some(packed) = CudaStorage::shared_packed_bf16_copy(&members) {
            return Ok(packed);
        }
        let packed = Arc::new(pack_weight(dev, group)?);
        CudaStorage::share_packed_bf16_copy(&members, &packed);
        Ok(packed)
    }

    /// What a GPU forward hands its backward: the GEMM output `ZU` (`[N, K]`) and the packed
    /// bf16 weight it read.
    pub(super) type DeviceState = (DeviceValues, Arc<DeviceBuffer<bf16>>);

    /// What a group's GEMM reads: every projection's dense f32 parameters ([`dense_f32`]), whose
    /// packed bf16 copy is its weight operand, and `x` in bf16.
    struct GemmInputs {
        dense: Vec<Vec<Tensor>>,
        x_bf16: Tensor,
    }

    impl GemmInputs {
        fn new(x: &Tensor, projections: &[Checked]) -> Result<GemmInputs> {
            let dense = projections.iter().map(dense_f32).collect::<Result<Vec<_>>>()?;
            Ok(GemmInputs { dense, x_bf16: x.to_dtype(DType::BF16)?.dense()? })
        }

        /// The launchers' view of the group ([`groups`]) and its packed bf16 weight.
        fn group(
            &self,
            dev: &CudaDevice,
            projections: &[Checked],
            phi: Unary,
        ) -> Result<(Vec<GateGroup<'_>>, Arc<DeviceBuffer<bf16>>)> {
            let group = groups(projections, &self.dense, phi)?;
            let packed = packed_weight(dev, &self.dense, &group)?;
            Ok((group, packed))
        }

        /// `x`'s bf16 values.
        fn x_bf16(&self) -> Result<&DeviceBuffer<bf16>> {
            storage_of(&self.x_bf16)?.bf16_buffer(OP)
        }
    }

    /// Forward on the GPU: `(out, (ZU [N, K], the packed bf16 weight))`, `ZU` in
    /// bf16 under bf16 products, and `out` too when `output` asks for it. `x` and the
    /// parameters are contiguous and shape-checked by the caller.
    pub(super) fn forward(
        x: &Tensor,
        projections: &[Checked],
        phi: Unary,
        out_shape: &[usize],
        output: ProductOutput,
    ) -> Result<(Tensor, DeviceState)> {
        let dev = x.cuda_device(OP)?;
        let inputs = GemmInputs::new(x, projections)?;
        let (group, packed) = inputs.group(&dev, projections, phi)?;
        let bf16_products = crate::cuda::matmul_precision() == crate::cuda::MatmulPrecision::Bf16;
        let mut zu = new_zu(&dev, projections, bf16_products)?;
        let out_len = out_shape.iter().product();
        // ZU from cuBLAS, then the gate kernel: measured 1.75x faster than the tensor-core kernel
        // with the gate in its epilogue (fused_gate_forward) on an H200 (cuda-bench, 131072 tokens,
        // 512 -> 512: 0.44 ms against 0.77 ms), whose main loop runs at a third of cuBLAS's speed.
        // Training saves Z and U for the backward, so the epilogue kernel's saving (not writing them)
        // does not apply here.
        let mut out = CudaStorage::alloc_values(&dev, out_len, bf16_products && output == ProductOutput::Bf16)?;
        fused_gate_forward_unfused(&dev, &group, inputs.x_bf16()?, &packed, &mut zu, out.values_mut(OP)?)?;
        let out = Tensor::from_cuda(out, out_shape)?;
        Ok((out, (zu, packed)))
    }

    /// `Tensor::fused_gated_rope_qkv` on the GPU where the gate kernel writes q, k and v
    /// itself (bf16 products and a head dim attention's tensor cores take: attention then
    /// reads them in bf16, as `rope_qkv` writes them there): `((R q, R k, v), its
    /// [`DeviceState`])`; `None` elsewhere. `x: [B, T, d_in]` and the three
    /// projections are contiguous and shape-checked by the caller.
    #[allow(clippy::type_complexity)]
    pub(super) fn forward_rotary_qkv(
        x: &Tensor,
        projections: &[Checked],
        phi: Unary,
        heads: usize,
        theta: f32,
    ) -> Result<Option<((Tensor, Tensor, Tensor), DeviceState)>> {
        let &[batch, seq, _] = x.shape() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: x.shape().to_vec(),
                reason: "expected [B, T, d_in]".into(),
            });
        };
        let width = projections[0].dims.d_out;
        let same_width = projections.iter().all(|p| p.dims.d_out == width);
        if heads == 0 || !same_width || !width.is_multiple_of(heads) || !(width / heads).is_multiple_of(2) {
            return Err(Error::InvalidShape {
                op: OP,
                shape: x.shape().to_vec(),
                reason: format!("{heads} heads must split q, k and v's width {width} into even head dims"),
            });
        }
        let head_dim = width / heads;
        if !crate::ops::attention::cuda::reads_bf16_inputs(head_dim) || seq == 0 {
            return Ok(None);
        }
        let dev = x.cuda_device(OP)?;
        let inputs = GemmInputs::new(x, projections)?;
        let (group, packed) = inputs.group(&dev, projections, phi)?;
        let mut zu = new_zu(&dev, projections, true)?;
        let table = crate::ops::rope::cuda::table(&dev, seq, head_dim, theta)?;
        let alloc = || CudaStorage::alloc_values(&dev, batch * seq * width, true);
        let (mut q, mut k, mut v) = (alloc()?, alloc()?, alloc()?);
        let outs = [rounded_buffer(&mut q)?, rounded_buffer(&mut k)?, rounded_buffer(&mut v)?];
        let rope = RotaryQkv { seq, head_dim, cos: &table.cos, sin: &table.sin, outs };
        fused_gate_forward_rotary_qkv(&dev, &group, inputs.x_bf16()?, &packed, &mut zu, rope)?;
        let shape = [batch, seq, heads, head_dim];
        let qkv = (Tensor::from_cuda(q, &shape)?, Tensor::from_cuda(k, &shape)?, Tensor::from_cuda(v, &shape)?);
        Ok(Some((qkv, (zu, packed))))
    }

    /// `Tensor::fused_gated_swiglu` on the GPU where the gate kernel writes SwiGLU too (bf16
    /// products): `((y, the gated output), its [`DeviceState`])`, both
    /// outputs in bf16 alone; `None` elsewhere. `x` and the two projections are contiguous and
    /// shape-checked by the caller.
    pub(super) fn forward_swiglu(
        x: &Tensor,
        projections: &[Checked],
        phi: Unary,
    ) -> Result<Option<((Tensor, Tensor), DeviceState)>> {
        let width = projections[0].dims.d_out;
        if projections.iter().any(|p| p.dims.d_out != width) {
            let reason = "the gate and up projections differ in width".into();
            return Err(Error::InvalidShape { op: OP, shape: x.shape().to_vec(), reason });
        }
        if crate::cuda::matmul_precision() != crate::cuda::MatmulPrecision::Bf16 {
            return Ok(None);
        }
        let dev = x.cuda_device(OP)?;
        let inputs = GemmInputs::new(x, projections)?;
        let (group, packed) = inputs.group(&dev, projections, phi)?;
        let mut zu = new_zu(&dev, projections, true)?;
        let rows = projections[0].dims.rows;
        let mut gated = CudaStorage::alloc_values(&dev, rows * 2 * width, true)?;
        let mut y = CudaStorage::alloc_values(&dev, rows * width, true)?;
        let (gated_buffer, y_buffer) = (rounded_buffer(&mut gated)?, rounded_buffer(&mut y)?);
        fused_gate_forward_swiglu(&dev, &group, inputs.x_bf16()?, &packed, &mut zu, gated_buffer, y_buffer)?;
        let outputs = (
            Tensor::from_cuda(y, &with_last_dim(x.shape(), width))?,
            Tensor::from_cuda(gated, &with_last_dim(x.shape(), 2 * width))?,
        );
        Ok(Some((outputs, (zu, packed))))
    }

    /// The bf16 buffer a storage from `CudaStorage::alloc_values(.., true)` is held as.
    /// `Tensor::fused_gated_add_rms_norm` on the GPU under bf16 products: the add and norm's
    /// output (the normalised sum in bf16 alone: the next products read it) and the
    /// projection's [`DeviceState`]. `x` and the projection (a group of one) are contiguous and
    /// shape-checked by the caller; `stream` and `weight` are checked here.
    pub(super) fn forward_add_rms_norm(
        x: &Tensor,
        projections: &[Checked],
        phi: Unary,
        stream: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(AddRmsNormOutput, DeviceState)> {
        let dims = projections[0].dims;
        let (rows, d_out) = (dims.rows, dims.d_out);
        if stream.shape().last() != Some(&d_out) || stream.numel() != rows * d_out {
            return Err(Error::ShapeMismatch { op: OP, lhs: vec![rows, d_out], rhs: stream.shape().to_vec() });
        }
        stream.check_weight(OP, Some(weight), d_out)?;
        x.same_device(OP, stream)?;
        let dev = x.cuda_device(OP)?;
        let inputs = GemmInputs::new(x, projections)?;
        let (group, packed) = inputs.group(&dev, projections, phi)?;
        let mut zu = new_zu(&dev, projections, true)?;
        let (stream_values, weight) = (stream.dense()?, weight.dense()?);
        let (mut sum, mut rstd) = (CudaStorage::alloc(&dev, rows * d_out)?, CudaStorage::alloc(&dev, rows)?);
        // y feeds only the next products (attention, FFN): bf16 alone under bf16 products.
        let y = product_only_output(&dev, OP, stream.shape(), |y| {
            let norm = ResidualNorm {
                x: stream_values.cuda_f32(OP)?,
                weight: weight.cuda_f32(OP)?,
                eps,
                sum: sum.f32_buffer_mut(OP)?,
                y,
                rstd: rstd.f32_buffer_mut(OP)?,
            };
            Ok(fused_gate_forward_add_rms_norm(&dev, &group, inputs.x_bf16()?, &packed, &mut zu, norm)?)
        })?;
        let sum = Tensor::from_cuda(sum, stream.shape())?;
        let out = AddRmsNormOutput { sum, y, rstd: Tensor::from_cuda(rstd, &[rows])? };
        Ok((out, (zu, packed)))
    }

    fn rounded_buffer(storage: &mut CudaStorage) -> Result<&mut DeviceBuffer<bf16>> {
        match storage.values_mut(OP)? {
            ValuesMut::Bf16(buffer) => Ok(buffer),
            ValuesMut::F32(_) => Err(Error::DTypeMismatch { op: OP, expected: DType::BF16, got: DType::F32 }),
        }
    }

    /// A group's GEMM output `ZU` (`[N, K]`), in bf16 under bf16 products.
    fn new_zu(dev: &Arc<CudaDevice>, projections: &[Checked], bf16: bool) -> Result<DeviceValues> {
        let width: usize = projections.iter().map(|p| p.dims.width()).sum();
        Ok(DeviceValues::alloc(dev, projections[0].dims.rows * width, bf16)?)
    }

    /// The device storage of a GPU tensor.
    fn storage_of(t: &Tensor) -> Result<&CudaStorage> {
        t.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: t.device })
    }

    /// Fresh device gradients shaped like a modulator's `[a, b, α]` (`values` is its
    /// `[A, a, B, b, α]`; `dA` and `dB` are parts of packed buffers), which the backward writes.
    fn fresh_biases(dev: &Arc<CudaDevice>, values: &[Tensor]) -> Result<[CudaStorage; 3]> {
        Ok([
            CudaStorage::alloc(dev, values[1].numel())?,
            CudaStorage::alloc(dev, values[3].numel())?,
            CudaStorage::alloc(dev, values[4].numel())?,
        ])
    }

    /// The three gradient buffers of one modulator's `[a, b, α]`, borrowed together.
    fn device_grads([a_bias, b_bias, alpha]: &mut [CudaStorage; 3]) -> Result<DeviceGateGrads<'_>> {
        Ok(DeviceGateGrads {
            a_bias: a_bias.f32_buffer_mut(OP)?,
            b_bias: b_bias.f32_buffer_mut(OP)?,
            alpha: alpha.f32_buffer_mut(OP)?,
        })
    }

    /// What a GPU backward starts from.
    pub(super) enum GradSource<'a> {
        /// The group's output gradient `dẐ`.
        Direct(&'a Tensor),
        /// SwiGLU's output gradient `dy` and the gate and up group's gated output `gated`,
        /// both held in bf16 ([`swiglu_in_gate`]): the row kernel computes `dẐ` from them.
        Swiglu { dy: &'a Tensor, gated: &'a Tensor },
    }

    /// Whether the gate's row kernel can compute SwiGLU's backward for
    /// [`Tensor::fused_gated_swiglu_backward`]: a bf16 ZU (bf16 products), and `gated` and
    /// `dy` of the group's shapes, dense and held as bf16 alone on ZU's device (the values
    /// SwiGLU's backward would read).
    pub(super) fn swiglu_in_gate(saved: &FusedGateSaved, zu: &DeviceValues, gated: &Tensor, dy: &Tensor) -> bool {
        let dense_bf16 = |t: &Tensor| {
            t.device() == saved.x.device() && t.dense_storage(OP).is_ok_and(|s| s.bf16_backing().is_some())
        };
        let total: usize = saved.projections.iter().map(|p| p.dims.d_out).sum();
        let shapes = gated.shape() == with_last_dim(saved.x.shape(), total)
            && dy.shape() == with_last_dim(saved.x.shape(), total / 2);
        zu.values().is_bf16() && saved.projections.len() == 2 && shapes && dense_bf16(gated) && dense_bf16(dy)
    }

    /// Backward on the GPU: `dx`, then each projection's eleven gradients in input order,
    /// from the forward's saved dense f32 `x`, parameters, `ZU` and packed bf16 weight, for
    /// the output gradient `source`; `dx` is added onto `dx_so_far` (see
    /// [`Tensor::fused_gated_projection_backward`]).
    pub(super) fn backward(
        saved: &FusedGateSaved,
        zu: &DeviceValues,
        packed: &DeviceBuffer<bf16>,
        source: GradSource,
        dx_so_far: Option<Tensor>,
        norm: Option<(&RmsNormWeightPartials, &mut DeviceBuffer<f32>)>,
    ) -> Result<Vec<Tensor>> {
        let FusedGateSaved { projections, x, phi, .. } = saved;
        let dev = x.cuda_device(OP)?;
        let (dy, gated) = match source {
            GradSource::Direct(dy) => (dy, None),
            GradSource::Swiglu { dy, gated } => (dy, Some(gated.dense()?)),
        };
        let (x, dy) = (x.dense()?, dy.dense()?);
        let dense = projections.iter().map(dense_f32).collect::<Result<Vec<_>>>()?;
        let group = groups(projections, &dense, *phi)?;
        let bf16_products = crate::cuda::matmul_precision() == crate::cuda::MatmulPrecision::Bf16;
        // Under bf16 products the backward reads x in bf16 too: the copy the forward made.
        let x_bf16 = if bf16_products { Some(x.to_dtype(DType::BF16)?) } else { None };
        // dx goes onto the gradient so far in place when this op holds the only reference to
        // its whole f32 buffer; otherwise into a fresh buffer, added to the sum after. As x's
        // only gradient under bf16 products it is bf16 alone, as autocast keeps a bf16 product
        // input's gradient (its readers, RMSNorm's, SwiGLU's and attention's backward, read
        // bf16; any other widens it on demand).
        let mut dx_so_far = dx_so_far;
        let absorb = dx_so_far.as_mut().is_some_and(|so_far| {
            so_far.dtype() == DType::F32 && so_far.shape() == x.shape() && so_far.sole_dense_cuda_storage().is_some()
        });
        let dx_bf16 = bf16_products && dx_so_far.is_none();
        let mut dx_fresh = if absorb { None } else { Some(CudaStorage::alloc_values(&dev, x.numel(), dx_bf16)?) };
        // Every weight's gradient in one buffer, written by one product; each is a view of its
        // rows (the optimizer reads it in place).
        let width: usize = projections.iter().map(|p| p.dims.width()).sum();
        let d_in = projections[0].dims.d_in;
        let mut weights_grad = CudaStorage::alloc(&dev, width * d_in)?;
        // Every B_c's gradient in one buffer and every B_s's in another, views likewise.
        let out_width: usize = projections.iter().map(|p| p.dims.d_out).sum();
        let (rc, rs) = (projections[0].dims.rank_channel, projections[0].dims.rank_scalar);
        let mut b_channel_grad = CudaStorage::alloc(&dev, out_width * rc)?;
        let mut b_scalar_grad = CudaStorage::alloc(&dev, projections.len() * rs)?;
        let mut modulator_grads = Vec::with_capacity(projections.len());
        for d in &dense {
            modulator_grads.push((fresh_biases(&dev, &d[1..6])?, fresh_biases(&dev, &d[6..11])?));
        }
        {
            let (dx_buffer, x_store) = match (&mut dx_fresh, dx_so_far.as_mut()) {
                (Some(fresh), _) => (fresh.values_mut(OP)?, Store::Overwrite),
                (None, Some(so_far)) => {
                    let storage = so_far.sole_dense_cuda_storage().expect("checked by `absorb`");
                    (ValuesMut::F32(storage.f32_buffer_mut(OP)?), Store::Accumulate)
                }
                (None, None) => unreachable!("absorb needs a gradient so far"),
            };
            let (mut channel, mut scalar) = (Vec::new(), Vec::new());
            for (c, s) in &mut modulator_grads {
                channel.push(device_grads(c)?);
                scalar.push(device_grads(s)?);
            }
            let mut grads = DeviceFusedGateGrads {
                x: dx_buffer,
                x_store,
                weights: weights_grad.f32_buffer_mut(OP)?,
                b_channel: b_channel_grad.f32_buffer_mut(OP)?,
                b_scalar: b_scalar_grad.f32_buffer_mut(OP)?,
                channel,
                scalar,
            };
            // Under bf16 products (`--bf16`) the backward's products run on the tensor cores too,
            // reading the bf16 copy of x the forward made (the storage keeps it) and its packed
            // weight.
            let products = match &x_bf16 {
                Some(x_bf16) => GateProducts::Bf16 { x: storage_of(x_bf16)?.bf16_buffer(OP)?, packed },
                None => GateProducts::F32 { x: x.cuda_f32(OP)? },
            };
            // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cuda::fused_gate::fused_gate_backward
            // dẐ beside a bf16 ZU in bf16 where its producer keeps it so: bf16 alone (SwiGLU's or
            // RoPE's backward under bf16 products), or the bf16 copy written beside an f32
            // gradient (RMSNorm's backward of a residual stream's sum, which the o and down
            // projections' dẐ is); else f32.
            let dy_bf16 = zu.values().is_bf16() && storage_of(&dy)?.has_own_bf16_copy();
            let dy_copy = if dy_bf16 { Some(dy.to_dtype(DType::BF16)?) } else { None };
            let dy_values = match &dy_copy {
                Some(copy) => Values::Bf16(storage_of(copy)?.bf16_buffer(OP)?),
                None => Values::F32(dy.cuda_f32(OP)?),
            };
            let dout = match &gated {
                None => OutputGrad::Direct(dy_values),
                Some(gated) => match (dy_values, gated.cuda_values(OP)?) {
                    (Values::Bf16(dout), Values::Bf16(gated)) => OutputGrad::Swiglu { dout, gated },
                    _ => unreachable!("checked by swiglu_in_gate"),
                },
            };
            fused_gate_backward_with_norm(&dev, &group, zu, dout, products, &mut grads, norm)?;
        }
        let dx = match (dx_fresh, dx_so_far) {
            (Some(fresh), None) => Tensor::from_cuda(fresh, x.shape())?,
            (Some(fresh), Some(so_far)) => so_far.accumulate(Tensor::from_cuda(fresh, x.shape())?)?,
            (None, Some(total)) => total,
            (None, None) => unreachable!("absorb needs a gradient so far"),
        };
        let weights_grad = Tensor::from_cuda(weights_grad, &[width, d_in])?;
        let b_channel_grad = Tensor::from_cuda(b_channel_grad, &[out_width, rc])?;
        let b_scalar_grad = Tensor::from_cuda(b_scalar_grad, &[projections.len(), rs])?;
        let mut out = vec![dx];
        let (mut at, mut out_at) = (0, 0);
        for (i, ((p, d), (channel, scalar))) in projections.iter().zip(&dense).zip(modulator_grads).enumerate() {
            // This projection's rows of the packed gradients: dW, dA_c and dA_s of the weights',
            // dB_c of the channel B's, dB_s of the scalar B's.
            let d_out = p.dims.d_out;
            let [da_c, db_c, dalpha_c] = channel;
            let [da_s, db_s, dalpha_s] = scalar;
            out.extend([
                weights_grad.narrow(0, at, d_out)?,
                weights_grad.narrow(0, at + d_out, rc)?,
                Tensor::from_cuda(da_c, d[2].shape())?,
                b_channel_grad.narrow(0, out_at, d_out)?,
                Tensor::from_cuda(db_c, d[4].shape())?,
                Tensor::from_cuda(dalpha_c, d[5].shape())?,
                weights_grad.narrow(0, at + d_out + rc, rs)?,
                Tensor::from_cuda(da_s, d[7].shape())?,
                b_scalar_grad.narrow(0, i, 1)?,
                Tensor::from_cuda(db_s, d[9].shape())?,
                Tensor::from_cuda(dalpha_s, d[10].shape())?,
            ]);
            at += p.dims.width();
            out_at += d_out;
        }
        Ok(out)
    }
}
