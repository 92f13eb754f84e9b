//! The fused gated projection of Transponder (eq. 8-10), forward and backward, on either
//! device. No autograd here: `autograd`'s `Var::fused_gated_projection` wires these two
//! functions into the graph.
//!
//! `Ẑ = (x·Wᵀ) ⊙ σ̃_αc(φ(x·A_cᵀ + a_c)·B_cᵀ + b_c) ⊙ σ̃_αs(φ(x·A_sᵀ + a_s)·B_sᵀ + b_s)`, with
//! `σ̃_α(z) = 2σ(αz)`. The forward is one GEMM over `[W | A_cᵀ | A_sᵀ]` and one pass over
//! rows (`kernels::cpu::fused_gate`; on the GPU `kernels::cuda::fused_gate`, a bf16
//! tensor-core GEMM with the gate in its epilogue). It saves `x`, the parameters (shared
//! views, no copies), the GEMM output `ZU` (`N × (d_out + r_c + r_s)`) and, on the CPU, the
//! modulators' rank-r results (on the GPU, the packed bf16 weight the GEMM read); backward
//! recomputes only the channel gate from them.
//! Modulator arguments are `[A, a, B, b, α]` in that order.

use kernels::cpu::fused_gate::{
    fused_gate_backward, fused_gate_forward, FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams,
};
use kernels::cpu::unary::Unary;

use crate::{with_last_dim, Error, Result, Tensor};

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
    /// The packed bf16 `[W; A_c; A_s]` the forward's GEMM read, which the backward's bf16
    /// products read too (the rest is recomputed from `ZU`).
    #[cfg(feature = "cuda")]
    Cuda { packed: std::sync::Arc<kernels::cuda::DeviceBuffer<half::bf16>> },
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
        let out_shape = with_last_dim(x.shape(), d_out);
        #[cfg(feature = "cuda")]
        if x.cuda_storage().is_some() {
            let forward = cuda::forward(&dims, &x, &w, &cv, &sv, phi, &out_shape)?;
            let (out, x, zu, packed) = forward;
            let extra = SavedExtra::Cuda { packed };
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
    /// its input. With `dx_so_far` (the gradient `x` has from the other ops that read it), the
    /// first entry is that plus this projection's `dx`: on the GPU the `dx` product adds onto
    /// `dx_so_far`'s buffer in place (β = 1) when it is its only owner.
    pub fn fused_gated_projection_backward(
        saved: &FusedGateSaved,
        dy: &Tensor,
        dx_so_far: Option<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let x = &saved.x;
        x.same_device(OP, dy)?;
        let y_shape = with_last_dim(x.shape(), saved.dims.d_out);
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
            SavedExtra::Cuda { packed } => {
                let FusedGateSaved { dims, x, weight, channel, scalar, phi, zu, .. } = saved;
                cuda::backward(dims, x, weight, channel, scalar, *phi, zu, packed, dy, dx_so_far)
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
    let (mut dx, mut dw) = (crate::pool::buffer(x.numel()), crate::pool::buffer(w.numel()));
    let (mut dc, mut ds) = (fresh_like_all(cv), fresh_like_all(sv));
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

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA branch of `ops/fused_gate.rs`: the fused gated projection (Transponder eq. 8-10)
    //! through `kernels::cuda::fused_gate`.
    //!
    //! The forward reads `[W; A_c; A_s]` as one packed bf16 buffer, which is the three weights'
    //! bf16 copy (`CudaStorage::shared_packed_bf16_copy`): packed once (one conversion launch)
    //! the first time, and after any write to a weight other than the optimizer's step; the
    //! step rewrites each weight's rows in place (AdamW writes the new values rounded beside
    //! the f32 ones), so a training step converts no weight. It converts `x` to bf16 (the
    //! copy its storage keeps, shared with the other projections of the same input), and runs
    //! one cuBLAS bf16 GEMM for the f32 `ZU` (kept for the backward) and the gate kernel.
    //! The backward reads `ZU`, the f32 `x` and the f32 weights; its products run in f32, or
    //! under bf16 products (`--bf16`) on the tensor cores from the same bf16 `x` and packed
    //! weight. α_c and α_s are read on the device by the kernels.

    use std::sync::Arc;

    use half::bf16;
    use kernels::cpu::matmul::Store;
    use kernels::cuda::fused_gate::{
        fused_gate_backward, fused_gate_forward_unfused, pack_weight, DeviceFusedGateGrads, DeviceFusedGateParams,
        DeviceGateGrads, DeviceGateParams, FusedGateDims, GateProducts, Unary,
    };
    use kernels::cuda::{CudaDevice, DeviceBuffer};

    use crate::cuda::CudaStorage;
    use crate::{DType, Error, Result, Tensor};

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

    /// Dense f32 copies (or the tensors themselves when already so) of every parameter.
    fn dense_f32(values: &[Tensor]) -> Result<Vec<Tensor>> {
        values.iter().map(|t| t.to_dtype(DType::F32)?.dense()).collect()
    }

    /// The packed bf16 `[W; A_c; A_s]` of the dense f32 weights `w`, `a_channel`, `a_scalar`
    /// (whose device buffers `p` holds): their shared bf16 copy when they have one, else
    /// packed now (one launch) and made their shared copy, for the next forwards and for the
    /// optimizer's step to rewrite.
    fn packed_weight(
        dev: &CudaDevice,
        dims: &FusedGateDims,
        [w, a_channel, a_scalar]: [&Tensor; 3],
        p: &DeviceFusedGateParams,
    ) -> Result<Arc<DeviceBuffer<bf16>>> {
        let members = [storage_of(w)?, storage_of(a_channel)?, storage_of(a_scalar)?];
        if let Some(packed) = CudaStorage::shared_packed_bf16_copy(&members) {
            return Ok(packed);
        }
        let packed = Arc::new(pack_weight(dev, dims, p)?);
        CudaStorage::share_packed_bf16_copy(&members, &packed);
        Ok(packed)
    }

    /// Forward on the GPU: `(out, x as dense f32, ZU [N, K], the packed bf16 weight)`. `x`
    /// and the parameters are contiguous and shape-checked by the caller.
    #[allow(clippy::type_complexity)]
    pub(crate) fn forward(
        dims: &FusedGateDims,
        x: &Tensor,
        weight: &Tensor,
        channel: &[Tensor],
        scalar: &[Tensor],
        phi: Unary,
        out_shape: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor, Arc<DeviceBuffer<bf16>>)> {
        let dev = x.cuda_device(OP)?;
        let (w, cv, sv) = (weight.to_dtype(DType::F32)?.dense()?, dense_f32(channel)?, dense_f32(scalar)?);
        let p = DeviceFusedGateParams {
            weight: w.cuda_f32(OP)?,
            channel: device_gate(&cv)?,
            scalar: device_gate(&sv)?,
            phi,
        };
        let packed = packed_weight(&dev, dims, [&w, &cv[0], &sv[0]], &p)?;
        let x_bf16 = x.to_dtype(DType::BF16)?.dense()?;
        let x_bf16_buffer = x_bf16.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: x.device })?;
        let mut zu = CudaStorage::alloc(&dev, dims.rows * dims.width())?;
        let mut out = CudaStorage::alloc(&dev, dims.rows * dims.d_out)?;
        // ZU from cuBLAS, then the gate kernel: measured 1.75x faster than the tensor-core kernel
        // with the gate in its epilogue (fused_gate_forward) on an H200 (cuda-bench, 131072 tokens,
        // 512 -> 512: 0.44 ms against 0.77 ms), whose main loop runs at a third of cuBLAS's speed.
        // Training saves Z and U for the backward, so the epilogue kernel's saving (not writing them)
        // does not apply here.
        fused_gate_forward_unfused(
            &dev,
            dims,
            x_bf16_buffer.bf16_buffer(OP)?,
            &packed,
            &p,
            zu.f32_buffer_mut(OP)?,
            out.f32_buffer_mut(OP)?,
        )?;
        let out = Tensor::from_cuda(out, out_shape)?;
        let zu = Tensor::from_cuda(zu, &[dims.rows, dims.width()])?;
        Ok((out, x.to_dtype(DType::F32)?.dense()?, zu, packed))
    }

    /// The device storage of a GPU tensor.
    fn storage_of(t: &Tensor) -> Result<&CudaStorage> {
        t.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: t.device })
    }

    /// Fresh device gradients shaped like a modulator's parameters after `A` (`[a, B, b, α]`:
    /// `dA` is part of the packed weight gradient), which the backward writes.
    fn fresh_like_rest(dev: &std::sync::Arc<kernels::cuda::CudaDevice>, values: &[Tensor]) -> Result<Vec<CudaStorage>> {
        values[1..].iter().map(|t| CudaStorage::alloc(dev, t.numel())).collect()
    }

    /// The four gradient buffers of one modulator after `dA`, borrowed together.
    fn device_grads(storages: &mut [CudaStorage]) -> Result<DeviceGateGrads<'_>> {
        let [a_bias, b_weight, b_bias, alpha] = storages else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: vec![storages.len()],
                reason: "four modulator gradients after dA".into(),
            });
        };
        Ok(DeviceGateGrads {
            a_bias: a_bias.f32_buffer_mut(OP)?,
            b_weight: b_weight.f32_buffer_mut(OP)?,
            b_bias: b_bias.f32_buffer_mut(OP)?,
            alpha: alpha.f32_buffer_mut(OP)?,
        })
    }

    /// Backward on the GPU: the twelve gradients in input order, from the forward's saved
    /// dense f32 `x`, parameters, `ZU` and packed bf16 weight, for the output gradient `dy`;
    /// `dx` is added onto `dx_so_far` (see [`Tensor::fused_gated_projection_backward`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        dims: &FusedGateDims,
        x: &Tensor,
        weight: &Tensor,
        channel: &[Tensor],
        scalar: &[Tensor],
        phi: Unary,
        zu: &Tensor,
        packed: &DeviceBuffer<bf16>,
        dy: &Tensor,
        dx_so_far: Option<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let dev = x.cuda_device(OP)?;
        let (x, zu, dy) = (x.dense()?, zu.dense()?, dy.dense()?);
        let (w, cv, sv) = (weight.to_dtype(DType::F32)?.dense()?, dense_f32(channel)?, dense_f32(scalar)?);
        let p = DeviceFusedGateParams {
            weight: w.cuda_f32(OP)?,
            channel: device_gate(&cv)?,
            scalar: device_gate(&sv)?,
            phi,
        };
        let bf16_products = crate::cuda::matmul_precision() == crate::cuda::MatmulPrecision::Bf16;
        // Under bf16 products the backward reads x in bf16 too: the copy the forward made.
        let x_bf16 = if bf16_products { Some(x.to_dtype(DType::BF16)?) } else { None };
        // dx goes onto the gradient so far in place when this op holds the only reference to
        // its whole f32 buffer; otherwise into a fresh buffer, added to the sum after.
        let mut dx_so_far = dx_so_far;
        let absorb = dx_so_far.as_mut().is_some_and(|so_far| {
            so_far.dtype() == DType::F32 && so_far.shape() == x.shape() && so_far.sole_dense_cuda_storage().is_some()
        });
        let mut dx_fresh = if absorb { None } else { Some(CudaStorage::alloc(&dev, x.numel())?) };
        // [dW; dA_c; dA_s] in one buffer, written by one product; each weight's gradient is a
        // view of its rows (the optimizer reads it in place).
        let mut weights_grad = CudaStorage::alloc(&dev, dims.width() * dims.d_in)?;
        let (mut dc, mut ds) = (fresh_like_rest(&dev, &cv)?, fresh_like_rest(&dev, &sv)?);
        {
            let (dx_buffer, x_store) = match (&mut dx_fresh, dx_so_far.as_mut()) {
                (Some(fresh), _) => (fresh.f32_buffer_mut(OP)?, Store::Overwrite),
                (None, Some(so_far)) => {
                    let storage = so_far.sole_dense_cuda_storage().expect("checked by `absorb`");
                    (storage.f32_buffer_mut(OP)?, Store::Accumulate)
                }
                (None, None) => unreachable!("absorb needs a gradient so far"),
            };
            let mut grads = DeviceFusedGateGrads {
                x: dx_buffer,
                x_store,
                weights: weights_grad.f32_buffer_mut(OP)?,
                channel: device_grads(&mut dc)?,
                scalar: device_grads(&mut ds)?,
            };
            // Under bf16 products (`--bf16`) the backward's products run on the tensor cores too,
            // reading the bf16 copy of x the forward made (the storage keeps it) and its packed
            // weight.
            let products = match &x_bf16 {
                Some(x_bf16) => GateProducts::Bf16 { x: storage_of(x_bf16)?.bf16_buffer(OP)?, packed },
                None => GateProducts::F32,
            };
            // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cuda::fused_gate::fused_gate_backward
            let (x, zu, dy) = (x.cuda_f32(OP)?, zu.cuda_f32(OP)?, dy.cuda_f32(OP)?);
            fused_gate_backward(&dev, dims, x, &p, zu, dy, products, &mut grads)?;
        }
        let dx = match (dx_fresh, dx_so_far) {
            (Some(fresh), None) => Tensor::from_cuda(fresh, x.shape())?,
            (Some(fresh), Some(so_far)) => so_far.accumulate(Tensor::from_cuda(fresh, x.shape())?)?,
            (None, Some(total)) => total,
            (None, None) => unreachable!("absorb needs a gradient so far"),
        };
        let weights_grad = Tensor::from_cuda(weights_grad, &[dims.width(), dims.d_in])?;
        let (d_out, rc) = (dims.d_out, dims.rank_channel);
        let rows_of = |at: usize, like: &Tensor| weights_grad.narrow(0, at, like.shape()[0]);
        let mut out = vec![dx, rows_of(0, &w)?];
        for (at, grads, values) in [(d_out, dc, &cv), (d_out + rc, ds, &sv)] {
            out.push(rows_of(at, &values[0])?);
            for (g, t) in grads.into_iter().zip(&values[1..]) {
                out.push(Tensor::from_cuda(g, t.shape())?);
            }
        }
        Ok(out)
    }
}
