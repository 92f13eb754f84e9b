//! Rotary embedding (rotate-half, θ = 10000), embedding lookup and causal attention against
//! the toolkit's oracles.

use gradcheck::oracle::{self, AttentionShape};
use proptest::prelude::*;
use tensor::{Device, Error, Tensor};
use transponder_tests::*;

use super::CASES;

/// Rotate-half RoPE (HF LLaMA) from the toolkit's oracle: pairs (i, i + D/2) rotate by
/// (pos_offset + t)·θ^(−2i/D), the cos/sin tables built in f64.
fn rope_reference(x: &Tensor, theta: f64, pos_offset: usize) -> Vec<f64> {
    let (t, h, d) = (x.shape()[1], x.shape()[2], x.shape()[3]);
    let angles: Vec<f64> = (0..pos_offset + t)
        .flat_map(|pos| (0..d / 2).map(move |i| pos as f64 * theta.powf(-2.0 * i as f64 / d as f64)))
        .collect();
    let (cos, sin): (Vec<f64>, Vec<f64>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
    oracle::rope(&oracle::widen(&x.to_vec()), &cos, &sin, t, h, d, pos_offset)
}

/// softmax(q·kᵀ·scale, masked to keys at or before each query's position)·v from the
/// toolkit's oracle, queries being the last Tq of Tk positions; and the per-query
/// log-sum-exp of the masked scores, `[B, H, Tq]`.
fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (qs, ks, vs) = (oracle::widen(&q.to_vec()), oracle::widen(&k.to_vec()), oracle::widen(&v.to_vec()));
    let (batch, q_seq, heads, head_dim) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let kv_seq = k.shape()[1];
    let shape = AttentionShape { batch, q_seq, kv_seq, heads, head_dim };
    let mut lses = Vec::with_capacity(batch * heads * q_seq);
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..q_seq {
                let query = &qs[((b * q_seq + i) * heads + h) * head_dim..][..head_dim];
                let scores: Vec<f64> = (0..kv_seq - q_seq + i + 1)
                    .map(|j| scale * oracle::dot(query, &ks[((b * kv_seq + j) * heads + h) * head_dim..][..head_dim]))
                    .collect();
                lses.push(oracle::logsumexp(&scores));
            }
        }
    }
    (oracle::causal_attention(&qs, &ks, &vs, shape, scale), lses)
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn rope_matches_rotate_half((x, pos_offset, theta) in (1..=2usize, 1..=6usize, 1..=3usize, 1..=8usize).prop_flat_map(|(b, t, h, half)| (
        tensor_in(vec![b, t, h, 2 * half], Domain::Uniform(-2.0, 2.0)),
        0..=40usize,
        prop_oneof![Just(10_000.0f32), Just(500.0f32)],
    ))) {
        let y = ok("rope", x.rope(theta, pos_offset));
        prop_assert_eq!(y.shape(), x.shape());
        assert_close("rope", &y.to_vec(), &rope_reference(&x, theta as f64, pos_offset), 1e-4, 2e-5);
        // Applying it to a strided view gives the same result.
        assert_close_f32("rope (non-contiguous)", &ok("rope", non_contiguous(&x).rope(theta, pos_offset)).to_vec(), &y.to_vec(), 0.0, 0.0);
    }

    #[test]
    fn embedding_picks_rows((w, ids, ids_shape) in (1..=5usize, 1..=4usize, shape_with_rank(1..=3)).prop_flat_map(|(vocab, c, ids_shape)| {
        let n = numel(&ids_shape);
        (tensor_in(vec![vocab, c], Domain::Uniform(-2.0, 2.0)), prop::collection::vec(0..vocab as u32, n), Just(ids_shape))
    })) {
        let c = w.shape()[1];
        let ws = w.to_vec();
        let expected: Vec<f32> = ids.iter().flat_map(|&i| ws[i as usize * c..(i as usize + 1) * c].to_vec()).collect();
        let tokens = token_ids(&ids, Device::Cpu);
        let y = ok("embedding", w.embedding(&tokens, &ids_shape));
        let out_shape = [ids_shape.as_slice(), &[c]].concat();
        prop_assert_eq!(y.shape(), out_shape.as_slice());
        prop_assert_eq!(y.to_vec(), expected.clone());
        prop_assert_eq!(ok("embedding", non_contiguous(&w).embedding(&tokens, &ids_shape)).to_vec(), expected);
    }

    #[test]
    fn causal_attention_matches_masked_softmax((q, k, v) in (1..=2usize, 1..=7usize, 1..=3usize, 1..=8usize)
        .prop_flat_map(|(b, tk, h, d)| (Just((b, tk, h, d)), 1..=tk))
        .prop_flat_map(|((b, tk, h, d), tq)| (
            tensor_in(vec![b, tq, h, d], Domain::Uniform(-2.0, 2.0)),
            tensor_in(vec![b, tk, h, d], Domain::Uniform(-2.0, 2.0)),
            tensor_in(vec![b, tk, h, d], Domain::Uniform(-2.0, 2.0)),
        )))
    {
        let scale = 1.0 / (q.shape()[3] as f32).sqrt();
        let (out, lse) = ok("causal_attention", Tensor::causal_attention(&q, &k, &v, scale));
        let (expected, expected_lse) = attention_reference(&q, &k, &v, scale as f64);
        prop_assert_eq!(out.shape(), q.shape());
        assert_close("causal_attention", &out.to_vec(), &expected, 1e-4, 1e-5);
        assert_close("causal_attention lse", &lse.to_vec(), &expected_lse, 1e-5, 1e-5);
        let (strided, _) = ok("causal_attention", Tensor::causal_attention(&non_contiguous(&q), &non_contiguous(&k), &non_contiguous(&v), scale));
        assert_close_f32("causal_attention (non-contiguous)", &strided.to_vec(), &out.to_vec(), 0.0, 0.0);
    }
}

#[test]
fn rope_at_long_context_positions() {
    // Positions up to LLaMA-scale contexts: f32 angles lose ~|angle|·2⁻²⁴, no more.
    let x = seeded(&[1, 3, 2, 16], -2.0, 2.0, 21);
    for pos_offset in [0, 511, 4093] {
        let y = ok("rope", x.rope(10_000.0, pos_offset));
        assert_close(
            &format!("rope at {pos_offset}"),
            &y.to_vec(),
            &rope_reference(&x, 10_000.0, pos_offset),
            1e-3,
            1e-3,
        );
    }
}

#[test]
fn attention_and_rope_reject_bad_shapes() {
    let q = Tensor::zeros(&[1, 4, 2, 8]);
    let k = Tensor::zeros(&[1, 3, 2, 8]);
    assert!(Tensor::causal_attention(&q, &k, &k, 1.0).is_err(), "Tq > Tk must be rejected");
    let k = Tensor::zeros(&[1, 4, 2, 4]);
    assert!(Tensor::causal_attention(&q, &k, &k, 1.0).is_err(), "head dims differ");
    assert!(Tensor::zeros(&[1, 2, 1, 3]).rope(10_000.0, 0).is_err(), "odd head dim must be rejected");
    assert!(Tensor::zeros(&[2, 3]).rope(10_000.0, 0).is_err(), "rope needs rank 4");
    let err = Tensor::zeros(&[3, 2]).embedding(&token_ids(&[3], Device::Cpu), &[1]).unwrap_err();
    assert!(matches!(err, Error::IndexOutOfRange { op: "embedding", index: 3, size: 3 }), "id 3 of 3 rows: {err}");
    let err = Tensor::zeros(&[3, 2]).embedding(&token_ids(&[0, 1], Device::Cpu), &[3]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { op: "embedding", .. }), "2 ids for shape [3]: {err}");
}
