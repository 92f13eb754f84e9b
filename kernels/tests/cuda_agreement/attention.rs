//! Rotary embedding, embedding lookup and flash attention (forward, backward and the naive
//! kernel), forward and backward.

use half::bf16;
use kernels::cpu;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::rope::RopeDims;
use kernels::cuda::{self, CudaError};

use super::{assert_elementwise, assert_reduced, assert_twin, down, stale, up, Rng};

#[test]
fn rope_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(8);
    for (batch, seq, heads, head_dim, offset) in [(2, 37, 4, 64, 0), (1, 5, 3, 18, 7), (3, 1, 1, 2, 2)] {
        let (cos, sin) = cpu::rope::rope_table(seq + offset, head_dim, 10000.0);
        let x = rng.vec(batch * seq * heads * head_dim, -2.0, 2.0);
        let (gx, gcos, gsin) = (up(dev, &x), up(dev, &cos), up(dev, &sin));
        let dims = RopeDims { batch, seq, heads, head_dim, pos_offset: offset };
        let mut y = vec![0.0; x.len()];
        cpu::rope::rope_forward(&x, &cos, &sin, &dims, &mut y);
        let mut gy = dev.alloc(x.len()).unwrap();
        cuda::rope::rope_forward(dev, &gx, &gcos, &gsin, &dims, &mut gy).unwrap();
        assert_elementwise("rope forward", &down(dev, &gy), &y);
        let mut dx = stale(x.len());
        cpu::rope::rope_backward(&y, &cos, &sin, &dims, &mut dx);
        let mut gdx = up(dev, &dx);
        cuda::rope::rope_backward(dev, &up(dev, &y), &gcos, &gsin, &dims, (&mut gdx, None)).unwrap();
        assert_elementwise("rope backward", &down(dev, &gdx), &dx);
        // With a bf16 twin: the same dx, and the twin is dx rounded to nearest even.
        let (mut gdx2, mut gdx16) = (dev.alloc(x.len()).unwrap(), dev.alloc::<bf16>(x.len()).unwrap());
        cuda::rope::rope_backward(dev, &up(dev, &y), &gcos, &gsin, &dims, (&mut gdx2, Some(&mut gdx16))).unwrap();
        assert_twin(dev, "rope dx", &gdx2, &gdx, &gdx16);
    }
}

#[test]
fn embedding_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(9);
    let (vocab, dim, n) = (1000, 64, 4096);
    let weight = rng.vec(vocab * dim, -1.0, 1.0);
    // Few distinct ids, so rows repeat a lot in the scatter-add.
    let ids: Vec<u32> = (0..n).map(|_| rng.below(97)).collect();
    let (gw, gids) = (up(dev, &weight), dev.upload(&ids).unwrap());
    let mut out = vec![0.0; n * dim];
    cpu::embedding::embedding_forward(&weight, dim, &ids, &mut out);
    let mut gout = dev.alloc(n * dim).unwrap();
    cuda::embedding::embedding_forward(dev, &gw, dim, &gids, &mut gout).unwrap();
    assert_eq!(down(dev, &gout), out, "gather is exact");
    // The backward sums each id's rows in position order, as the CPU does: from zero (as the
    // tensor layer calls it) the two agree bit for bit, and every run gives the same bits.
    let dy = rng.vec(n * dim, -1.0, 1.0);
    let mut dweight = vec![0.0; vocab * dim];
    cpu::embedding::embedding_backward(&ids, &dy, dim, &mut dweight);
    for _ in 0..2 {
        let mut gdw = dev.zeros(vocab * dim).unwrap();
        cuda::embedding::embedding_backward(dev, &ids, &up(dev, &dy), dim, &mut gdw).unwrap();
        assert_eq!(down(dev, &gdw), dweight, "embedding backward is the CPU's, bit for bit");
    }
    // Onto existing values it adds each id's sum once: equal to rounding.
    let mut dweight = weight.clone();
    cpu::embedding::embedding_backward(&ids, &dy, dim, &mut dweight);
    let mut gdw = up(dev, &weight);
    cuda::embedding::embedding_backward(dev, &ids, &up(dev, &dy), dim, &mut gdw).unwrap();
    assert_reduced("embedding backward", &down(dev, &gdw), &dweight);
}

/// One attention problem.
#[derive(Clone, Copy, Debug)]
struct AttentionCase {
    batch: usize,
    q_seq: usize,
    kv_seq: usize,
    heads: usize,
    head_dim: usize,
}

#[test]
fn flash_attention_forward_and_backward_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(10);
    let cases = [
        AttentionCase { batch: 2, q_seq: 70, kv_seq: 70, heads: 3, head_dim: 16 },
        AttentionCase { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 1 },
        // No queries: dk and dv must still be written (zeros).
        AttentionCase { batch: 1, q_seq: 0, kv_seq: 4, heads: 2, head_dim: 8 },
        AttentionCase { batch: 2, q_seq: 5, kv_seq: 133, heads: 2, head_dim: 12 },
        AttentionCase { batch: 3, q_seq: 129, kv_seq: 200, heads: 2, head_dim: 7 },
        AttentionCase { batch: 2, q_seq: 256, kv_seq: 256, heads: 4, head_dim: 64 },
        AttentionCase { batch: 1, q_seq: 100, kv_seq: 100, heads: 2, head_dim: 128 },
    ];
    for c in cases {
        let AttentionCase { batch, q_seq, kv_seq, heads, head_dim } = c;
        let dims = AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
        let q = rng.vec(dims.q_len(), -1.0, 1.0);
        let k = rng.vec(dims.kv_len(), -1.0, 1.0);
        let v = rng.vec(k.len(), -1.0, 1.0);
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; dims.lse_len()]);
        cpu::attention::causal_attention_forward(&q, &k, &v, &dims, &mut out, &mut lse);
        let (gq, gk, gv) = (up(dev, &q), up(dev, &k), up(dev, &v));
        let (mut gout, mut glse) = (dev.alloc(q.len()).unwrap(), dev.alloc(lse.len()).unwrap());
        cuda::attention::causal_attention_forward(dev, &gq, &gk, &gv, &dims, (&mut gout, None), &mut glse).unwrap();
        assert_reduced(&format!("attention out {c:?}"), &down(dev, &gout), &out);
        let (mut gout2, mut gout16) = (dev.alloc(q.len()).unwrap(), dev.alloc::<bf16>(q.len()).unwrap());
        let twin = (&mut gout2, Some(&mut gout16));
        cuda::attention::causal_attention_forward(dev, &gq, &gk, &gv, &dims, twin, &mut glse).unwrap();
        assert_twin(dev, &format!("attention out {c:?}"), &gout2, &gout, &gout16);
        assert_reduced(&format!("attention lse {c:?}"), &down(dev, &glse), &lse);
        let mut naive = dev.alloc(q.len()).unwrap();
        cuda::attention::causal_attention_naive(dev, &gq, &gk, &gv, &dims, &mut naive).unwrap();
        assert_reduced(&format!("naive attention {c:?}"), &down(dev, &naive), &out);

        let dout = rng.vec(q.len(), -1.0, 1.0);
        let (sq, sk) = (stale(q.len()), stale(k.len()));
        let (mut dq, mut dk, mut dv) = (sq.clone(), sk.clone(), sk.clone());
        cpu::attention::causal_attention_backward(&q, &k, &v, &out, &lse, &dout, &dims, &mut dq, &mut dk, &mut dv);
        let (mut gdq, mut gdk, mut gdv) = (up(dev, &sq), up(dev, &sk), up(dev, &sk));
        cuda::attention::causal_attention_backward(
            dev,
            &gq,
            &gk,
            &gv,
            &up(dev, &out),
            &up(dev, &lse),
            &up(dev, &dout),
            &dims,
            &mut gdq,
            &mut gdk,
            (&mut gdv, None),
        )
        .unwrap();
        assert_reduced(&format!("attention dq {c:?}"), &down(dev, &gdq), &dq);
        assert_reduced(&format!("attention dk {c:?}"), &down(dev, &gdk), &dk);
        assert_reduced(&format!("attention dv {c:?}"), &down(dev, &gdv), &dv);
        let (mut gdv2, mut gdv16) = (up(dev, &sk), dev.alloc::<bf16>(k.len()).unwrap());
        let (out_saved, lse_saved, dout_up) = (up(dev, &out), up(dev, &lse), up(dev, &dout));
        let dv_twin = (&mut gdv2, Some(&mut gdv16));
        cuda::attention::causal_attention_backward(
            dev, &gq, &gk, &gv, &out_saved, &lse_saved, &dout_up, &dims, &mut gdq, &mut gdk, dv_twin,
        )
        .unwrap();
        assert_twin(dev, &format!("attention dv {c:?}"), &gdv2, &gdv, &gdv16);
    }
    // A head dimension past the kernels' limit is refused.
    let big = dev.alloc(256).unwrap();
    let (mut o, mut l) = (dev.alloc(256).unwrap(), dev.alloc(1).unwrap());
    let dims = AttentionDims { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 256, scale: 1.0 };
    let result = cuda::attention::causal_attention_forward(dev, &big, &big, &big, &dims, (&mut o, None), &mut l);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}
