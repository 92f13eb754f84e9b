//! The emulated CUDA device catches the classes of bug it exists for. Each test runs a
//! kernel with one deliberate bug (a mutant that `build.rs` makes from the real source by one
//! edit) and shows that a check fails, next to the unmutated kernel passing the same check:
//!
//! - a missing `__syncthreads()` (attention_forward) changes the result with the order the
//!   threads run in;
//! - a tile read before its cp.async copies are waited for (the tensor-core attention's
//!   forward) holds what was there before them;
//! - an mma fragment index off by one (fused_gate_mma) gives a wrong product;
//! - a write one element past a buffer (fill_bias) is an error naming the kernel, the
//!   argument and the element.
#![cfg(feature = "cuda-emu")]

use half::bf16;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::conv::Conv2dGeometry;
use kernels::cpu::fused_gate::FusedGateDims;
use kernels::cpu::unary::Unary;
use kernels::cuda::attention::AttentionPrecision::{Bf16, F32};
use kernels::cuda::emu::{Mutant, Schedule};
use kernels::cuda::fused_gate::{DeviceFusedGateParams, DeviceGateParams};
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer, Values, ValuesMut};

/// A fresh emulated device, running `mutant` when given.
fn emulator(mutant: Option<Mutant>) -> CudaDevice {
    let dev = CudaDevice::emulated().expect("the emulated device opens");
    if let Some(mutant) = mutant {
        dev.use_mutant(mutant).expect("an emulated device takes mutants");
    }
    dev
}

/// Reproducible values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The largest elementwise difference.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| if x.is_nan() || y.is_nan() { f32::INFINITY } else { (x - y).abs() })
        .fold(0.0, f32::max)
}

/// Flash attention (`attention_forward`) against the naive kernel on the same device, with
/// the threads of every barrier phase run in `schedule`'s order: the largest difference.
fn attention_error(dev: &CudaDevice, schedule: Schedule) -> f32 {
    dev.set_emulator_schedule(schedule).unwrap();
    // Three key tiles of 32, two query blocks: several staging rounds per block.
    let (batch, seq, heads, head_dim) = (1, 80, 2, 32);
    let len = batch * seq * heads * head_dim;
    let (q, k, v) = (values(len, 1), values(len, 2), values(len, 3));
    let (q, k, v) = (dev.upload(&q).unwrap(), dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
    let (mut flash, mut lse, mut naive) =
        (dev.alloc(len).unwrap(), dev.alloc(dims.lse_len()).unwrap(), dev.alloc(len).unwrap());
    cuda::attention::causal_attention_forward(
        dev,
        [&q, &k, &v].map(Values::F32),
        &dims,
        F32,
        (ValuesMut::F32(&mut flash), None),
        &mut lse,
    )
    .unwrap();
    cuda::attention::causal_attention_naive(dev, &q, &k, &v, &dims, &mut naive).unwrap();
    max_difference(&dev.download(&flash).unwrap(), &dev.download(&naive).unwrap())
}

#[test]
fn a_missing_syncthreads_changes_the_result_with_the_schedule() {
    let schedules = [Schedule::Forward, Schedule::Reverse, Schedule::Shuffled];
    let correct = emulator(None);
    for schedule in schedules {
        let error = attention_error(&correct, schedule);
        assert!(error < 1e-5, "attention_forward disagrees with the naive kernel under {schedule:?}: {error}");
    }
    let mutant = emulator(Some(Mutant::AttentionMissingSync));
    let errors: Vec<f32> = schedules.iter().map(|&s| attention_error(&mutant, s)).collect();
    println!("attention_forward without its barrier, error per schedule {schedules:?}: {errors:?}");
    assert!(errors.iter().any(|&e| e > 1e-2), "the race went unseen: {errors:?}");
}

/// The tensor-core attention's forward and backward outputs (out, lse, dq, dk, dv) with the
/// threads of every barrier phase run in `schedule`'s order, from f32 q, k, v and dO (staged
/// through registers) or from bf16 ones (`bf16_inputs`: staged by cp.async, the backward reading
/// the forward's bf16 output), the values in bf16 either way; also the output's largest
/// difference from the naive f32 kernel.
fn tensor_core_attention(dev: &CudaDevice, schedule: Schedule, bf16_inputs: bool) -> (Vec<Vec<f32>>, f32) {
    dev.set_emulator_schedule(schedule).unwrap();
    // Two query blocks and two key tiles of 64 (partial), so tiles are staged several times.
    let (batch, seq, heads, head_dim) = (1, 100, 2, 32);
    let len = batch * seq * heads * head_dim;
    let halves = |seed| values(len, seed).into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let up = |seed| dev.upload(&halves(seed).into_iter().map(bf16::to_f32).collect::<Vec<_>>()).unwrap();
    let up_bf16 = |seed| dev.upload(&halves(seed)).unwrap();
    let (q, k, v, dout) = (up(1), up(2), up(3), up(4));
    let [hq, hk, hv, hdout] = [1, 2, 3, 4].map(up_bf16);
    let inputs = || if bf16_inputs { [&hq, &hk, &hv].map(Values::Bf16) } else { [&q, &k, &v].map(Values::F32) };
    let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
    let alloc = || dev.alloc::<f32>(len).unwrap();
    let (mut out, mut lse, mut naive) = (alloc(), dev.alloc(dims.lse_len()).unwrap(), alloc());
    let mut out_bf16 = dev.alloc::<bf16>(len).unwrap();
    let twin = bf16_inputs.then_some(&mut out_bf16);
    cuda::attention::causal_attention_forward(dev, inputs(), &dims, Bf16, (ValuesMut::F32(&mut out), twin), &mut lse)
        .unwrap();
    cuda::attention::causal_attention_naive(dev, &q, &k, &v, &dims, &mut naive).unwrap();
    let (saved, dout) = if bf16_inputs {
        (Values::Bf16(&out_bf16), Values::Bf16(&hdout))
    } else {
        (Values::F32(&out), Values::F32(&dout))
    };
    let (mut dq, mut dk, mut dv) = (alloc(), alloc(), alloc());
    cuda::attention::causal_attention_backward(
        dev,
        inputs(),
        saved,
        &lse,
        dout,
        &dims,
        Bf16,
        ValuesMut::F32(&mut dq),
        ValuesMut::F32(&mut dk),
        (ValuesMut::F32(&mut dv), None),
    )
    .unwrap();
    let error = max_difference(&dev.download(&out).unwrap(), &dev.download(&naive).unwrap());
    ([&out, &lse, &dq, &dk, &dv].map(|b| dev.download(b).unwrap()).to_vec(), error)
}

#[test]
fn tensor_core_attention_gives_the_same_bits_under_every_schedule() {
    let dev = emulator(None);
    for bf16_inputs in [false, true] {
        let (first, error) = tensor_core_attention(&dev, Schedule::Forward, bf16_inputs);
        assert!(
            error < 2e-2,
            "tensor-core attention (bf16 inputs {bf16_inputs}) is far from the naive kernel: {error}"
        );
        for schedule in [Schedule::Reverse, Schedule::Shuffled] {
            let (outputs, _) = tensor_core_attention(&dev, schedule, bf16_inputs);
            assert!(outputs == first, "tensor-core attention (bf16 inputs {bf16_inputs}) changed with {schedule:?}");
        }
    }
}

#[test]
fn a_missing_cp_async_wait_reads_a_tile_before_it_arrives() {
    let correct = emulator(None);
    let (_, error) = tensor_core_attention(&correct, Schedule::Forward, true);
    assert!(error < 2e-2, "tensor-core attention from bf16 inputs is far from the naive kernel: {error}");
    let mutant = emulator(Some(Mutant::AttentionMmaMissingWait));
    let (_, wrong) = tensor_core_attention(&mutant, Schedule::Forward, true);
    println!("tensor-core attention forward without its cp.async wait: largest difference {wrong} (correct: {error})");
    assert!(wrong > 0.1, "the tile read before its copies arrived went unseen: {wrong}");
}

/// One modulator's device parameters from `[A, a, B, b, α]`.
fn gate_params(p: &[DeviceBuffer<f32>]) -> DeviceGateParams<'_> {
    DeviceGateParams { a_weight: &p[0], a_bias: &p[1], b_weight: &p[2], b_bias: &p[3], alpha: &p[4] }
}

/// The fused projection's mma kernel against the unfused path (cuBLAS + fused_gate_apply)
/// on the same device: the largest difference.
fn fused_gate_error(dev: &CudaDevice) -> f32 {
    let dims = FusedGateDims { rows: 48, d_in: 64, d_out: 40, rank_channel: 8, rank_scalar: 8 };
    let (rc, rs) = (dims.rank_channel, dims.rank_scalar);
    let up = |v: Vec<f32>| dev.upload(&v).unwrap();
    let bf16_values = |len, seed| values(len, seed).into_iter().map(|v| bf16::from_f32(v).to_f32()).collect::<Vec<_>>();
    let weight = up(bf16_values(dims.d_out * dims.d_in, 4));
    let channel: Vec<DeviceBuffer<f32>> = vec![
        up(bf16_values(rc * dims.d_in, 5)),
        up(values(rc, 6)),
        up(values(dims.d_out * rc, 7)),
        up(values(dims.d_out, 8)),
        up(vec![1.3]),
    ];
    let scalar: Vec<DeviceBuffer<f32>> = vec![
        up(bf16_values(rs * dims.d_in, 9)),
        up(values(rs, 10)),
        up(values(rs, 11)),
        up(values(1, 12)),
        up(vec![0.7]),
    ];
    let gate = gate_params;
    let params =
        DeviceFusedGateParams { weight: &weight, channel: gate(&channel), scalar: gate(&scalar), phi: Unary::Silu };
    let x: Vec<bf16> = values(dims.rows * dims.d_in, 13).into_iter().map(bf16::from_f32).collect();
    let x = dev.upload(&x).unwrap();
    let group = [cuda::fused_gate::GateGroup { dims, params }];
    let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
    // The unfused path's ZU in f32: both gate the same f32 sums.
    let mut zu = cuda::DeviceValues::alloc(dev, dims.rows * dims.width(), false).unwrap();
    let mut fused = dev.alloc(dims.rows * dims.d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &x, &packed, &params, None, cuda::ValuesMut::F32(&mut fused))
        .unwrap();
    let mut unfused = dev.alloc(dims.rows * dims.d_out).unwrap();
    let out = cuda::ValuesMut::F32(&mut unfused);
    cuda::fused_gate::fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, out).unwrap();
    max_difference(&dev.download(&fused).unwrap(), &dev.download(&unfused).unwrap())
}

#[test]
fn an_mma_fragment_index_off_by_one_gives_a_wrong_product() {
    let correct = fused_gate_error(&emulator(None));
    assert!(correct < 1e-4, "fused_gate_mma disagrees with the unfused path: {correct}");
    let wrong = fused_gate_error(&emulator(Some(Mutant::FusedGateFragmentRow)));
    println!("fused_gate_mma with d1 stored in row g + 8: largest difference {wrong} (correct kernel: {correct})");
    assert!(wrong > 1e-2, "the wrong fragment row went unseen: {wrong}");
}

/// A convolution with a bias of `len` output elements (`fill_bias` writes them first).
fn convolve(dev: &CudaDevice, out_channels: usize) -> (usize, Result<(), CudaError>) {
    let g = Conv2dGeometry {
        batch: 2,
        in_channels: 3,
        out_channels,
        height: 5,
        width: 4,
        kernel_h: 3,
        kernel_w: 3,
        stride: 1,
        padding: 1,
    };
    let x = dev.upload(&values(g.batch * g.in_channels * g.height * g.width, 14)).unwrap();
    let w = dev.upload(&values(out_channels * g.in_channels * 9, 15)).unwrap();
    let bias = dev.upload(&values(out_channels, 16)).unwrap();
    let len = g.batch * out_channels * g.out_height() * g.out_width();
    let mut y = dev.alloc(len).unwrap();
    (len, cuda::conv::conv2d_forward(dev, &g, &x, &w, Some(&bias), &mut y))
}

#[test]
fn a_write_past_the_end_is_an_error_naming_kernel_argument_and_element() {
    for out_channels in [4, 3] {
        let (_, result) = convolve(&emulator(None), out_channels);
        result.unwrap_or_else(|e| panic!("the correct fill_bias failed: {e}"));
    }
    // y of 2·4·20 = 160 and 2·1·20 = 40 f32: multiples of 16 bytes, so the element past the
    // end lies on the guard page after the buffer and the write faults at once.
    for out_channels in [4, 1] {
        let (len, result) = convolve(&emulator(Some(Mutant::FillBiasPastEnd)), out_channels);
        let message = match result {
            Err(error @ CudaError::Emulated { .. }) => error.to_string(),
            other => panic!("fill_bias wrote past the end of y unnoticed: {other:?}"),
        };
        println!("{message}");
        for part in ["fill_bias", "(emulated)", "`y`", &format!("element {len}"), &format!("f32[{len}]")] {
            assert!(message.contains(part), "the error does not name {part:?}: {message}");
        }
    }
}

#[test]
fn a_write_into_the_padding_after_a_buffer_is_caught_by_its_canary() {
    // y of 2·1·5·3 = 30 f32 (120 bytes): the element past the end lies in the 8 bytes of
    // padding before the guard page, so the poison check after the launch catches it.
    let dev = emulator(Some(Mutant::FillBiasPastEnd));
    let g = Conv2dGeometry {
        batch: 2,
        in_channels: 1,
        out_channels: 1,
        height: 5,
        width: 3,
        kernel_h: 1,
        kernel_w: 1,
        stride: 1,
        padding: 0,
    };
    let x = dev.upload(&values(30, 17)).unwrap();
    let (w, bias) = (dev.upload(&[0.5]).unwrap(), dev.upload(&[0.25]).unwrap());
    let mut y = dev.alloc(30).unwrap();
    let message = match cuda::conv::conv2d_forward(&dev, &g, &x, &w, Some(&bias), &mut y) {
        Err(error @ CudaError::Emulated { .. }) => error.to_string(),
        other => panic!("a write into the padding went unseen: {other:?}"),
    };
    println!("{message}");
    for part in ["fill_bias", "wrote outside", "`y`", "f32[30]", "element 30"] {
        assert!(message.contains(part), "the error does not name {part:?}: {message}");
    }
}
