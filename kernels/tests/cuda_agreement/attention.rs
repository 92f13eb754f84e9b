//! Rotary embedding, embedding lookup and flash attention (forward, backward and the naive
//! kernel), forward and backward.

use half::bf16;
use kernels::cpu;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::rope::RopeDims;
use kernels::cuda::attention::AttentionPrecision::{Bf16, F32};
use kernels::cuda::{self, CudaError, DeviceBuffer, DeviceRun, Values, ValuesMut};

use super::{assert_elementwise, assert_reduced, assert_twin, down, stale, up, up_bf16, Rng};

#[test]
fn rope_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(8);
    // One launch rotates two tensors (q and k) that may differ in heads.
    for (batch, seq, (q_heads, k_heads), head_dim, offset) in
        [(2, 37, (4, 4), 64, 0), (1, 5, (3, 1), 18, 7), (3, 1, (1, 2), 2, 2)]
    {
        let (cos, sin) = cpu::rope::rope_table(seq + offset, head_dim, 10000.0);
        let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
        let dims = [q_heads, k_heads].map(|heads| RopeDims { batch, seq, heads, head_dim, pos_offset: offset });
        let xs = dims.map(|d| rng.vec(d.batch * d.seq * d.heads * d.head_dim, -2.0, 2.0));
        let (gx, mut gy) = (xs.each_ref().map(|x| up(dev, x)), xs.each_ref().map(|x| dev.alloc(x.len()).unwrap()));
        let [gy0, gy1] = &mut gy;
        let mut parts = [
            cuda::rope::RopePart { x: &gx[0], dims: dims[0], out: gy0, out_bf16: None },
            cuda::rope::RopePart { x: &gx[1], dims: dims[1], out: gy1, out_bf16: None },
        ];
        cuda::rope::rope_forward(dev, &mut parts, &gcos, &gsin).unwrap();
        let mut ys = Vec::new();
        for p in 0..2 {
            let mut y = vec![0.0; xs[p].len()];
            cpu::rope::rope_forward(&xs[p], &cos, &sin, &dims[p], &mut y);
            assert_elementwise(&format!("rope forward, part {p}"), &down(dev, &gy[p]), &y);
            ys.push(y);
        }
        // Backward, with a bf16 twin on the second part only.
        let gys = [up(dev, &ys[0]), up(dev, &ys[1])];
        let mut gdx = [0, 1].map(|p| up(dev, &stale(ys[p].len())));
        let mut twin = dev.alloc::<bf16>(ys[1].len()).unwrap();
        let [gdx0, gdx1] = &mut gdx;
        let mut parts = [
            cuda::rope::RopePart { x: &gys[0], dims: dims[0], out: gdx0, out_bf16: None },
            cuda::rope::RopePart { x: &gys[1], dims: dims[1], out: gdx1, out_bf16: Some(&mut twin) },
        ];
        cuda::rope::rope_backward(dev, &mut parts, &gcos, &gsin).unwrap();
        for p in 0..2 {
            let mut dx = stale(ys[p].len());
            cpu::rope::rope_backward(&ys[p], &cos, &sin, &dims[p], &mut dx);
            assert_elementwise(&format!("rope backward, part {p}"), &down(dev, &gdx[p]), &dx);
        }
        assert_twin(dev, "rope dx", &gdx[1], &gdx[1], &twin);
    }
    // Parts of different lengths cannot share a launch.
    let dims = [1, 2].map(|seq| RopeDims { batch: 1, seq, heads: 1, head_dim: 2, pos_offset: 0 });
    let (cos, sin) = cpu::rope::rope_table(2, 2, 10000.0);
    let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
    let (x0, x1) = (up(dev, &[1.0; 2]), up(dev, &[1.0; 4]));
    let (mut y0, mut y1) = (dev.alloc(2).unwrap(), dev.alloc(4).unwrap());
    let mut parts = [
        cuda::rope::RopePart { x: &x0, dims: dims[0], out: &mut y0, out_bf16: None },
        cuda::rope::RopePart { x: &x1, dims: dims[1], out: &mut y1, out_bf16: None },
    ];
    let result = cuda::rope::rope_forward(dev, &mut parts, &gcos, &gsin);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

/// The packed QKV rows `[B, T, 3, H, D]` split into R q, R k and v, and the backward writing
/// `[Rᵀ dq | Rᵀ dk | dv]` rows (with their bf16 twin), against the CPU's rotations of each
/// part: one launch each way.
#[test]
fn rope_of_packed_qkv_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(10);
    for (batch, seq, heads, head_dim) in [(2, 37, 4, 64), (1, 5, 3, 18), (3, 1, 1, 2)] {
        let (cos, sin) = cpu::rope::rope_table(seq, head_dim, 10000.0);
        let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
        let dims = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
        let (tokens, width) = (batch * seq, heads * head_dim);
        let qkv = rng.vec(3 * dims.len(), -2.0, 2.0);
        // Part p of every token's row, as a dense [B, T, H, D].
        let part = |rows: &[f32], p: usize| -> Vec<f32> {
            (0..tokens).flat_map(|t| rows[(3 * t + p) * width..(3 * t + p + 1) * width].to_vec()).collect()
        };
        // R q, R k and v of packed rows, into f32 outputs or into bf16 ones alone (for the
        // tensor-core attention).
        let into_f32 = |packed: Values| {
            let mut outs = [0, 1, 2].map(|_| up(dev, &stale(dims.len())));
            let [q, k, v] = &mut outs;
            cuda::rope::rope_qkv_forward(dev, packed, dims, [q, k, v].map(ValuesMut::F32), &gcos, &gsin).unwrap();
            outs
        };
        let into_bf16 = |packed: Values| {
            let mut outs = [0, 1, 2].map(|_| dev.alloc::<bf16>(dims.len()).unwrap());
            let [q, k, v] = &mut outs;
            cuda::rope::rope_qkv_forward(dev, packed, dims, [q, k, v].map(ValuesMut::Bf16), &gcos, &gsin).unwrap();
            outs
        };
        // The bf16 outputs are the f32 ones rounded.
        let gqkv = up(dev, &qkv);
        let (outs, rounded) = (into_f32(Values::F32(&gqkv)), into_bf16(Values::F32(&gqkv)));
        // From the packed product stored in bf16, as under bf16 products: the rotations of the
        // rounded values, in f32 and in bf16.
        let qkv_bf16: Vec<bf16> = qkv.iter().map(|&x| bf16::from_f32(x)).collect();
        let qkv_rounded: Vec<f32> = qkv_bf16.iter().map(|x| x.to_f32()).collect();
        let gqkv_bf16 = dev.upload(&qkv_bf16).unwrap();
        let (from_bf16, both_bf16) = (into_f32(Values::Bf16(&gqkv_bf16)), into_bf16(Values::Bf16(&gqkv_bf16)));
        for (p, (out, out_bf16)) in outs.iter().zip(&rounded).enumerate() {
            let rotated = |rows: &[f32]| {
                let x = part(rows, p);
                let mut want = x.clone();
                if p < 2 {
                    cpu::rope::rope_forward(&x, &cos, &sin, &dims, &mut want);
                }
                want
            };
            assert_elementwise(&format!("rope of packed qkv, part {p}"), &down(dev, out), &rotated(&qkv));
            assert_twin(dev, &format!("rope of packed qkv in bf16, part {p}"), out, out, out_bf16);
            let (f32_out, bf16_out) = (&from_bf16[p], &both_bf16[p]);
            let what = format!("rope of packed bf16 qkv, part {p}");
            assert_elementwise(&what, &down(dev, f32_out), &rotated(&qkv_rounded));
            assert_twin(dev, &format!("{what}, into bf16"), f32_out, f32_out, bf16_out);
        }
        let grads = [0, 1, 2].map(|_| rng.vec(dims.len(), -2.0, 2.0));
        let ggrads = grads.each_ref().map(|g| up(dev, g));
        let backward = |grads: [Values; 3], dqkv: ValuesMut| {
            cuda::rope::rope_qkv_backward(dev, grads, dims, dqkv, &gcos, &gsin).unwrap();
        };
        let unrotated = |grads: &[Vec<f32>; 3], got: &[f32], what: &str| {
            for (p, grad) in grads.iter().enumerate() {
                let mut want = grad.clone();
                if p < 2 {
                    cpu::rope::rope_backward(grad, &cos, &sin, &dims, &mut want);
                }
                assert_elementwise(&format!("{what}, part {p}"), &part(got, p), &want);
            }
        };
        let mut dqkv = up(dev, &stale(3 * dims.len()));
        backward(ggrads.each_ref().map(Values::F32), ValuesMut::F32(&mut dqkv));
        unrotated(&grads, &down(dev, &dqkv), "rope of packed qkv backward");
        // From bf16 gradients (the tensor-core attention's), into f32 and into bf16 alone:
        // the rotations of the rounded values, and the bf16 result their rounding.
        let rounded = grads.each_ref().map(|g| bf16_rounded(g));
        let grads_bf16 = grads.each_ref().map(|g| up_bf16(dev, g));
        let (mut from_bf16, mut alone) = (up(dev, &stale(3 * dims.len())), dev.alloc::<bf16>(3 * dims.len()).unwrap());
        backward(grads_bf16.each_ref().map(Values::Bf16), ValuesMut::F32(&mut from_bf16));
        unrotated(&rounded, &down(dev, &from_bf16), "rope of packed qkv backward from bf16");
        backward(grads_bf16.each_ref().map(Values::Bf16), ValuesMut::Bf16(&mut alone));
        assert_twin(dev, "packed dqkv in bf16 alone", &from_bf16, &from_bf16, &alone);
        // The three gradients share one element type.
        let mixed = [Values::Bf16(&grads_bf16[0]), Values::F32(&ggrads[1]), Values::Bf16(&grads_bf16[2])];
        let refused = cuda::rope::rope_qkv_backward(dev, mixed, dims, ValuesMut::Bf16(&mut alone), &gcos, &gsin);
        assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    }
    // A packed buffer of the wrong length is an error, not a wild read.
    let dims = RopeDims { batch: 1, seq: 2, heads: 1, head_dim: 2, pos_offset: 0 };
    let (cos, sin) = cpu::rope::rope_table(2, 2, 10000.0);
    let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
    let short = up(dev, &[1.0; 8]);
    let mut outs = [0, 1, 2].map(|_| dev.alloc::<f32>(4).unwrap());
    let [q, k, v] = &mut outs;
    let outputs = [q, k, v].map(ValuesMut::F32);
    let result = cuda::rope::rope_qkv_forward(dev, Values::F32(&short), dims, outputs, &gcos, &gsin);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

/// The gather and the scatter-add read their indices from one device buffer laid out as
/// `tensor::Tokens` lays it out (`[ids | grouping_table(ids)]`).
#[test]
fn embedding_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(9);
    let (vocab, dim, n) = (1000, 64, 4096);
    let weight = rng.vec(vocab * dim, -1.0, 1.0);
    // Few distinct ids, so rows repeat a lot in the scatter-add.
    let ids: Vec<u32> = (0..n).map(|_| rng.below(97)).collect();
    let staged = |ids: &[u32]| dev.upload(&[ids, &cpu::embedding::grouping_table(ids)].concat()).unwrap();
    let runs = |table| {
        let grouping = DeviceRun::new(table, n, cpu::embedding::grouping_table_len(n)).unwrap();
        (DeviceRun::new(table, 0, n).unwrap(), grouping)
    };
    let (gw, table) = (up(dev, &weight), staged(&ids));
    let (gids, grouping) = runs(&table);
    let mut out = vec![0.0; n * dim];
    cpu::embedding::embedding_forward(&weight, dim, &ids, &mut out);
    let mut gout = dev.alloc(n * dim).unwrap();
    cuda::embedding::embedding_forward(dev, &gw, dim, gids, &mut gout).unwrap();
    assert_eq!(down(dev, &gout), out, "gather is exact");
    // The backward sums each id's rows in position order, as the CPU does: the two agree bit
    // for bit, every run gives the same bits, and stale contents are overwritten.
    let (dy, gdy) = {
        let dy = rng.vec(n * dim, -1.0, 1.0);
        let gdy = up(dev, &dy);
        (dy, gdy)
    };
    let mut dweight = stale(vocab * dim);
    cpu::embedding::embedding_backward(&ids, &dy, dim, &mut dweight);
    for _ in 0..2 {
        let mut gdw = up(dev, &stale(vocab * dim));
        cuda::embedding::embedding_backward(dev, grouping, &gdy, dim, &mut gdw).unwrap();
        assert_eq!(down(dev, &gdw), dweight, "embedding backward is the CPU's, bit for bit");
    }
    // Ids ≥ V read as zero rows and their gradients are dropped: as if those positions had
    // an id (500) no other position has, whose row is then cleared.
    let mut with_bad = ids.clone();
    for (i, bad) in [(3, vocab as u32), (100, u32::MAX), (4000, vocab as u32 + 7)] {
        with_bad[i] = bad;
    }
    let table = staged(&with_bad);
    let (gids, grouping) = runs(&table);
    cuda::embedding::embedding_forward(dev, &gw, dim, gids, &mut gout).unwrap();
    let gathered = down(dev, &gout);
    for (i, &id) in with_bad.iter().enumerate() {
        let want = if (id as usize) < vocab { &out[i * dim..][..dim] } else { &[0.0; 64][..] };
        assert_eq!(&gathered[i * dim..][..dim], want, "row {i} (id {id})");
    }
    let stand_in: Vec<u32> = with_bad.iter().map(|&id| if (id as usize) < vocab { id } else { 500 }).collect();
    cpu::embedding::embedding_backward(&stand_in, &dy, dim, &mut dweight);
    dweight[500 * dim..][..dim].fill(0.0);
    let mut gdw = up(dev, &stale(vocab * dim));
    cuda::embedding::embedding_backward(dev, grouping, &gdy, dim, &mut gdw).unwrap();
    assert_eq!(down(dev, &gdw), dweight, "ids ≥ V dropped from the backward");
}

/// The backward's shape errors: a table that is not `3N + 2` elements, and `dy` of another N.
#[test]
fn embedding_backward_rejects_a_bad_table() {
    let dev = device_or_skip!();
    let (dy, mut dw) = (up(dev, &[0.0; 8]), dev.alloc::<f32>(6).unwrap());
    let table = dev.upload(&cpu::embedding::grouping_table(&[0, 1, 1, 2])).unwrap();
    let short = DeviceRun::new(&table, 0, table.len() - 1).unwrap();
    let result = cuda::embedding::embedding_backward(dev, short, &dy, 2, &mut dw);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    let result = cuda::embedding::embedding_backward(dev, (&table).into(), &dy, 4, &mut dw);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "dy of 2 ids for a table of 4: {result:?}");
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
        cuda::attention::causal_attention_forward(
            dev,
            [&gq, &gk, &gv].map(Values::F32),
            &dims,
            F32,
            (ValuesMut::F32(&mut gout), None),
            &mut glse,
        )
        .unwrap();
        assert_reduced(&format!("attention out {c:?}"), &down(dev, &gout), &out);
        let (mut gout2, mut gout16) = (dev.alloc(q.len()).unwrap(), dev.alloc::<bf16>(q.len()).unwrap());
        let twin = (ValuesMut::F32(&mut gout2), Some(&mut gout16));
        cuda::attention::causal_attention_forward(dev, [&gq, &gk, &gv].map(Values::F32), &dims, F32, twin, &mut glse)
            .unwrap();
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
            [&gq, &gk, &gv].map(Values::F32),
            Values::F32(&up(dev, &out)),
            &up(dev, &lse),
            Values::F32(&up(dev, &dout)),
            &dims,
            F32,
            ValuesMut::F32(&mut gdq),
            ValuesMut::F32(&mut gdk),
            (ValuesMut::F32(&mut gdv), None),
        )
        .unwrap();
        assert_reduced(&format!("attention dq {c:?}"), &down(dev, &gdq), &dq);
        assert_reduced(&format!("attention dk {c:?}"), &down(dev, &gdk), &dk);
        assert_reduced(&format!("attention dv {c:?}"), &down(dev, &gdv), &dv);
        let (mut gdv2, mut gdv16) = (up(dev, &sk), dev.alloc::<bf16>(k.len()).unwrap());
        let (out_saved, lse_saved, dout_up) = (up(dev, &out), up(dev, &lse), up(dev, &dout));
        let dv_twin = (ValuesMut::F32(&mut gdv2), Some(&mut gdv16));
        cuda::attention::causal_attention_backward(
            dev,
            [&gq, &gk, &gv].map(Values::F32),
            Values::F32(&out_saved),
            &lse_saved,
            Values::F32(&dout_up),
            &dims,
            F32,
            ValuesMut::F32(&mut gdq),
            ValuesMut::F32(&mut gdk),
            dv_twin,
        )
        .unwrap();
        // The CUDA-core kernels write f32 gradients only.
        let mut dq16 = dev.alloc::<bf16>(q.len()).unwrap();
        let refused = cuda::attention::causal_attention_backward(
            dev,
            [&gq, &gk, &gv].map(Values::F32),
            Values::F32(&out_saved),
            &lse_saved,
            Values::F32(&dout_up),
            &dims,
            F32,
            ValuesMut::Bf16(&mut dq16),
            ValuesMut::F32(&mut gdk),
            (ValuesMut::F32(&mut gdv), None),
        );
        assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
        assert_twin(dev, &format!("attention dv {c:?}"), &gdv2, &gdv, &gdv16);
    }
    // A head dimension past the kernels' limit is refused.
    let big = dev.alloc(256).unwrap();
    let (mut o, mut l) = (dev.alloc(256).unwrap(), dev.alloc(1).unwrap());
    let dims = AttentionDims { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 256, scale: 1.0 };
    let result = cuda::attention::causal_attention_forward(
        dev,
        [&big, &big, &big].map(Values::F32),
        &dims,
        F32,
        (ValuesMut::F32(&mut o), None),
        &mut l,
    );
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

/// `values` rounded to bf16 and back: the operands the tensor-core kernels multiply.
fn bf16_rounded(values: &[f32]) -> Vec<f32> {
    values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// The tensor-core kernels (bf16 products) against the CPU's f32 attention of the same
/// bf16-rounded q, k, v and dout. What remains is the rounding of the probabilities P and of
/// dS to bf16 before their products (relative 2⁻⁹ each), hence 1e-2 of the largest value;
/// a wrong mask, tile or fragment is off by O(1). lse depends on scores alone: f32 sums.
/// The backward also reads dO in bf16 for δ = Σ dO ⊙ O (so dP − δ cancels as in f32).
#[test]
fn tensor_core_attention_agrees_to_bf16_precision() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(11);
    let cases = [
        AttentionCase { batch: 2, q_seq: 70, kv_seq: 70, heads: 3, head_dim: 16 },
        AttentionCase { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 32 },
        AttentionCase { batch: 1, q_seq: 0, kv_seq: 4, heads: 2, head_dim: 16 },
        // The decoding case (Tq < Tk) and partial tiles of keys and queries.
        AttentionCase { batch: 2, q_seq: 5, kv_seq: 133, heads: 2, head_dim: 48 },
        AttentionCase { batch: 1, q_seq: 129, kv_seq: 200, heads: 2, head_dim: 64 },
        AttentionCase { batch: 1, q_seq: 192, kv_seq: 192, heads: 2, head_dim: 64 },
        // Enough heads that a backward block takes several key tiles (the partial dq read back
        // and added to): 256 heads, 2 groups of 3 key tiles; 512 heads, one group of 3, with
        // query tiles that do not start on a key tile's boundary (Tk − Tq = 70).
        AttentionCase { batch: 32, q_seq: 150, kv_seq: 150, heads: 8, head_dim: 16 },
        AttentionCase { batch: 64, q_seq: 100, kv_seq: 170, heads: 8, head_dim: 32 },
    ];
    for c in cases {
        let AttentionCase { batch, q_seq, kv_seq, heads, head_dim } = c;
        let dims = AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
        let q = rng.vec(dims.q_len(), -2.0, 2.0);
        let k = rng.vec(dims.kv_len(), -2.0, 2.0);
        let v = rng.vec(k.len(), -1.0, 1.0);
        let dout = rng.vec(q.len(), -1.0, 1.0);
        let (qr, kr, vr, dout_r) = (bf16_rounded(&q), bf16_rounded(&k), bf16_rounded(&v), bf16_rounded(&dout));
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; dims.lse_len()]);
        cpu::attention::causal_attention_forward(&qr, &kr, &vr, &dims, &mut out, &mut lse);
        let (mut dq, mut dk, mut dv) = (stale(q.len()), stale(k.len()), stale(k.len()));
        cpu::attention::causal_attention_backward(&qr, &kr, &vr, &out, &lse, &dout_r, &dims, &mut dq, &mut dk, &mut dv);

        let (gq, gk, gv) = (up(dev, &q), up(dev, &k), up(dev, &v));
        let (mut gout, mut glse) = (up(dev, &stale(q.len())), up(dev, &stale(lse.len())));
        let mut gout16 = dev.alloc::<bf16>(q.len()).unwrap();
        let twin = (ValuesMut::F32(&mut gout), Some(&mut gout16));
        cuda::attention::causal_attention_forward(dev, [&gq, &gk, &gv].map(Values::F32), &dims, Bf16, twin, &mut glse)
            .unwrap();
        // 1e-2 of the largest value, and at least 1e-4 (the inputs are O(1)): with one visible
        // key the gradients are 0 up to the rounding of dP − δ.
        let bf16_close = |what: &str, got: &[f32], want: &[f32]| {
            let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            super::assert_close_to(what, got, want, 1e-2, (1e-2 * largest).max(1e-4))
        };
        bf16_close(&format!("tensor-core attention out {c:?}"), &down(dev, &gout), &out);
        assert_reduced(&format!("tensor-core attention lse {c:?}"), &down(dev, &glse), &lse);
        assert_twin(dev, &format!("tensor-core attention out {c:?}"), &gout, &gout, &gout16);

        // The backward of the GPU's own forward (its out and lse), as training runs it.
        let gdout = up(dev, &dout);
        let backward = || {
            let (mut gdq, mut gdk, mut gdv) =
                (up(dev, &stale(q.len())), up(dev, &stale(k.len())), up(dev, &stale(k.len())));
            let mut gdv16 = dev.alloc::<bf16>(k.len()).unwrap();
            let dv_twin = (ValuesMut::F32(&mut gdv), Some(&mut gdv16));
            cuda::attention::causal_attention_backward(
                dev,
                [&gq, &gk, &gv].map(Values::F32),
                Values::F32(&gout),
                &glse,
                Values::F32(&gdout),
                &dims,
                Bf16,
                ValuesMut::F32(&mut gdq),
                ValuesMut::F32(&mut gdk),
                dv_twin,
            )
            .unwrap();
            assert_twin(dev, &format!("tensor-core attention dv {c:?}"), &gdv, &gdv, &gdv16);
            [gdq, gdk, gdv].map(|g| down(dev, &g))
        };
        let [gdq, gdk, gdv] = backward();
        bf16_close(&format!("tensor-core attention dq {c:?}"), &gdq, &dq);
        bf16_close(&format!("tensor-core attention dk {c:?}"), &gdk, &dk);
        bf16_close(&format!("tensor-core attention dv {c:?}"), &gdv, &dv);
        let gradients = [gdq, gdk, gdv];
        assert_eq!(backward(), gradients, "tensor-core attention backward is deterministic {c:?}");

        // q, k and v already in bf16 (RoPE's output under bf16 products): the same bits as
        // f32 inputs rounded by the kernels' staging, into an f32 output, or into a bf16 one
        // alone (the f32 output's twin, bit for bit).
        let (hq, hk, hv) = (up_bf16(dev, &q), up_bf16(dev, &k), up_bf16(dev, &v));
        let (mut hout, mut hlse) = (up(dev, &stale(q.len())), up(dev, &stale(lse.len())));
        let inputs = [&hq, &hk, &hv].map(Values::Bf16);
        let into_f32 = (ValuesMut::F32(&mut hout), None);
        cuda::attention::causal_attention_forward(dev, inputs, &dims, Bf16, into_f32, &mut hlse).unwrap();
        assert_eq!(down(dev, &hout), down(dev, &gout), "bf16 inputs: out {c:?}");
        assert_eq!(down(dev, &hlse), down(dev, &glse), "bf16 inputs: lse {c:?}");
        let mut hout16 = dev.alloc::<bf16>(q.len()).unwrap();
        let into_bf16 = (ValuesMut::Bf16(&mut hout16), None);
        cuda::attention::causal_attention_forward(dev, inputs, &dims, Bf16, into_bf16, &mut hlse).unwrap();
        let bits = |x: &DeviceBuffer<bf16>| dev.download(x).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&hout16), bits(&gout16), "bf16 inputs: the bf16 output {c:?}");
        assert_eq!(down(dev, &hlse), down(dev, &glse), "bf16 inputs, bf16 output: lse {c:?}");
        // Their backward reads that bf16 output (δ = Σ dO ⊙ O of the stored O, as
        // FlashAttention-2): within bf16 precision of the CPU, and deterministic.
        let gdout16 = up_bf16(dev, &dout);
        let backward_from = |dout: Values, [dq, dk, dv]: [ValuesMut; 3]| {
            cuda::attention::causal_attention_backward(
                dev,
                inputs,
                Values::Bf16(&hout16),
                &hlse,
                dout,
                &dims,
                Bf16,
                dq,
                dk,
                (dv, None),
            )
            .unwrap();
        };
        let f32_backward = || {
            let mut grads = [q.len(), k.len(), k.len()].map(|len| up(dev, &stale(len)));
            let [hdq, hdk, hdv] = &mut grads;
            backward_from(Values::F32(&gdout), [hdq, hdk, hdv].map(ValuesMut::F32));
            grads
        };
        let grads = f32_backward();
        let [hdq, hdk, hdv] = grads.each_ref().map(|g| down(dev, g));
        bf16_close(&format!("tensor-core attention from a bf16 output, dq {c:?}"), &hdq, &dq);
        bf16_close(&format!("tensor-core attention from a bf16 output, dk {c:?}"), &hdk, &dk);
        bf16_close(&format!("tensor-core attention from a bf16 output, dv {c:?}"), &hdv, &dv);
        let again = f32_backward().each_ref().map(|g| down(dev, g));
        assert_eq!(again, [hdq, hdk, hdv], "the backward from a bf16 output is deterministic {c:?}");
        // The gradients in bf16 alone (RoPE's backward reads them so): the f32 ones rounded.
        // dO in bf16 (the output projection's input gradient under bf16 products): the products
        // and δ read it rounded either way, so the same bits.
        let mut from_bf16 = [q.len(), k.len(), k.len()].map(|len| up(dev, &stale(len)));
        let [bdq, bdk, bdv] = &mut from_bf16;
        backward_from(Values::Bf16(&gdout16), [bdq, bdk, bdv].map(ValuesMut::F32));
        let from_bf16 = from_bf16.each_ref().map(|g| down(dev, g));
        assert_eq!(from_bf16, again, "tensor-core attention backward from a bf16 dout {c:?}");
        let mut alone = [q.len(), k.len(), k.len()].map(|len| dev.alloc::<bf16>(len).unwrap());
        let [adq, adk, adv] = &mut alone;
        backward_from(Values::F32(&gdout), [adq, adk, adv].map(ValuesMut::Bf16));
        for (name, (f32_grad, bf16_grad)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&alone)) {
            assert_twin(
                dev,
                &format!("tensor-core attention {name} in bf16 alone {c:?}"),
                f32_grad,
                f32_grad,
                bf16_grad,
            );
        }
    }
    // bf16 inputs need the tensor-core kernels, and q, k and v share one element type.
    let dims = AttentionDims { batch: 1, q_seq: 2, kv_seq: 2, heads: 1, head_dim: 16, scale: 1.0 };
    let (halves, floats) = (dev.alloc::<bf16>(32).unwrap(), dev.alloc::<f32>(32).unwrap());
    let (mut o, mut l) = (dev.alloc(32).unwrap(), dev.alloc(2).unwrap());
    let all_bf16 = [&halves, &halves, &halves].map(Values::Bf16);
    let refused =
        cuda::attention::causal_attention_forward(dev, all_bf16, &dims, F32, (ValuesMut::F32(&mut o), None), &mut l);
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    let mixed = [Values::Bf16(&halves), Values::F32(&floats), Values::Bf16(&halves)];
    let refused =
        cuda::attention::causal_attention_forward(dev, mixed, &dims, Bf16, (ValuesMut::F32(&mut o), None), &mut l);
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    // A bf16 output only from bf16 q, k and v, and their backward only from a bf16 output.
    let mut o16 = dev.alloc::<bf16>(32).unwrap();
    let all_f32 = [&floats, &floats, &floats].map(Values::F32);
    let into_bf16 = (ValuesMut::Bf16(&mut o16), None);
    let refused = cuda::attention::causal_attention_forward(dev, all_f32, &dims, Bf16, into_bf16, &mut l);
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    let (mut gq, mut gk, mut gv) = (dev.alloc(32).unwrap(), dev.alloc(32).unwrap(), dev.alloc(32).unwrap());
    let refused = cuda::attention::causal_attention_backward(
        dev,
        all_bf16,
        Values::F32(&floats),
        &l,
        Values::F32(&floats),
        &dims,
        Bf16,
        ValuesMut::F32(&mut gq),
        ValuesMut::F32(&mut gk),
        (ValuesMut::F32(&mut gv), None),
    );
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    // A bf16 dout only beside bf16 q, k and v.
    let grads = (ValuesMut::F32(&mut gq), ValuesMut::F32(&mut gk), (ValuesMut::F32(&mut gv), None));
    let (out, dout) = (Values::F32(&floats), Values::Bf16(&halves));
    let refused =
        cuda::attention::causal_attention_backward(dev, all_f32, out, &l, dout, &dims, Bf16, grads.0, grads.1, grads.2);
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
    // Head dims the tensor-core kernels do not take are refused, not run on the CUDA cores.
    let buffer = dev.alloc(128).unwrap();
    let (mut o, mut l) = (dev.alloc(128).unwrap(), dev.alloc(1).unwrap());
    let dims = AttentionDims { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 128, scale: 1.0 };
    let result = cuda::attention::causal_attention_forward(
        dev,
        [&buffer, &buffer, &buffer].map(Values::F32),
        &dims,
        Bf16,
        (ValuesMut::F32(&mut o), None),
        &mut l,
    );
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}
