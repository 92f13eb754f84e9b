//! The CUDA branch of `ops/fused_gate.rs`: the fused gated projection (Transponder eq. 8-10)
//! through `kernels::cuda::fused_gate`.
//!
//! The forward packs `[W; A_c; A_s]` into one bf16 buffer on every call (the weights change
//! after each optimizer step, and packing is one cheap conversion pass next to the GEMM),
//! converts `x` to bf16, and runs the tensor-core kernel, which also writes the f32 GEMM
//! output `ZU` for the backward. The backward reads `ZU`, the f32 `x` and the f32 weights.
//! The launchers take α_c and α_s as host floats: the forward reads both one-element
//! tensors back from the device (a wait for the queued work) and saves them for the backward.

use kernels::cuda::fused_gate::{
    fused_gate_backward, fused_gate_forward, pack_weight, DeviceFusedGateGrads, DeviceFusedGateParams, DeviceGateGrads,
    DeviceGateParams, FusedGateDims, Unary,
};

use super::CudaStorage;
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

/// Forward on the GPU: `(out, x as dense f32, ZU [N, K])`. `x` and the
/// parameters are contiguous and shape-checked by the caller.
#[allow(clippy::type_complexity)]
pub(crate) fn forward(
    dims: &FusedGateDims,
    x: &Tensor,
    weight: &Tensor,
    channel: &[Tensor],
    scalar: &[Tensor],
    phi: Unary,
    out_shape: &[usize],
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = x.cuda_device(OP)?;
    let (w, cv, sv) = (weight.to_dtype(DType::F32)?.dense()?, dense_f32(channel)?, dense_f32(scalar)?);
    let p =
        DeviceFusedGateParams { weight: w.cuda_f32(OP)?, channel: device_gate(&cv)?, scalar: device_gate(&sv)?, phi };
    // Rebuilt on every forward: the packed copy must follow the weights' current values.
    let packed = pack_weight(&dev, dims, &p)?;
    let x_bf16 = x.to_dtype(DType::BF16)?.dense()?;
    let x_bf16_buffer = x_bf16.cuda_storage().ok_or(Error::UnsupportedDevice { op: OP, device: x.device })?;
    let mut zu = CudaStorage::alloc(&dev, dims.rows * dims.width())?;
    let mut out = CudaStorage::alloc(&dev, dims.rows * dims.d_out)?;
    fused_gate_forward(
        &dev,
        dims,
        x_bf16_buffer.bf16_buffer(OP)?,
        &packed,
        &p,
        Some(zu.f32_buffer_mut(OP)?),
        out.f32_buffer_mut(OP)?,
    )?;
    let out = Tensor::from_cuda(out, out_shape)?;
    let zu = Tensor::from_cuda(zu, &[dims.rows, dims.width()])?;
    Ok((out, x.to_dtype(DType::F32)?.dense()?, zu))
}

/// Zeroed device gradients shaped like a modulator's five parameters.
fn zeros_like_all(dev: &std::sync::Arc<kernels::cuda::CudaDevice>, values: &[Tensor]) -> Result<Vec<CudaStorage>> {
    values.iter().map(|t| CudaStorage::zeros(dev, t.numel())).collect()
}

/// The five gradient buffers of one modulator, borrowed together.
fn device_grads(storages: &mut [CudaStorage]) -> Result<DeviceGateGrads<'_>> {
    let [a_weight, a_bias, b_weight, b_bias, alpha] = storages else {
        return Err(Error::InvalidShape {
            op: OP,
            shape: vec![storages.len()],
            reason: "five modulator gradients".into(),
        });
    };
    Ok(DeviceGateGrads {
        a_weight: a_weight.f32_buffer_mut(OP)?,
        a_bias: a_bias.f32_buffer_mut(OP)?,
        b_weight: b_weight.f32_buffer_mut(OP)?,
        b_bias: b_bias.f32_buffer_mut(OP)?,
        alpha: alpha.f32_buffer_mut(OP)?,
    })
}

/// Backward on the GPU: the twelve gradients in input order, from the forward's saved
/// dense f32 `x`, parameters and `ZU`, for the output gradient `dy`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dims: &FusedGateDims,
    x: &Tensor,
    weight: &Tensor,
    channel: &[Tensor],
    scalar: &[Tensor],
    phi: Unary,
    zu: &Tensor,
    dy: &Tensor,
) -> Result<Vec<Tensor>> {
    let dev = x.cuda_device(OP)?;
    let (x, zu, dy) = (x.dense()?, zu.dense()?, dy.dense()?);
    let (w, cv, sv) = (weight.to_dtype(DType::F32)?.dense()?, dense_f32(channel)?, dense_f32(scalar)?);
    let p =
        DeviceFusedGateParams { weight: w.cuda_f32(OP)?, channel: device_gate(&cv)?, scalar: device_gate(&sv)?, phi };
    let (mut dx, mut dw) = (CudaStorage::zeros(&dev, x.numel())?, CudaStorage::zeros(&dev, w.numel())?);
    let (mut dc, mut ds) = (zeros_like_all(&dev, &cv)?, zeros_like_all(&dev, &sv)?);
    {
        let mut grads = DeviceFusedGateGrads {
            x: dx.f32_buffer_mut(OP)?,
            weight: dw.f32_buffer_mut(OP)?,
            channel: device_grads(&mut dc)?,
            scalar: device_grads(&mut ds)?,
        };
        // d/dx, d/dW, d/dA, d/da, d/dB, d/db, d/dα: see kernels::cuda::fused_gate::fused_gate_backward
        fused_gate_backward(&dev, dims, x.cuda_f32(OP)?, &p, zu.cuda_f32(OP)?, dy.cuda_f32(OP)?, &mut grads)?;
    }
    let mut out = vec![Tensor::from_cuda(dx, x.shape())?, Tensor::from_cuda(dw, w.shape())?];
    for (g, t) in dc.into_iter().zip(&cv).chain(ds.into_iter().zip(&sv)) {
        out.push(Tensor::from_cuda(g, t.shape())?);
    }
    Ok(out)
}
