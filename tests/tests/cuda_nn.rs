#![cfg(feature = "cuda")]
//! CPU vs CUDA agreement of the nn ops (softmax, log-softmax, cross-entropy, RMSNorm,
//! LayerNorm, rotary embedding, embedding lookup, causal attention): each op runs on
//! identical seeded inputs on both devices, forward and backward through autograd `Var`s,
//! and the GPU results (output, saved statistics, every input gradient) must match the
//! CPU's within f32 tolerances. Every test skips, saying so, without a GPU.
//!
//! Tolerances: `RTOL` relative + `ATOL` absolute (f32 rounding of different summation
//! orders); gradients that are sums over many rows (norm weights, attention keys and
//! values, repeated embedding rows) use `SUM_ATOL` where the exact value may be near zero.

use autograd::Var;
use tensor::{Device, Error, Result, Tensor};
use transponder_tests::{assert_close_f32, gpu, no_gpu, ok, seeded, token_ids, GPU};

const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-5;
const SUM_ATOL: f64 = 1e-4;

/// Asserts `got` lives on the GPU and matches the CPU's `want` (shape and values).
fn assert_agree(what: &str, got: &Tensor, want: &Tensor, atol: f64) {
    assert_eq!(got.device(), GPU, "{what}: result is not on the GPU");
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let got = ok("to_host", got.to_host()).to_vec();
    assert_close_f32(what, &got, &want.to_vec(), RTOL, atol);
}

/// Runs `f` on trainable leaves holding `inputs` on `device`, back-propagates a seeded
/// random output gradient, and returns the output and each input's gradient.
fn forward_backward(device: Device, inputs: &[Tensor], f: &dyn Fn(&[Var]) -> Result<Var>) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::parameter(ok("to_device", t.to_device(device)))).collect();
    let y = ok("forward", f(&vars));
    let seed = seeded(&y.shape(), -1.0, 1.0, 99);
    ok("backward", y.backward_with(ok("seed to device", seed.to_device(device))));
    let grads = vars.iter().enumerate().map(|(i, v)| v.grad().unwrap_or_else(|| panic!("input {i}: no gradient")));
    (y.value(), grads.collect())
}

/// Checks `f`'s output and every input gradient agree between CPU and GPU; `grad_atol`
/// is the absolute tolerance of the gradients.
fn check_op(what: &str, inputs: &[Tensor], grad_atol: f64, f: impl Fn(&[Var]) -> Result<Var>) {
    let (y_cpu, grads_cpu) = forward_backward(Device::Cpu, inputs, &f);
    let (y_gpu, grads_gpu) = forward_backward(GPU, inputs, &f);
    assert_agree(&format!("{what}: output"), &y_gpu, &y_cpu, ATOL);
    for (i, (got, want)) in grads_gpu.iter().zip(&grads_cpu).enumerate() {
        assert_agree(&format!("{what}: gradient of input {i}"), got, want, grad_atol);
    }
}

/// Deterministic ids below `vocab`, repeating once `len > vocab`.
fn ids(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

#[test]
fn softmax_and_log_softmax_agree() {
    if no_gpu() {
        return;
    }
    for (i, shape) in [vec![7, 50], vec![3, 4, 300], vec![1, 1], vec![2, 1000]].into_iter().enumerate() {
        let x = seeded(&shape, -4.0, 4.0, i as u64);
        check_op(&format!("softmax {shape:?}"), std::slice::from_ref(&x), ATOL, |v| v[0].softmax());
        check_op(&format!("log_softmax {shape:?}"), std::slice::from_ref(&x), ATOL, |v| v[0].log_softmax());
    }
}

#[test]
fn softmax_of_a_strided_view_agrees() {
    if no_gpu() {
        return;
    }
    let x = seeded(&[40, 6], -3.0, 3.0, 5);
    let want = ok("softmax", ok("transpose", x.transpose(0, 1)).softmax());
    let got = ok("softmax", ok("transpose", gpu(&x).transpose(0, 1)).softmax());
    assert_agree("softmax of a transposed view", &got, &want, ATOL);
}

#[test]
fn cross_entropy_agrees_with_and_without_ignore_index() {
    if no_gpu() {
        return;
    }
    let (rows, vocab) = (37, 1000);
    let logits = seeded(&[rows, vocab], -5.0, 5.0, 11);
    let mut targets = ids(rows, vocab);
    // Every fifth row ignored, once with an in-range ignore index and once out of range.
    for (ignore, name) in [(None, "no ignore index"), (Some(7), "ignore 7"), (Some(u32::MAX), "ignore u32::MAX")] {
        if let Some(ignore) = ignore {
            targets.iter_mut().step_by(5).for_each(|t| *t = ignore);
        }
        let cpu = ok("cross_entropy", logits.cross_entropy(&targets, ignore));
        let out = ok("cross_entropy", gpu(&logits).cross_entropy(&targets, ignore));
        assert_eq!(out.count, cpu.count, "{name}: counted rows");
        assert_eq!(out.loss.shape(), &[] as &[usize], "{name}: the loss is rank 0");
        assert_agree(&format!("{name}: loss"), &out.loss, &cpu.loss, ATOL);
        assert_agree(&format!("{name}: lse"), &out.lse, &cpu.lse, ATOL);
        let host_loss = ok("loss_value", out.loss_value());
        assert_close_f32(
            &format!("{name}: loss_value"),
            &[host_loss],
            &[ok("loss_value", cpu.loss_value())],
            RTOL,
            ATOL,
        );
        check_op(&format!("cross_entropy ({name})"), std::slice::from_ref(&logits), ATOL, |v| {
            v[0].cross_entropy(&targets, ignore)
        });
    }
}

#[test]
fn cross_entropy_with_every_row_ignored_is_zero() {
    if no_gpu() {
        return;
    }
    let logits = seeded(&[4, 10], -2.0, 2.0, 12);
    let targets = [3u32; 4];
    let out = ok("cross_entropy", gpu(&logits).cross_entropy(&targets, Some(3)));
    assert_eq!(out.count, 0);
    assert_eq!(ok("loss_value", out.loss_value()), 0.0);
    check_op("cross_entropy (all ignored)", &[logits], ATOL, |v| v[0].cross_entropy(&targets, Some(3)));
}

#[test]
fn cross_entropy_rejects_a_target_out_of_range_on_the_gpu() {
    if no_gpu() {
        return;
    }
    let logits = gpu(&seeded(&[2, 3], -1.0, 1.0, 13));
    let err = logits.cross_entropy(&[0, 3], None).err().expect("target 3 of 3 classes must be rejected");
    assert!(matches!(err, Error::IndexOutOfRange { .. }), "{err}");
}

#[test]
fn rms_norm_agrees() {
    if no_gpu() {
        return;
    }
    for (i, (lead, cols)) in [(vec![4, 6], 96), (vec![5], 1000), (vec![3], 1)].into_iter().enumerate() {
        let x = seeded(&[lead.as_slice(), &[cols]].concat(), -3.0, 3.0, 20 + i as u64);
        let w = seeded(&[cols], 0.5, 1.5, 30 + i as u64);
        let cpu = ok("rms_norm", x.rms_norm(&w, 1e-5));
        let out = ok("rms_norm", gpu(&x).rms_norm(&gpu(&w), 1e-5));
        assert_agree("rms_norm y", &out.y, &cpu.y, ATOL);
        assert_agree("rms_norm rstd", &out.rstd, &cpu.rstd, ATOL);
        check_op(&format!("rms_norm {lead:?} x {cols}"), &[x, w], SUM_ATOL, |v| v[0].rms_norm(&v[1], 1e-5));
    }
}

#[test]
fn add_rms_norm_agrees() {
    if no_gpu() {
        return;
    }
    for (i, (lead, cols)) in [(vec![4, 6], 96), (vec![5], 1000), (vec![3], 1)].into_iter().enumerate() {
        let shape = [lead.as_slice(), &[cols]].concat();
        let (x, delta) = (seeded(&shape, -3.0, 3.0, 50 + i as u64), seeded(&shape, -1.0, 1.0, 60 + i as u64));
        let w = seeded(&[cols], 0.5, 1.5, 70 + i as u64);
        let cpu = ok("add_rms_norm", x.add_rms_norm(&delta, &w, 1e-5));
        let out = ok("add_rms_norm", gpu(&x).add_rms_norm(&gpu(&delta), &gpu(&w), 1e-5));
        assert_agree("add_rms_norm sum", &out.sum, &cpu.sum, 0.0);
        assert_agree("add_rms_norm y", &out.y, &cpu.y, ATOL);
        assert_agree("add_rms_norm rstd", &out.rstd, &cpu.rstd, ATOL);
        // Both outputs carry a gradient: the residual stream and its norm.
        check_op(&format!("add_rms_norm {lead:?} x {cols}"), &[x, delta, w], SUM_ATOL, |v| {
            let (sum, normed) = v[0].add_rms_norm(&v[1], &v[2], 1e-5)?;
            sum.mul(&normed)
        });
    }
}

#[test]
fn layer_norm_agrees_with_every_affine_combination() {
    if no_gpu() {
        return;
    }
    let (x, w, b) = (seeded(&[6, 5, 300], -3.0, 3.0, 40), seeded(&[300], 0.5, 1.5, 41), seeded(&[300], -1.0, 1.0, 42));
    let cpu = ok("layer_norm", x.layer_norm(Some(&w), Some(&b), 1e-5));
    let out = ok("layer_norm", gpu(&x).layer_norm(Some(&gpu(&w)), Some(&gpu(&b)), 1e-5));
    assert_agree("layer_norm y", &out.y, &cpu.y, ATOL);
    assert_agree("layer_norm mean", &out.mean, &cpu.mean, ATOL);
    assert_agree("layer_norm rstd", &out.rstd, &cpu.rstd, ATOL);
    check_op("layer_norm", std::slice::from_ref(&x), ATOL, |v| v[0].layer_norm(None, None, 1e-5));
    check_op("layer_norm + weight", &[x.clone(), w.clone()], SUM_ATOL, |v| v[0].layer_norm(Some(&v[1]), None, 1e-5));
    check_op("layer_norm + bias", &[x.clone(), b.clone()], SUM_ATOL, |v| v[0].layer_norm(None, Some(&v[1]), 1e-5));
    check_op("layer_norm + weight + bias", &[x, w, b], SUM_ATOL, |v| v[0].layer_norm(Some(&v[1]), Some(&v[2]), 1e-5));
}

#[test]
fn norms_reject_operands_on_different_devices() {
    if no_gpu() {
        return;
    }
    let (x, w) = (gpu(&seeded(&[2, 4], -1.0, 1.0, 43)), Tensor::ones(&[4]));
    assert!(matches!(x.rms_norm(&w, 1e-5).err(), Some(Error::DeviceMismatch { .. })));
    assert!(matches!(x.layer_norm(Some(&w), None, 1e-5).err(), Some(Error::DeviceMismatch { .. })));
}

#[test]
fn rope_agrees_at_several_offsets() {
    if no_gpu() {
        return;
    }
    // Offsets past the first cached table (256 positions) make the GPU table grow.
    for (i, (shape, pos_offset)) in
        [([2, 5, 3, 8], 0), ([1, 7, 2, 64], 3), ([2, 300, 2, 16], 10), ([1, 3, 2, 16], 4093)].into_iter().enumerate()
    {
        let x = seeded(&shape, -2.0, 2.0, 50 + i as u64);
        check_op(&format!("rope {shape:?} at {pos_offset}"), &[x], ATOL, |v| v[0].rope(10_000.0, pos_offset));
    }
    let x = seeded(&[1, 4, 1, 8], -2.0, 2.0, 59);
    check_op("rope, theta 500000", &[x], ATOL, |v| v[0].rope(500_000.0, 0));
}

#[test]
fn rotary_attention_of_packed_qkv_agrees() {
    if no_gpu() {
        return;
    }
    // (B, T, H, D): head dims that take the kernels' 4-pair path and the one-pair path.
    for (i, (b, t, h, d)) in [(2, 9, 2, 16), (1, 7, 3, 6), (1, 1, 1, 2)].into_iter().enumerate() {
        let qkv = seeded(&[b, t, 3 * h * d], -1.5, 1.5, 70 + i as u64);
        let scale = 1.0 / (d as f32).sqrt();
        check_op(&format!("packed qkv attention {b}x{t}x{h}x{d}"), &[qkv], SUM_ATOL, |v| {
            Var::rotary_causal_attention_packed(&v[0], h, scale, 10_000.0)
        });
    }
    let bad = gpu(&seeded(&[1, 2, 10], -1.0, 1.0, 79));
    let err = Tensor::rope_qkv(&bad, 2, 10_000.0).unwrap_err();
    assert!(matches!(err, Error::InvalidShape { op: "rope_qkv", .. }), "{err}");
}

#[test]
fn embedding_agrees_with_repeated_ids() {
    if no_gpu() {
        return;
    }
    let (vocab, dim) = (11, 48);
    let weight = seeded(&[vocab, dim], -1.0, 1.0, 60);
    let ids = ids(3 * 20, vocab); // 60 lookups into 11 rows: every row repeats
    check_op("embedding", &[weight], SUM_ATOL, |v| {
        v[0].embedding(&token_ids(&ids, v[0].value_ref().device()), &[3, 20])
    });
}

/// The lookup and its weight gradient on `device` for `ids` (on that device already).
fn embedding_and_gradient(weight: &Tensor, ids: &tensor::Tokens, dy: &Tensor) -> (Vec<f32>, Vec<f32>) {
    let device = ids.device();
    let y = ok("embedding", ok("to_device", weight.to_device(device)).embedding(ids, &[ids.len()]));
    let dw = ok(
        "embedding_backward",
        Tensor::embedding_backward(ids, &ok("to_device", dy.to_device(device)), weight.shape()[0]),
    );
    (ok("to_host", y.to_host()).to_vec(), ok("to_host", dw.to_host()).to_vec())
}

/// Many repeated ids (4,096 positions over 37 of 500 rows): the GPU's gather and scatter-add,
/// reading the ids and their grouping from the Tokens' device buffer, are the CPU's bit for
/// bit (each id's rows summed in increasing position order on both).
#[test]
fn embedding_backward_is_the_cpus_bit_for_bit_with_repeated_ids() {
    if no_gpu() {
        return;
    }
    let (vocab, dim, n) = (500, 64, 4096);
    let weight = seeded(&[vocab, dim], -1.0, 1.0, 62);
    let dy = seeded(&[n, dim], -1.0, 1.0, 63);
    let ids: Vec<u32> = (0..n).map(|i| ((i * i + 7 * i) % 37 * 13) as u32).collect();
    let want = embedding_and_gradient(&weight, &token_ids(&ids, Device::Cpu), &dy);
    let got = embedding_and_gradient(&weight, &token_ids(&ids, GPU), &dy);
    assert_eq!(got.0, want.0, "gather");
    assert_eq!(got.1, want.1, "scatter-add");
}

/// After `refill` the same device buffer holds the next batch: the lookup and its gradient are
/// those of fresh Tokens of the new ids, and the CPU's. A graph that still holds the Tokens
/// (for its backward) blocks the refill until it is dropped.
#[test]
fn embedding_after_a_refill_reads_the_new_ids() {
    if no_gpu() {
        return;
    }
    let (vocab, dim, n) = (40, 16, 300);
    let weight = seeded(&[vocab, dim], -1.0, 1.0, 64);
    let dy = seeded(&[n, dim], -1.0, 1.0, 65);
    let first: Vec<u32> = (0..n).map(|i| (i % 7) as u32).collect();
    let second = ids(n, vocab);
    let mut tokens = token_ids(&first, GPU);
    let before = embedding_and_gradient(&weight, &tokens, &dy);
    let graph = ok("embedding", Var::parameter(gpu(&weight)).embedding(&tokens, &[n]));
    let err = tokens.refill(&second).unwrap_err();
    assert!(matches!(err, Error::Shared { op: "Tokens::refill", .. }), "refilled under a live graph: {err}");
    drop(graph);
    ok("refill", tokens.refill(&second));
    let after = embedding_and_gradient(&weight, &tokens, &dy);
    assert_ne!(after, before, "the refill changed nothing");
    assert_eq!(after, embedding_and_gradient(&weight, &token_ids(&second, GPU), &dy), "refilled vs fresh Tokens");
    assert_eq!(after, embedding_and_gradient(&weight, &token_ids(&second, Device::Cpu), &dy), "refilled vs the CPU");
}

#[test]
fn embedding_rejects_an_id_out_of_range_or_on_another_device() {
    if no_gpu() {
        return;
    }
    let weight = gpu(&seeded(&[3, 2], -1.0, 1.0, 61));
    let err = weight.embedding(&token_ids(&[3], GPU), &[1]).unwrap_err();
    assert!(matches!(err, Error::IndexOutOfRange { op: "embedding", index: 3, size: 3 }), "{err}");
    let err = weight.embedding(&token_ids(&[0], Device::Cpu), &[1]).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { op: "embedding", .. }), "ids on the host: {err}");
    let dy = gpu(&seeded(&[1, 2], -1.0, 1.0, 66));
    let err = Tensor::embedding_backward(&token_ids(&[0], Device::Cpu), &dy, 3).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { op: "embedding_backward", .. }), "ids on the host: {err}");
}

#[test]
fn causal_attention_agrees_for_several_shapes() {
    if no_gpu() {
        return;
    }
    // (B, H, Tq, Tk, D): one token; square; more keys than queries (a decode window);
    // many tiles; the largest GPU head dim.
    let shapes = [(1, 1, 1, 1, 8), (2, 3, 17, 17, 16), (1, 2, 5, 40, 32), (2, 2, 70, 70, 64), (1, 2, 33, 33, 128)];
    for (i, (b, h, tq, tk, d)) in shapes.into_iter().enumerate() {
        let seed = 70 + 3 * i as u64;
        let q = seeded(&[b, tq, h, d], -1.0, 1.0, seed);
        let k = seeded(&[b, tk, h, d], -1.0, 1.0, seed + 1);
        let v = seeded(&[b, tk, h, d], -1.0, 1.0, seed + 2);
        let scale = 1.0 / (d as f32).sqrt();
        let (_, lse_cpu) = ok("causal_attention", Tensor::causal_attention(&q, &k, &v, scale));
        let (_, lse_gpu) = ok("causal_attention", Tensor::causal_attention(&gpu(&q), &gpu(&k), &gpu(&v), scale));
        let what = format!("causal_attention (B, H, Tq, Tk, D) = {:?}", (b, h, tq, tk, d));
        assert_agree(&format!("{what}: lse"), &lse_gpu, &lse_cpu, ATOL);
        check_op(&what, &[q, k, v], SUM_ATOL, |x| Var::causal_attention(&x[0], &x[1], &x[2], scale));
    }
}
