//! GPU timings of the fused gated projection (Transponder eq. 8-10) against the bare cuBLAS
//! GEMM of the same shape (`x·[W; A_c; A_s]ᵀ`, the floor) and the unfused path (that GEMM
//! into `ZU`, then the gate kernel), at the llama-60m / llama-130m projection shapes; the FFN's
//! gate and up projections as two GEMMs or one of the packed weights, and gated, with SwiGLU
//! after the gate or in its kernel; q, k and v as three
//! fused gated projections or one fused group, and that group against its bare products, and
//! its q, k and v rotated by RoPE after it or in its gate kernel; the o and down projections'
//! gate then the residual add and RMSNorm, or those in the gate's launch; then flash attention,
//! forward and forward + backward (the time per layer of a training step), against the naive
//! kernel that materialises the score matrix, and its backward into the packed QKV gradient
//! with RoPE's backward after it or in its kernels, and RoPE's forward before it or in its
//! kernels (the packed product read unrotated); and the residual add + RMSNorm and RMSNorm's
//! backward against the CPU's results, timed against a device copy of as many bytes; and the
//! LM head's fused cross-entropy over one chunk of bf16 logits (the loss and its gradient
//! written over them), timed against a copy of the bytes it reads and writes.
//!
//! Run: `cargo run --release -p kernels --features cuda --bin cuda-bench [-- --tokens N]`
//! (default N = 512·256 = 131 072 tokens; the attention batches are N/2048 and N/4096
//! sequences of 256). Each figure is the best of several timed runs after a warm-up. Every
//! line checks its results first, as llm.c's `dev/cuda` does: the fused output against the
//! unfused one, flash attention against the naive kernel; a disagreement ends the run with
//! exit status 1 before any time is printed.

use std::time::Instant;

use half::bf16;
use kernels::cpu;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::cross_entropy::CrossEntropyDims;
use kernels::cpu::matmul::{GemmDims, Store};
use kernels::cpu::rope::{rope_table, RopeDims};
use kernels::cuda::attention::{
    causal_attention_backward, causal_attention_backward_packed, causal_attention_forward, causal_attention_naive,
    rotary_causal_attention_forward_packed, tensor_cores_fit, AttentionPrecision, QkvInputs,
};
use kernels::cuda::blas::{matmul_bf16, matmul_bf16_out, DeviceMat};
use kernels::cuda::fused_gate::{
    fused_gate_backward, fused_gate_forward, fused_gate_forward_add_rms_norm, fused_gate_forward_rotary_qkv,
    fused_gate_forward_swiglu, fused_gate_forward_unfused, pack_weight, DeviceFusedGateGrads, DeviceFusedGateParams,
    DeviceGateGrads, DeviceGateParams, FusedGateDims, GateGroup, GateProducts, OutputGrad, ResidualNorm, RotaryQkv,
    Unary,
};
use kernels::cuda::norm::{add_rms_norm_forward, rms_norm_backward, NormDims, NormGrads};
use kernels::cuda::rope::{rope_qkv_backward, rope_qkv_forward};
use kernels::cuda::softmax::cross_entropy_forward_backward;
use kernels::cuda::swiglu::{swiglu_backward, swiglu_forward, swiglu_halves_backward, swiglu_halves_forward};
use kernels::cuda::{CudaDevice, DeviceBuffer, Result};
use kernels::cuda::{DeviceValues, Values, ValuesMut};

/// Timed repetitions per measurement; the best is reported.
const REPEATS: usize = 5;
/// Calls per timed repetition.
const CALLS: usize = 10;

/// A bf16 buffer's values, widened to f32 on the host.
fn download_widened(dev: &CudaDevice, buffer: &DeviceBuffer<bf16>) -> Result<Vec<f32>> {
    Ok(dev.download(buffer)?.iter().map(|v| v.to_f32()).collect())
}

/// Ends the run (status 1) unless `got` is within `tolerance` of `want` relative to the
/// largest `|want|`; returns that worst relative difference.
fn check(what: &str, got: &[f32], want: &[f32], tolerance: f32) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let worst =
        got.iter()
            .zip(want)
            .fold(0.0f32, |m, (a, b)| if a.is_nan() != b.is_nan() { f32::INFINITY } else { m.max((a - b).abs()) });
    let relative = worst / scale;
    if relative > tolerance {
        eprintln!(
            "cuda-bench: {what} disagrees with its reference: max relative difference {relative:.2e} > {tolerance:.0e}"
        );
        std::process::exit(1);
    }
    relative
}

/// Deterministic pseudo-random values in [-bound, bound).
fn values(len: usize, seed: u64, bound: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
        })
        .collect()
}

/// Best seconds per call of `f` (synchronised), after one warm-up call.
fn best_seconds(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..REPEATS {
        let start = Instant::now();
        for _ in 0..CALLS {
            f()?;
        }
        dev.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64() / CALLS as f64);
    }
    Ok(best)
}

/// Best seconds of a device-to-device copy that moves `bytes_moved` bytes (reads half of
/// them, writes the other half): the floor a memory-bound kernel moving as many is timed
/// against.
fn copy_seconds(dev: &CudaDevice, bytes_moved: usize) -> Result<f64> {
    let floats = bytes_moved / 2 / 4;
    let (src, mut dst) = (dev.alloc::<f32>(floats)?, dev.alloc::<f32>(floats)?);
    best_seconds(dev, || dev.copy_within_device(&src, 0, &mut dst, 0, floats))
}

fn tokens_from_args() -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--tokens")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("--tokens takes a number"))
        .unwrap_or(512 * 256)
}

/// The parameters of one projection on the device.
struct Projection {
    w: DeviceBuffer<f32>,
    channel: [DeviceBuffer<f32>; 5],
    scalar: [DeviceBuffer<f32>; 5],
}

impl Projection {
    fn new(dev: &CudaDevice, dims: &FusedGateDims) -> Result<Projection> {
        let FusedGateDims { d_in, d_out, rank_channel: rc, rank_scalar: rs, .. } = *dims;
        let bound = 1.0 / (d_in as f32).sqrt();
        let up = |len: usize, seed: u64, bound: f32| dev.upload(&values(len, seed, bound));
        Ok(Projection {
            w: up(d_out * d_in, 1, bound)?,
            channel: [
                up(rc * d_in, 2, bound)?,
                up(rc, 3, 0.5)?,
                up(d_out * rc, 4, 1.0)?,
                up(d_out, 5, 0.5)?,
                dev.upload(&[1.0f32])?,
            ],
            scalar: [
                up(rs * d_in, 6, bound)?,
                up(rs, 7, 0.5)?,
                up(rs, 8, 1.0)?,
                up(1, 9, 0.5)?,
                dev.upload(&[1.0f32])?,
            ],
        })
    }

    fn params(&self) -> DeviceFusedGateParams<'_> {
        let gate = gate_params;
        DeviceFusedGateParams {
            weight: &self.w,
            channel: gate(&self.channel),
            scalar: gate(&self.scalar),
            phi: Unary::Sigmoid,
        }
    }
}

/// One modulator's parameters `[A, a, B, b, α]`.
fn gate_params(p: &[DeviceBuffer<f32>; 5]) -> DeviceGateParams<'_> {
    DeviceGateParams { a_weight: &p[0], a_bias: &p[1], b_weight: &p[2], b_bias: &p[3], alpha: &p[4] }
}

fn bench_projection(dev: &CudaDevice, tokens: usize, d_in: usize, d_out: usize) -> Result<()> {
    let dims = FusedGateDims { rows: tokens, d_in, d_out, rank_channel: 8, rank_scalar: 8 };
    let projection = Projection::new(dev, &dims)?;
    let p = projection.params();
    let group = [GateGroup { dims, params: p }];
    let packed = pack_weight(dev, &group)?;
    let x: Vec<bf16> = values(tokens * d_in, 10, 2.0).into_iter().map(bf16::from_f32).collect();
    let x = dev.upload(&x)?;
    // As a --bf16 training step runs them: ZU saved in bf16, Ẑ in bf16 for its consumer.
    let mut zu = DeviceValues::alloc(dev, tokens * dims.width(), true)?;
    let mut zu_mma = dev.alloc::<bf16>(tokens * dims.width())?;
    let mut floor = dev.alloc::<bf16>(tokens * dims.width())?;
    let mut out = dev.alloc::<bf16>(tokens * d_out)?;
    let mut out_ref = dev.alloc::<bf16>(tokens * d_out)?;

    fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, ValuesMut::Bf16(&mut out_ref))?;
    fused_gate_forward(dev, &dims, &x, &packed, &p, None, ValuesMut::Bf16(&mut out))?;
    let what = format!("fused projection {d_in}→{d_out}");
    // The unfused path gates ZU rounded to bf16 (the copy it saves), the mma kernel the f32 sums.
    let worst = check(&what, &download_widened(dev, &out)?, &download_widened(dev, &out_ref)?, 1e-2);

    // The floor: the bare product ZU = x·[W; A_c; A_s]ᵀ, bf16 in, bf16 out (a plain projection
    // under bf16 products).
    let x_mat = DeviceMat { buffer: &x, offset: 0, row_stride: d_in, col_stride: 1 };
    let weight_t = DeviceMat { buffer: &packed, offset: 0, row_stride: 1, col_stride: d_in };
    let (k, n) = (d_in, dims.width());
    let gemm = GemmDims { m: tokens, n, k };
    let gemm_s = best_seconds(dev, || matmul_bf16_out(dev, &mut floor, x_mat, weight_t, gemm))?;
    let unfused_s = best_seconds(dev, || {
        fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, ValuesMut::Bf16(&mut out_ref))
    })?;
    let fused_save_s = best_seconds(dev, || {
        fused_gate_forward(dev, &dims, &x, &packed, &p, Some(&mut zu_mma), ValuesMut::Bf16(&mut out))
    })?;
    let fused_s =
        best_seconds(dev, || fused_gate_forward(dev, &dims, &x, &packed, &p, None, ValuesMut::Bf16(&mut out)))?;
    let flops = 2.0 * tokens as f64 * dims.width() as f64 * d_in as f64;
    let tflops = |s: f64| flops / s / 1e12;
    println!(
        "{d_in:>5}→{d_out:<5} {tokens:>7} tokens | bare GEMM {:>7.3} ms ({:>5.1} TFLOP/s) | unfused {:>7.3} ms ({:.2}× GEMM) \
         | fused+save {:>7.3} ms ({:.2}×) | fused {:>7.3} ms ({:.2}×, {:>5.1} TFLOP/s) | max rel diff {worst:.1e}",
        gemm_s * 1e3,
        tflops(gemm_s),
        unfused_s * 1e3,
        unfused_s / gemm_s,
        fused_save_s * 1e3,
        fused_save_s / gemm_s,
        fused_s * 1e3,
        fused_s / gemm_s,
        tflops(fused_s),
    );
    Ok(())
}

/// The FFN's gate and up projections (`d → hidden`) under bf16 products, as the engine ran them
/// (two GEMMs, SwiGLU of two tensors) against one GEMM of the packed `[W_gate; W_up]` and SwiGLU
/// of its halves (`Var::packed_linear`, `Var::swiglu_halves`): the forward, and the backward's
/// SwiGLU with the input gradient's products (the weight gradients are two GEMMs either way).
fn bench_gate_up(dev: &CudaDevice, tokens: usize, d: usize, hidden: usize) -> Result<()> {
    let upload_bf16 = |len: usize, seed: u64, bound: f32| {
        dev.upload(&values(len, seed, bound).into_iter().map(bf16::from_f32).collect::<Vec<_>>())
    };
    let x = upload_bf16(tokens * d, 20, 2.0)?;
    // [W_gate; W_up] back to back: the separate weights are its two halves.
    let packed = upload_bf16(2 * hidden * d, 21, 1.0 / (d as f32).sqrt())?;
    let dh = dev.upload(&values(tokens * hidden, 22, 1.0))?;
    let x_mat = DeviceMat { buffer: &x, offset: 0, row_stride: d, col_stride: 1 };
    // Wᵀ of the rows from `first` ([d, rows]), and W itself ([rows, d]).
    let weight_t = |first: usize| DeviceMat { buffer: &packed, offset: first * d, row_stride: 1, col_stride: d };
    let weight = |first: usize| DeviceMat { buffer: &packed, offset: first * d, row_stride: d, col_stride: 1 };
    let alloc = |len: usize| dev.alloc::<f32>(len);
    let (mut g, mut u, mut gu) = (alloc(tokens * hidden)?, alloc(tokens * hidden)?, alloc(tokens * 2 * hidden)?);
    let (mut h_two, mut h_one) = (alloc(tokens * hidden)?, alloc(tokens * hidden)?);
    // The backward's gradients in bf16 alone, as training writes them under bf16 products.
    let (mut dg16, mut du16) = (dev.alloc::<bf16>(tokens * hidden)?, dev.alloc::<bf16>(tokens * hidden)?);
    let mut dgu16 = dev.alloc::<bf16>(tokens * 2 * hidden)?;
    let (mut dx_two, mut dx_one) = (alloc(tokens * d)?, alloc(tokens * d)?);
    let projection = GemmDims { m: tokens, n: hidden, k: d };
    let mut forward_two = || -> Result<()> {
        matmul_bf16(dev, &mut g, 0, x_mat, weight_t(0), projection, Store::Overwrite)?;
        matmul_bf16(dev, &mut u, 0, x_mat, weight_t(hidden), projection, Store::Overwrite)?;
        swiglu_forward(dev, &g, &u, (ValuesMut::F32(&mut h_two), None))
    };
    forward_two()?;
    let forward_two_s = best_seconds(dev, &mut forward_two)?;
    let mut forward_one = || -> Result<()> {
        let both = GemmDims { m: tokens, n: 2 * hidden, k: d };
        matmul_bf16(dev, &mut gu, 0, x_mat, weight_t(0), both, Store::Overwrite)?;
        swiglu_halves_forward(dev, Values::F32(&gu), hidden, (ValuesMut::F32(&mut h_one), None))
    };
    let forward_one_s = best_seconds(dev, &mut forward_one)?;
    let what = format!("packed gate-up {d}→{hidden}");
    let worst_h = check(&format!("{what} forward"), &dev.download(&h_one)?, &dev.download(&h_two)?, 1e-3);
    let input_grad = GemmDims { m: tokens, n: d, k: hidden };
    fn lhs(buffer: &DeviceBuffer<bf16>, row_stride: usize) -> DeviceMat<'_, bf16> {
        DeviceMat { buffer, offset: 0, row_stride, col_stride: 1 }
    }
    let backward_two_s = best_seconds(dev, || {
        swiglu_backward(dev, &g, &u, &dh, ValuesMut::Bf16(&mut dg16), ValuesMut::Bf16(&mut du16))?;
        matmul_bf16(dev, &mut dx_two, 0, lhs(&dg16, hidden), weight(0), input_grad, Store::Overwrite)?;
        matmul_bf16(dev, &mut dx_two, 0, lhs(&du16, hidden), weight(hidden), input_grad, Store::Accumulate)
    })?;
    let backward_one_s = best_seconds(dev, || {
        swiglu_halves_backward(dev, Values::F32(&gu), Values::F32(&dh), hidden, ValuesMut::Bf16(&mut dgu16))?;
        let both = GemmDims { m: tokens, n: d, k: 2 * hidden };
        matmul_bf16(dev, &mut dx_one, 0, lhs(&dgu16, 2 * hidden), weight(0), both, Store::Overwrite)
    })?;
    let worst_dx = check(&format!("{what} dx"), &dev.download(&dx_one)?, &dev.download(&dx_two)?, 1e-3);
    println!(
        "gate-up {d:>5}→{hidden:<5} {tokens:>7} tokens | forward: two GEMMs {:>7.3} ms, packed {:>7.3} ms ({:.2}×) \
         | backward (SwiGLU + dx): two {:>7.3} ms, packed {:>7.3} ms ({:.2}×) | max rel diff {:.1e}",
        forward_two_s * 1e3,
        forward_one_s * 1e3,
        forward_one_s / forward_two_s,
        backward_two_s * 1e3,
        backward_one_s * 1e3,
        backward_one_s / backward_two_s,
        worst_h.max(worst_dx),
    );
    Ok(())
}

/// Gradient buffers of one gated group's backward (`fused_gate_backward`'s outputs).
struct GroupGrads {
    x: DeviceBuffer<f32>,
    weights: DeviceBuffer<f32>,
    b_channel: DeviceBuffer<f32>,
    b_scalar: DeviceBuffer<f32>,
    /// Each projection's `[da, db, dα]` of its channel and its scalar modulator.
    modulators: Vec<[[DeviceBuffer<f32>; 3]; 2]>,
}

impl GroupGrads {
    fn new(dev: &CudaDevice, group: &[GateGroup]) -> Result<GroupGrads> {
        let d = group[0].dims;
        let (width, out_width): (usize, usize) =
            (group.iter().map(|g| g.dims.width()).sum(), group.iter().map(|g| g.dims.d_out).sum());
        let alloc = |len: usize| dev.alloc::<f32>(len);
        let mut modulators = Vec::new();
        for g in group {
            let channel = [alloc(d.rank_channel)?, alloc(g.dims.d_out)?, alloc(1)?];
            modulators.push([channel, [alloc(d.rank_scalar)?, alloc(1)?, alloc(1)?]]);
        }
        Ok(GroupGrads {
            x: alloc(d.rows * d.d_in)?,
            weights: alloc(width * d.d_in)?,
            b_channel: alloc(out_width * d.rank_channel)?,
            b_scalar: alloc(group.len() * d.rank_scalar)?,
            modulators,
        })
    }

    /// The launcher's view of the buffers.
    fn device(&mut self) -> DeviceFusedGateGrads<'_> {
        let (mut channel, mut scalar) = (Vec::new(), Vec::new());
        for [[ca, cb, calpha], [sa, sb, salpha]] in &mut self.modulators {
            channel.push(DeviceGateGrads { a_bias: ca, b_bias: cb, alpha: calpha });
            scalar.push(DeviceGateGrads { a_bias: sa, b_bias: sb, alpha: salpha });
        }
        DeviceFusedGateGrads {
            x: ValuesMut::F32(&mut self.x),
            x_store: Store::Overwrite,
            weights: &mut self.weights,
            b_channel: &mut self.b_channel,
            b_scalar: &mut self.b_scalar,
            channel,
            scalar,
        }
    }
}

/// q, k and v (`d → d` each, ranks 8 + 8) as three fused gated projections, each its own GEMM
/// and gate launches, against one fused group (one GEMM and one gate launch forward, one of
/// each kind backward: how the engine runs them now), forward and backward under bf16
/// products; and the group against the bare products of its shape, the measure (goal:
/// forward ≤ 1.3× the bare GEMM `x·packedᵀ`, forward + backward ≤ 1.5× that GEMM with the
/// backward's `dx = dZU·packed` and `dW = dZUᵀ·x`).
fn bench_gate_group(dev: &CudaDevice, tokens: usize, d: usize) -> Result<()> {
    let dims = FusedGateDims { rows: tokens, d_in: d, d_out: d, rank_channel: 8, rank_scalar: 8 };
    let projections = [Projection::new(dev, &dims)?, Projection::new(dev, &dims)?, Projection::new(dev, &dims)?];
    let group: Vec<GateGroup> = projections.iter().map(|p| GateGroup { dims, params: p.params() }).collect();
    let singles: Vec<[GateGroup; 1]> = group.iter().map(|&g| [g]).collect();
    let packed = pack_weight(dev, &group)?;
    let packed_singles = singles.iter().map(|single| pack_weight(dev, single)).collect::<Result<Vec<_>>>()?;
    let x16 = dev.upload(&values(tokens * d, 30, 2.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>())?;
    let (width, k) = (dims.width(), 3 * dims.width());
    let (mut zu, mut out) = (DeviceValues::alloc(dev, tokens * k, true)?, dev.alloc::<f32>(tokens * 3 * d)?);
    let mut zu_singles = (0..3).map(|_| DeviceValues::alloc(dev, tokens * width, true)).collect::<Result<Vec<_>>>()?;
    let mut floor = dev.alloc::<f32>(tokens * k)?;
    let mut out_singles = (0..3).map(|_| dev.alloc::<f32>(tokens * d)).collect::<Result<Vec<_>>>()?;
    // dẐ in bf16, as RoPE's backward writes q, k and v's under bf16 products.
    let upload_bf16 =
        |len, seed| dev.upload(&values(len, seed, 1.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>());
    let (dout, dout_single) = (upload_bf16(tokens * 3 * d, 31)?, upload_bf16(tokens * d, 31)?);

    let mut forward_three = || -> Result<()> {
        for (i, single) in singles.iter().enumerate() {
            let (zu, out) = (&mut zu_singles[i], &mut out_singles[i]);
            fused_gate_forward_unfused(dev, single, &x16, &packed_singles[i], zu, ValuesMut::F32(out))?;
        }
        Ok(())
    };
    let forward_three_s = best_seconds(dev, &mut forward_three)?;
    let forward_group_s = best_seconds(dev, || {
        fused_gate_forward_unfused(dev, &group, &x16, &packed, &mut zu, ValuesMut::F32(&mut out))
    })?;
    // The group's output is the three outputs side by side (checked before any time is printed).
    let grouped = dev.download(&out)?;
    let first: Vec<f32> = grouped.chunks(3 * d).flat_map(|row| row[..d].to_vec()).collect();
    let worst = check(&format!("gated group of 3 × {d}→{d}"), &first, &dev.download(&out_singles[0])?, 1e-5);
    let mut grads = GroupGrads::new(dev, &group)?;
    let mut grads_singles = singles.iter().map(|single| GroupGrads::new(dev, single)).collect::<Result<Vec<_>>>()?;
    let backward_three_s = best_seconds(dev, || {
        for i in 0..3 {
            let products = GateProducts::Bf16 { x: &x16, packed: &packed_singles[i] };
            let zu = &zu_singles[i];
            let dout = OutputGrad::Direct(Values::Bf16(&dout_single));
            fused_gate_backward(dev, &singles[i], zu, dout, products, &mut grads_singles[i].device())?;
        }
        Ok(())
    })?;
    let backward_group_s = best_seconds(dev, || {
        let products = GateProducts::Bf16 { x: &x16, packed: &packed };
        let dout = OutputGrad::Direct(Values::Bf16(&dout));
        fused_gate_backward(dev, &group, &zu, dout, products, &mut grads.device())
    })?;

    // The floor: the bare products of the group's shape (bf16 in, f32 out).
    let x_mat = DeviceMat { buffer: &x16, offset: 0, row_stride: d, col_stride: 1 };
    let packed_t = DeviceMat { buffer: &packed, offset: 0, row_stride: 1, col_stride: d };
    let packed_rows = DeviceMat { buffer: &packed, offset: 0, row_stride: d, col_stride: 1 };
    let dzu = dev.upload(&values(tokens * k, 32, 1.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>())?;
    let dzu_rows = DeviceMat { buffer: &dzu, offset: 0, row_stride: k, col_stride: 1 };
    let dzu_t = DeviceMat { buffer: &dzu, offset: 0, row_stride: 1, col_stride: k };
    let (mut dx, mut dw) = (dev.alloc::<f32>(tokens * d)?, dev.alloc::<f32>(k * d)?);
    let gemm_s = best_seconds(dev, || {
        matmul_bf16(dev, &mut floor, 0, x_mat, packed_t, GemmDims { m: tokens, n: k, k: d }, Store::Overwrite)
    })?;
    let gemms_s = best_seconds(dev, || {
        matmul_bf16(dev, &mut floor, 0, x_mat, packed_t, GemmDims { m: tokens, n: k, k: d }, Store::Overwrite)?;
        matmul_bf16(dev, &mut dx, 0, dzu_rows, packed_rows, GemmDims { m: tokens, n: d, k }, Store::Overwrite)?;
        matmul_bf16(dev, &mut dw, 0, dzu_t, x_mat, GemmDims { m: k, n: d, k: tokens }, Store::Overwrite)
    })?;
    println!(
        "gated q,k,v 3×{d}→{d} {tokens:>7} tokens | forward: three {:>7.3} ms, group {:>7.3} ms ({:.2}×; {:.2}× the bare \
         GEMM {:.3} ms) | backward: three {:>7.3} ms, group {:>7.3} ms ({:.2}×) | group fwd+bwd {:.2}× the bare \
         products {:.3} ms | max rel diff {worst:.1e}",
        forward_three_s * 1e3,
        forward_group_s * 1e3,
        forward_group_s / forward_three_s,
        forward_group_s / gemm_s,
        gemm_s * 1e3,
        backward_three_s * 1e3,
        backward_group_s * 1e3,
        backward_group_s / backward_three_s,
        (forward_group_s + backward_group_s) / gemms_s,
        gemms_s * 1e3,
    );

    // The forward as attention reads it (q, k and v in bf16, q and k rotated by RoPE): the gate
    // into the packed output, then RoPE's packed forward (three launches), against the gate
    // kernel's rotary epilogue (two), in sequences of 256 of 64-dim heads.
    let (seq, head_dim) = (if tokens.is_multiple_of(256) { 256 } else { tokens }, 64);
    let (cos, sin) = rope_table(seq, head_dim, 10_000.0);
    let (cos, sin) = (dev.upload(&cos)?, dev.upload(&sin)?);
    let rope = RopeDims { batch: tokens / seq, seq, heads: d / head_dim, head_dim, pos_offset: 0 };
    let mut gated = dev.alloc::<bf16>(tokens * 3 * d)?;
    let mut rotated = [dev.alloc::<bf16>(tokens * d)?, dev.alloc::<bf16>(tokens * d)?, dev.alloc::<bf16>(tokens * d)?];
    let gate_then_rope_s = best_seconds(dev, || {
        fused_gate_forward_unfused(dev, &group, &x16, &packed, &mut zu, ValuesMut::Bf16(&mut gated))?;
        let [q, k, v] = &mut rotated;
        rope_qkv_forward(dev, Values::Bf16(&gated), rope, [q, k, v].map(ValuesMut::Bf16), &cos, &sin)
    })?;
    let unfused = rotated.each_ref().map(|part| download_widened(dev, part));
    let rotary_epilogue_s = best_seconds(dev, || {
        let [q, k, v] = &mut rotated;
        let outs = RotaryQkv { seq, head_dim, cos: &cos, sin: &sin, outs: [q, k, v] };
        fused_gate_forward_rotary_qkv(dev, &group, &x16, &packed, &mut zu, outs)
    })?;
    let mut worst = 0.0f32;
    for (part, want) in rotated.iter().zip(unfused) {
        worst = worst.max(check(&format!("gated q,k,v + RoPE 3×{d}→{d}"), &download_widened(dev, part)?, &want?, 1e-2));
    }
    println!(
        "gated q,k,v + RoPE 3×{d}→{d} {tokens:>7} tokens | gate then RoPE {:>7.3} ms | rotary epilogue {:>7.3} ms \
         ({:.2}×) | max rel diff {worst:.1e}",
        gate_then_rope_s * 1e3,
        rotary_epilogue_s * 1e3,
        rotary_epilogue_s / gate_then_rope_s,
    );
    Ok(())
}

/// The FFN's gated gate and up projections (`d → hidden` each, ranks 8 + 8) and SwiGLU: the
/// gate into the packed output, then SwiGLU of its halves (three launches), against the gate
/// kernel writing SwiGLU's output too (two), both in bf16 as a `--bf16` step holds them; and
/// backward, SwiGLU's backward then the gate's (six launches) against the gate's row kernel
/// computing SwiGLU's backward (five).
fn bench_gated_swiglu(dev: &CudaDevice, tokens: usize, d: usize, hidden: usize) -> Result<()> {
    let dims = FusedGateDims { rows: tokens, d_in: d, d_out: hidden, rank_channel: 8, rank_scalar: 8 };
    let projections = [Projection::new(dev, &dims)?, Projection::new(dev, &dims)?];
    let group: Vec<GateGroup> = projections.iter().map(|p| GateGroup { dims, params: p.params() }).collect();
    let packed = pack_weight(dev, &group)?;
    let x16 = dev.upload(&values(tokens * d, 40, 2.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>())?;
    let mut zu = DeviceValues::alloc(dev, tokens * 2 * dims.width(), true)?;
    let (mut gated, mut y) = (dev.alloc::<bf16>(tokens * 2 * hidden)?, dev.alloc::<bf16>(tokens * hidden)?);
    let gate_then_swiglu_s = best_seconds(dev, || {
        fused_gate_forward_unfused(dev, &group, &x16, &packed, &mut zu, ValuesMut::Bf16(&mut gated))?;
        swiglu_halves_forward(dev, Values::Bf16(&gated), hidden, (ValuesMut::Bf16(&mut y), None))
    })?;
    let unfused = download_widened(dev, &y)?;
    let epilogue_s =
        best_seconds(dev, || fused_gate_forward_swiglu(dev, &group, &x16, &packed, &mut zu, &mut gated, &mut y))?;
    let worst = check(&format!("gated gate,up + SwiGLU {d}→{hidden}"), &download_widened(dev, &y)?, &unfused, 1e-2);
    println!(
        "gated gate,up + SwiGLU {d}→2×{hidden} {tokens:>7} tokens | gate then SwiGLU {:>7.3} ms | SwiGLU epilogue \
         {:>7.3} ms ({:.2}×) | max rel diff {worst:.1e}",
        gate_then_swiglu_s * 1e3,
        epilogue_s * 1e3,
        epilogue_s / gate_then_swiglu_s,
    );

    let dy = dev.upload(&values(tokens * hidden, 41, 1.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>())?;
    let mut dgated = dev.alloc::<bf16>(tokens * 2 * hidden)?;
    let (mut unfused_grads, mut fused_grads) = (GroupGrads::new(dev, &group)?, GroupGrads::new(dev, &group)?);
    let products = GateProducts::Bf16 { x: &x16, packed: &packed };
    let swiglu_then_gate_s = best_seconds(dev, || {
        swiglu_halves_backward(dev, Values::Bf16(&gated), Values::Bf16(&dy), hidden, ValuesMut::Bf16(&mut dgated))?;
        let dout = OutputGrad::Direct(Values::Bf16(&dgated));
        fused_gate_backward(dev, &group, &zu, dout, products, &mut unfused_grads.device())
    })?;
    let swiglu_in_gate_s = best_seconds(dev, || {
        let dout = OutputGrad::Swiglu { dout: &dy, gated: &gated };
        fused_gate_backward(dev, &group, &zu, dout, products, &mut fused_grads.device())
    })?;
    let (want, got) = (dev.download(&unfused_grads.x)?, dev.download(&fused_grads.x)?);
    let worst = check(&format!("gated gate,up + SwiGLU backward {d}→{hidden}"), &got, &want, 1e-5);
    println!(
        "gated gate,up + SwiGLU backward {d}→2×{hidden} {tokens:>7} tokens | SwiGLU then gate {:>7.3} ms | SwiGLU \
         in gate {:>7.3} ms ({:.2}×) | max rel diff {worst:.1e}",
        swiglu_then_gate_s * 1e3,
        swiglu_in_gate_s * 1e3,
        swiglu_in_gate_s / swiglu_then_gate_s,
    );
    Ok(())
}

/// A gated output projection (`hidden → d`, ranks 8 + 8: Transponder's down; `d → d` its o)
/// and the residual stream's add and next RMSNorm: the gate into bf16, then the add and norm
/// (three launches), against the gate's launch doing the add and norm (two), in bf16 as a
/// `--bf16` step holds them.
fn bench_gated_add_norm(dev: &CudaDevice, tokens: usize, d_in: usize, d: usize) -> Result<()> {
    let dims = FusedGateDims { rows: tokens, d_in, d_out: d, rank_channel: 8, rank_scalar: 8 };
    let projection = Projection::new(dev, &dims)?;
    let group = [GateGroup { dims, params: projection.params() }];
    let packed = pack_weight(dev, &group)?;
    let x16 = dev.upload(&values(tokens * d_in, 42, 2.0).into_iter().map(bf16::from_f32).collect::<Vec<_>>())?;
    let (stream, weight) = (dev.upload(&values(tokens * d, 43, 2.0))?, dev.upload(&values(d, 44, 1.0))?);
    let mut zu = DeviceValues::alloc(dev, tokens * dims.width(), true)?;
    let mut gated = dev.alloc::<bf16>(tokens * d)?;
    let (mut sum, mut y, mut rstd) =
        (dev.alloc::<f32>(tokens * d)?, dev.alloc::<bf16>(tokens * d)?, dev.alloc(tokens)?);
    let norm_dims = NormDims { rows: tokens, cols: d, eps: 1e-5 };
    let gate_then_norm_s = best_seconds(dev, || {
        fused_gate_forward_unfused(dev, &group, &x16, &packed, &mut zu, ValuesMut::Bf16(&mut gated))?;
        let outs = (&mut sum, ValuesMut::Bf16(&mut y), None);
        add_rms_norm_forward(dev, (&stream, Values::Bf16(&gated)), &weight, &norm_dims, outs, &mut rstd)
    })?;
    let unfused = download_widened(dev, &y)?;
    let in_gate_s = best_seconds(dev, || {
        let norm = ResidualNorm {
            x: &stream,
            weight: &weight,
            eps: 1e-5,
            sum: &mut sum,
            y: ValuesMut::Bf16(&mut y),
            rstd: &mut rstd,
        };
        fused_gate_forward_add_rms_norm(dev, &group, &x16, &packed, &mut zu, norm)
    })?;
    let worst = check(&format!("gated {d_in}→{d} + add + RMSNorm"), &download_widened(dev, &y)?, &unfused, 1e-5);
    println!(
        "gated {d_in}→{d} + add + RMSNorm {tokens:>7} tokens | gate then add+norm {:>7.3} ms | add+norm in gate \
         {:>7.3} ms ({:.2}×) | max rel diff {worst:.1e}",
        gate_then_norm_s * 1e3,
        in_gate_s * 1e3,
        in_gate_s / gate_then_norm_s,
    );
    Ok(())
}

/// The pre-ln block's residual add and RMSNorm (`[tokens, d]`, the f32 stream plus a bf16
/// output projection, y in bf16) and RMSNorm's backward (bf16 `dy` beside the stream's
/// gradient, `dx` in f32 and bf16, the weight's gradient), as a `--bf16` step runs them, each
/// checked against the CPU's and timed against a device-to-device copy of as many bytes as it
/// reads and writes: memory-bound kernels, so the ratio says how far from the card's copy
/// bandwidth each one runs.
fn bench_rms_norm(dev: &CudaDevice, tokens: usize, d: usize) -> Result<()> {
    let n = tokens * d;
    let bf16_values = |seed: u64, bound: f32| -> Vec<f32> {
        values(n, seed, bound).into_iter().map(|v| bf16::from_f32(v).to_f32()).collect()
    };
    let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let (x, w, delta) = (values(n, 51, 2.0), values(d, 52, 1.0), bf16_values(53, 2.0));
    let (stream, weight, delta16) = (dev.upload(&x)?, dev.upload(&w)?, dev.upload(&to_bf16(&delta))?);
    let (mut sum, mut y, mut rstd) = (dev.alloc::<f32>(n)?, dev.alloc::<bf16>(n)?, dev.alloc::<f32>(tokens)?);
    let dims = NormDims { rows: tokens, cols: d, eps: 1e-5 };
    let forward_s = best_seconds(dev, || {
        let outs = (&mut sum, ValuesMut::Bf16(&mut y), None);
        add_rms_norm_forward(dev, (&stream, Values::Bf16(&delta16)), &weight, &dims, outs, &mut rstd)
    })?;
    let (mut cpu_sum, mut cpu_y, mut cpu_rstd) = (vec![0.0; n], vec![0.0; n], vec![0.0; tokens]);
    cpu::norm::add_rms_norm_forward(&x, &delta, &w, &dims, (&mut cpu_sum, &mut cpu_y), &mut cpu_rstd);
    check(&format!("add + RMSNorm d {d}"), &download_widened(dev, &y)?, &cpu_y, 1e-2);

    let (dy, residual) = (bf16_values(54, 1.0), values(n, 55, 1.0));
    let (dy16, residual_dev) = (dev.upload(&to_bf16(&dy))?, dev.upload(&residual)?);
    let (mut dx, mut dx_bf16, mut dw) = (dev.alloc::<f32>(n)?, dev.alloc::<bf16>(n)?, dev.alloc::<f32>(d)?);
    let backward_s = best_seconds(dev, || {
        let grads = NormGrads { dx: &mut dx, dweight: Some(&mut dw), dbias: None };
        let dy_in = (Values::Bf16(&dy16), Some(&residual_dev));
        rms_norm_backward(dev, &sum, &weight, &rstd, dy_in, &dims, (grads, Some(&mut dx_bf16)))
    })?;
    let (mut cpu_dx, mut cpu_dw) = (vec![0.0; n], vec![0.0; d]);
    let grads = NormGrads { dx: &mut cpu_dx[..], dweight: Some(&mut cpu_dw[..]), dbias: None };
    cpu::norm::rms_norm_backward(&cpu_sum, &w, &cpu_rstd, (&dy, Some(&residual)), &dims, grads);
    check(&format!("RMSNorm backward d {d} dx"), &dev.download(&dx)?, &cpu_dx, 1e-4);
    check(&format!("RMSNorm backward d {d} dw"), &dev.download(&dw)?, &cpu_dw, 1e-4);

    // Bytes per element: forward x, sum (f32) and delta, y (bf16); backward x, residual, dx
    // (f32) and dy, dx_bf16 (bf16).
    let (forward_copy_s, backward_copy_s) = (copy_seconds(dev, 12 * n)?, copy_seconds(dev, 16 * n)?);
    println!(
        "add + RMSNorm d {d} {tokens:>7} tokens | forward {:>7.3} ms ({:.2}× a copy of its bytes) | backward {:>7.3} ms \
         ({:.2}× a copy)",
        forward_s * 1e3,
        forward_s / forward_copy_s,
        backward_s * 1e3,
        backward_s / backward_copy_s,
    );
    Ok(())
}

fn bench_attention(dev: &CudaDevice, batch: usize, seq: usize, heads: usize, head_dim: usize) -> Result<()> {
    let len = batch * seq * heads * head_dim;
    let (hq, hk, hv) = (values(len, 11, 1.0), values(len, 12, 1.0), values(len, 13, 1.0));
    let (q, k, v) = (dev.upload(&hq)?, dev.upload(&hk)?, dev.upload(&hv)?);
    // Under bf16 products training hands the tensor-core kernels q, k and v in bf16 (RoPE
    // writes them so); the f32 kernels read f32.
    let rounded = |x: &[f32]| dev.upload(&x.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>());
    let (q16, k16, v16) = (rounded(&hq)?, rounded(&hk)?, rounded(&hv)?);
    let mut naive_out = dev.alloc::<f32>(len)?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale };
    let mut lse = dev.alloc::<f32>(dims.lse_len())?;
    causal_attention_naive(dev, &q, &k, &v, &dims, &mut naive_out)?;
    let naive = dev.download(&naive_out)?;
    let naive_s = best_seconds(dev, || causal_attention_naive(dev, &q, &k, &v, &dims, &mut naive_out))?;
    // Forward alone and forward + backward, what one layer of a training step runs (PyTorch
    // SDPA's 481 µs at B 64, T 256, 8 heads of 64 on the H100 is the bar; gpu_compare.py
    // measures it beside us), with f32 products and, where the head dim fits, bf16 ones on
    // the tensor cores (checked against the naive f32 kernel to bf16's precision).
    let hdout = values(len, 14, 1.0);
    let (dout, dout16) = (dev.upload(&hdout)?, rounded(&hdout)?);
    let mut precisions = vec![(AttentionPrecision::F32, 1e-4)];
    if tensor_cores_fit(head_dim) {
        precisions.push((AttentionPrecision::Bf16, 2e-2));
    }
    for (precision, tolerance) in precisions {
        let qkv = match precision {
            AttentionPrecision::F32 => [&q, &k, &v].map(Values::F32),
            AttentionPrecision::Bf16 => [&q16, &k16, &v16].map(Values::Bf16),
        };
        // The output as training stores it: bf16 from bf16 q, k and v, else f32.
        let mut out = DeviceValues::alloc(dev, len, precision == AttentionPrecision::Bf16)?;
        let forward = |out: &mut DeviceValues, lse: &mut DeviceBuffer<f32>| {
            causal_attention_forward(dev, qkv, &dims, precision, (out.values_mut(), None), lse)
        };
        forward(&mut out, &mut lse)?;
        let flash: Vec<f32> = match out.values() {
            Values::F32(out) => dev.download(out)?,
            Values::Bf16(out) => download_widened(dev, out)?,
        };
        let what = format!("flash attention ({precision:?}) B={batch} T={seq} H={heads} D={head_dim}");
        let worst = check(&what, &flash, &naive, tolerance);
        let flash_s = best_seconds(dev, || forward(&mut out, &mut lse))?;
        // dout and the gradients as training holds them: bf16 alone beside the tensor cores'
        // bf16 q, k and v, else f32.
        let grads_bf16 = precision == AttentionPrecision::Bf16;
        let dout = if grads_bf16 { Values::Bf16(&dout16) } else { Values::F32(&dout) };
        let alloc_grad = || DeviceValues::alloc(dev, len, grads_bf16);
        let (mut dq, mut dk, mut dv) = (alloc_grad()?, alloc_grad()?, alloc_grad()?);
        let train_s = best_seconds(dev, || {
            forward(&mut out, &mut lse)?;
            let (dq, dk, dv) = (dq.values_mut(), dk.values_mut(), (dv.values_mut(), None));
            causal_attention_backward(dev, qkv, out.values(), &lse, dout, &dims, precision, dq, dk, dv)
        })?;
        println!(
            "attention {precision:?} B={batch} T={seq} H={heads} D={head_dim} | flash {:>8.3} ms | naive {:>8.3} ms \
             | speedup {:.1}× | flash fwd+bwd {:>8.1} µs | max rel diff {worst:.1e}",
            flash_s * 1e3,
            naive_s * 1e3,
            naive_s / flash_s,
            train_s * 1e6,
        );
        if precision == AttentionPrecision::Bf16 {
            bench_rotary_backward(dev, &dims, qkv, out.values(), &lse, dout)?;
            bench_rotary_on_load(dev, &dims, Values::Bf16(&dout16))?;
        }
    }
    Ok(())
}

/// The tensor-core backward of attention over RoPE's q and k from a packed QKV product: into
/// dense gradients, then RoPE's packed backward (three launches), against the kernels
/// writing the packed gradient themselves, dq and dk rotated back as they are stored (two).
fn bench_rotary_backward(
    dev: &CudaDevice,
    dims: &AttentionDims,
    qkv: [Values; 3],
    out: Values,
    lse: &DeviceBuffer<f32>,
    dout: Values,
) -> Result<()> {
    let AttentionDims { batch, q_seq: seq, heads, head_dim, .. } = *dims;
    let len = batch * seq * heads * head_dim;
    let (cos, sin) = rope_table(seq, head_dim, 10_000.0);
    let (cos, sin) = (dev.upload(&cos)?, dev.upload(&sin)?);
    let rope = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
    let mut grads = [dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?];
    let mut dqkv = dev.alloc::<bf16>(3 * len)?;
    let precision = AttentionPrecision::Bf16;
    let backward_then_rope_s = best_seconds(dev, || {
        let [dq, dk, dv] = &mut grads;
        let (dq, dk, dv) = (ValuesMut::Bf16(dq), ValuesMut::Bf16(dk), (ValuesMut::Bf16(dv), None));
        causal_attention_backward(dev, qkv, out, lse, dout, dims, precision, dq, dk, dv)?;
        rope_qkv_backward(dev, grads.each_ref().map(Values::Bf16), rope, ValuesMut::Bf16(&mut dqkv), &cos, &sin)
    })?;
    let unfused = download_widened(dev, &dqkv)?;
    let packed_s = best_seconds(dev, || {
        let inputs = QkvInputs::Dense(qkv);
        causal_attention_backward_packed(dev, inputs, out, lse, dout, dims, ValuesMut::Bf16(&mut dqkv), &cos, &sin)
    })?;
    let what = format!("attention backward + RoPE B={batch} T={seq} H={heads} D={head_dim}");
    let worst = check(&what, &download_widened(dev, &dqkv)?, &unfused, 2e-2);
    println!(
        "{what} | backward then RoPE {:>8.1} µs | packed backward {:>8.1} µs ({:.2}×) | max rel diff {worst:.1e}",
        backward_then_rope_s * 1e6,
        packed_s * 1e6,
        packed_s / backward_then_rope_s,
    );
    Ok(())
}

/// Attention over RoPE's q and k from a packed bf16 QKV product, forward and forward +
/// backward into the packed gradient (a pre-ln layer's attention in a training step): RoPE's
/// launch into dense q, k and v, then the kernels, against the kernels reading the packed
/// product unrotated and rotating q and k as they load them ([`QkvInputs::Packed`]). Both give
/// the same bits.
fn bench_rotary_on_load(dev: &CudaDevice, dims: &AttentionDims, dout: Values) -> Result<()> {
    let AttentionDims { batch, q_seq: seq, heads, head_dim, .. } = *dims;
    let len = batch * seq * heads * head_dim;
    let packed: Vec<bf16> = values(3 * len, 15, 1.0).into_iter().map(bf16::from_f32).collect();
    let qkv = dev.upload(&packed)?;
    let (cos, sin) = rope_table(seq, head_dim, 10_000.0);
    let (cos, sin) = (dev.upload(&cos)?, dev.upload(&sin)?);
    let rope = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
    let mut parts = [dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?, dev.alloc::<bf16>(len)?];
    let (mut out, mut lse, mut dqkv) =
        (dev.alloc::<bf16>(len)?, dev.alloc::<f32>(dims.lse_len())?, dev.alloc(3 * len)?);
    let precision = AttentionPrecision::Bf16;
    let rope_then_forward = |parts: &mut [DeviceBuffer<bf16>; 3], out: &mut DeviceBuffer<bf16>, lse: &mut _| {
        let [q, k, v] = parts;
        let outputs = [ValuesMut::Bf16(q), ValuesMut::Bf16(k), ValuesMut::Bf16(v)];
        rope_qkv_forward(dev, Values::Bf16(&qkv), rope, outputs, &cos, &sin)?;
        let inputs = parts.each_ref().map(Values::Bf16);
        causal_attention_forward(dev, inputs, dims, precision, (ValuesMut::Bf16(out), None), lse)
    };
    let rope_forward_s = best_seconds(dev, || rope_then_forward(&mut parts, &mut out, &mut lse))?;
    let unfused_out = download_widened(dev, &out)?;
    let backward =
        |inputs: QkvInputs, out: &DeviceBuffer<bf16>, lse: &DeviceBuffer<f32>, dqkv: &mut DeviceBuffer<bf16>| {
            let out = Values::Bf16(out);
            causal_attention_backward_packed(dev, inputs, out, lse, dout, dims, ValuesMut::Bf16(dqkv), &cos, &sin)
        };
    let rope_train_s = best_seconds(dev, || {
        rope_then_forward(&mut parts, &mut out, &mut lse)?;
        backward(QkvInputs::Dense(parts.each_ref().map(Values::Bf16)), &out, &lse, &mut dqkv)
    })?;
    let unfused_dqkv = download_widened(dev, &dqkv)?;
    let on_load = |out: &mut DeviceBuffer<bf16>, lse: &mut DeviceBuffer<f32>| {
        rotary_causal_attention_forward_packed(dev, Values::Bf16(&qkv), dims, ValuesMut::Bf16(out), lse, (&cos, &sin))
    };
    let on_load_forward_s = best_seconds(dev, || on_load(&mut out, &mut lse))?;
    let packed = QkvInputs::Packed(Values::Bf16(&qkv));
    let on_load_train_s = best_seconds(dev, || {
        on_load(&mut out, &mut lse)?;
        backward(packed, &out, &lse, &mut dqkv)
    })?;
    let what = format!("RoPE + attention B={batch} T={seq} H={heads} D={head_dim}");
    check(&what, &download_widened(dev, &out)?, &unfused_out, 0.0);
    check(&what, &download_widened(dev, &dqkv)?, &unfused_dqkv, 0.0);
    println!(
        "{what} | RoPE then forward {:>8.1} µs | rotated on load {:>8.1} µs ({:.2}×) | fwd+bwd {:>8.1} µs → {:>8.1} µs \
         ({:.2}×) | same bits",
        rope_forward_s * 1e6,
        on_load_forward_s * 1e6,
        on_load_forward_s / rope_forward_s,
        rope_train_s * 1e6,
        on_load_train_s * 1e6,
        on_load_train_s / rope_train_s,
    );
    Ok(())
}

/// The LM head's fused cross-entropy over one chunk of `rows` bf16 logits of `vocab` columns
/// (a training step's chunk: `Tensor::linear_cross_entropy`), loss and gradient, checked
/// against the CPU's pass over the same values, then timed against a device copy of the bytes
/// it moves (two reads of the logits and one write of the gradient, 6 bytes an element).
fn bench_cross_entropy(dev: &CudaDevice, rows: usize, vocab: usize) -> Result<()> {
    let n = rows * vocab;
    let logits: Vec<f32> = values(n, 61, 8.0).into_iter().map(|v| bf16::from_f32(v).to_f32()).collect();
    let targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % vocab) as u32).collect();
    let dims = CrossEntropyDims { rows, cols: vocab, ignore_index: None };
    let scale = 1.0 / rows as f32;
    let (mut cpu_grad, mut cpu_losses) = (logits.clone(), vec![0.0; rows]);
    cpu::cross_entropy::cross_entropy_forward_backward(&mut cpu_grad, &targets, &dims, Some(scale), &mut cpu_losses);
    let halves: Vec<bf16> = logits.iter().map(|&v| bf16::from_f32(v)).collect();
    let (mut grad, device_targets) = (dev.upload(&halves)?, dev.upload(&targets)?);
    let mut losses = dev.alloc::<f32>(rows)?;
    let pass = |grad: &mut DeviceBuffer<bf16>, losses: &mut DeviceBuffer<f32>| {
        let targets = (&device_targets).into();
        cross_entropy_forward_backward(dev, ValuesMut::Bf16(grad), targets, 0, &dims, Some(scale), losses)
    };
    pass(&mut grad, &mut losses)?;
    check(&format!("cross-entropy {rows}×{vocab} losses"), &dev.download(&losses)?, &cpu_losses, 1e-5);
    check(&format!("cross-entropy {rows}×{vocab} gradient"), &download_widened(dev, &grad)?, &cpu_grad, 1e-2);
    // Later passes read the gradient as their logits: the same work.
    let seconds = best_seconds(dev, || pass(&mut grad, &mut losses))?;
    let copy_s = copy_seconds(dev, 6 * n)?;
    println!(
        "cross-entropy {rows}×{vocab} bf16 | loss + gradient {:>7.3} ms ({:.2}× a copy of its bytes)",
        seconds * 1e3,
        seconds / copy_s,
    );
    Ok(())
}

fn main() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!("cuda-bench: {e}");
            std::process::exit(1);
        }
    };
    let tokens = tokens_from_args();
    println!("{dev:?}");
    let run = || -> Result<()> {
        dev.compile_all()?;
        for (d_in, d_out) in [(512, 512), (512, 1376), (768, 768), (768, 2048)] {
            bench_projection(&dev, tokens, d_in, d_out)?;
        }
        for (d, hidden) in [(512, 1376), (768, 2048)] {
            bench_gate_up(&dev, tokens, d, hidden)?;
            bench_gated_swiglu(&dev, tokens, d, hidden)?;
        }
        for d in [512, 768] {
            bench_gate_group(&dev, tokens, d)?;
        }
        for (d_in, d) in [(512, 512), (1376, 512), (768, 768), (2048, 768)] {
            bench_gated_add_norm(&dev, tokens, d_in, d)?;
        }
        for d in [512, 768] {
            bench_rms_norm(&dev, tokens, d)?;
        }
        bench_cross_entropy(&dev, 2048, 32_000)?;
        bench_attention(&dev, (tokens / 2048).max(1), 256, 8, 64)?;
        bench_attention(&dev, (tokens / 4096).max(1), 256, 12, 64)?;
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("cuda-bench: {e}");
        std::process::exit(1);
    }
}
