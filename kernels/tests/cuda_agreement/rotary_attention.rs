//! The tensor-core attention backward writing the packed QKV product's gradient itself
//! (`causal_attention_backward_packed`: dq and dk rotated back by RoPE's tables as they are
//! stored) against the unfused path it replaces: the backward into dense f32 gradients, then
//! RoPE's packed backward (`rope_qkv_backward`); and the kernels reading the packed product
//! unrotated, rotating q and k as they load them (`QkvInputs::Packed`), against RoPE's
//! launch before them (`rope_qkv_forward`).

use half::bf16;
use kernels::cpu;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::rope::RopeDims;
use kernels::cuda::attention::AttentionPrecision::Bf16;
use kernels::cuda::attention::QkvInputs;
use kernels::cuda::{self, CudaError, DeviceBuffer, Values, ValuesMut};

use super::{assert_close_to, down, down_bf16, stale, up, up_bf16, Rng};

/// The fused rows are the unfused ones computed in one place: the same f32 sums rotated by
/// the same arithmetic (common.cuh's `rope_rotate_pair`), so they agree to the last bits of
/// f32 (1e-6 of the largest value: room for the compiler fusing a product otherwise), and a
/// bf16 dqkv to one bf16 step of each value (the unfused path rounds dq to bf16 before
/// rotating it). A wrong partner column, sign, position or row stride is off by O(1).
#[test]
fn packed_attention_backward_is_rope_backward_of_the_gradients() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(23);
    // (B, T, H, D): every tensor-core head dim, partial tiles, one token, no tokens.
    for (batch, seq, heads, head_dim) in
        [(2, 70, 3, 16), (1, 1, 1, 32), (2, 133, 2, 48), (1, 192, 2, 64), (1, 0, 2, 16)]
    {
        let case = format!("B {batch}, T {seq}, H {heads}, D {head_dim}");
        let rope = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale };
        // A table longer than the sequence, as the engine's cached one is.
        let (cos, sin) = cpu::rope::rope_table(seq + 5, head_dim, 10_000.0);
        let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));

        // The forward as training runs it under bf16 products: the packed product in bf16,
        // RoPE's q, k and v in bf16, attention's output in bf16.
        let packed = up_bf16(dev, &rng.vec(3 * rope.len(), -2.0, 2.0));
        let mut qkv = [0, 1, 2].map(|_| dev.alloc::<bf16>(rope.len()).unwrap());
        let [q, k, v] = &mut qkv;
        cuda::rope::rope_qkv_forward(dev, Values::Bf16(&packed), rope, [q, k, v].map(ValuesMut::Bf16), &gcos, &gsin)
            .unwrap();
        let inputs = qkv.each_ref().map(Values::Bf16);
        let (mut out, mut lse) = (dev.alloc::<bf16>(rope.len()).unwrap(), up(dev, &stale(dims.lse_len())));
        cuda::attention::causal_attention_forward(
            dev,
            inputs,
            &dims,
            Bf16,
            (ValuesMut::Bf16(&mut out), None),
            &mut lse,
        )
        .unwrap();
        let dout = up_bf16(dev, &rng.vec(rope.len(), -1.0, 1.0));
        let (out, dout) = (Values::Bf16(&out), Values::Bf16(&dout));

        // Unfused: dense f32 gradients, then RoPE's packed backward into f32 and into bf16.
        let mut grads = [0, 1, 2].map(|_| up(dev, &stale(rope.len())));
        let [dq, dk, dv] = &mut grads;
        cuda::attention::causal_attention_backward(
            dev,
            inputs,
            out,
            &lse,
            dout,
            &dims,
            Bf16,
            ValuesMut::F32(dq),
            ValuesMut::F32(dk),
            (ValuesMut::F32(dv), None),
        )
        .unwrap();
        let grads = grads.each_ref().map(Values::F32);
        let mut want = up(dev, &stale(3 * rope.len()));
        cuda::rope::rope_qkv_backward(dev, grads, rope, ValuesMut::F32(&mut want), &gcos, &gsin).unwrap();
        let want = down(dev, &want);

        // Fused, into f32 and into bf16 alone.
        let fused = |dqkv: ValuesMut| {
            let inputs = QkvInputs::Dense(inputs);
            cuda::attention::causal_attention_backward_packed(dev, inputs, out, &lse, dout, &dims, dqkv, &gcos, &gsin)
        };
        let mut got = up(dev, &stale(3 * rope.len()));
        fused(ValuesMut::F32(&mut got)).unwrap();
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_close_to(&format!("packed dqkv {case}"), &down(dev, &got), &want, 0.0, 1e-6 * largest);
        let mut alone = dev.alloc::<bf16>(3 * rope.len()).unwrap();
        fused(ValuesMut::Bf16(&mut alone)).unwrap();
        let alone = down_bf16(dev, &alone);
        assert_close_to(&format!("packed dqkv in bf16 {case}"), &alone, &want, 1.0 / 256.0, 1e-6 * largest);
        let mut again = dev.alloc::<bf16>(3 * rope.len()).unwrap();
        fused(ValuesMut::Bf16(&mut again)).unwrap();
        assert_eq!(down_bf16(dev, &again), alone, "the packed backward is deterministic {case}");
    }
}

/// What the fused backward cannot serve is refused, not written out of place.
#[test]
fn packed_attention_backward_refuses_what_it_cannot_serve() {
    let dev = device_or_skip!();
    let (seq, head_dim) = (4, 16);
    let dims = AttentionDims { batch: 1, q_seq: seq, kv_seq: seq, heads: 1, head_dim, scale: 1.0 };
    let len = seq * head_dim;
    let halves = up_bf16(dev, &vec![0.5; len]);
    let floats = up(dev, &vec![0.5; len]);
    let lse = up(dev, &vec![0.0; seq]);
    let (cos, sin) = cpu::rope::rope_table(seq, head_dim, 10_000.0);
    let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
    let bf16_qkv = [&halves, &halves, &halves].map(Values::Bf16);
    let mut dqkv = dev.alloc::<bf16>(3 * len).unwrap();
    let refuse = |qkv: [Values; 3], dims: &AttentionDims, dqkv: ValuesMut, tables: [&DeviceBuffer<f32>; 2]| {
        let (out, dout) = (Values::Bf16(&halves), Values::Bf16(&halves));
        let result = cuda::attention::causal_attention_backward_packed(
            dev,
            QkvInputs::Dense(qkv),
            out,
            &lse,
            dout,
            dims,
            dqkv,
            tables[0],
            tables[1],
        );
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    // f32 q, k and v (the CUDA cores' attention: RoPE's backward runs on its own there).
    refuse([&floats, &floats, &floats].map(Values::F32), &dims, ValuesMut::Bf16(&mut dqkv), [&gcos, &gsin]);
    // A dqkv of the wrong length.
    let mut short = dev.alloc::<bf16>(2 * len).unwrap();
    refuse(bf16_qkv, &dims, ValuesMut::Bf16(&mut short), [&gcos, &gsin]);
    // Tables shorter than the sequence.
    let (cos, sin) = cpu::rope::rope_table(seq - 1, head_dim, 10_000.0);
    let (short_cos, short_sin) = (up(dev, &cos), up(dev, &sin));
    refuse(bf16_qkv, &dims, ValuesMut::Bf16(&mut dqkv), [&short_cos, &short_sin]);
    // Queries that are not the keys' tokens (a packed product has one length).
    let fewer = AttentionDims { q_seq: seq - 1, ..dims };
    let queries = up_bf16(dev, &vec![0.5; (seq - 1) * head_dim]);
    let qkv = [Values::Bf16(&queries), Values::Bf16(&halves), Values::Bf16(&halves)];
    refuse(qkv, &fewer, ValuesMut::Bf16(&mut dqkv), [&gcos, &gsin]);
}

/// Rotating q and k as the kernels load them is RoPE's launch before them computed in place:
/// the same widening, rotation (`rope_rotate_pair`) and rounding of the same bf16 product, so
/// the output, lse and the packed gradient are the same bits, in every tensor-core head dim,
/// with partial tiles, one token and none; the table is longer than the sequence, as the
/// engine's cached one is. A wrong partner column, position, sign or row stride is off by O(1).
#[test]
fn rotating_on_load_is_rope_then_attention_bit_for_bit() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(29);
    for (batch, seq, heads, head_dim) in
        [(2, 70, 3, 16), (1, 1, 1, 32), (2, 133, 2, 48), (1, 192, 2, 64), (1, 0, 2, 16)]
    {
        let case = format!("B {batch}, T {seq}, H {heads}, D {head_dim}");
        let rope = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
        let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale: 0.3 };
        let (cos, sin) = cpu::rope::rope_table(seq + 5, head_dim, 10_000.0);
        let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
        let packed = up_bf16(dev, &rng.vec(3 * rope.len(), -2.0, 2.0));
        let dout = up_bf16(dev, &rng.vec(rope.len(), -1.0, 1.0));
        let dout = Values::Bf16(&dout);

        // RoPE's launch, then the kernels over its dense q, k and v.
        let mut parts = [0, 1, 2].map(|_| dev.alloc::<bf16>(rope.len()).unwrap());
        let [q, k, v] = &mut parts;
        cuda::rope::rope_qkv_forward(dev, Values::Bf16(&packed), rope, [q, k, v].map(ValuesMut::Bf16), &gcos, &gsin)
            .unwrap();
        let dense = parts.each_ref().map(Values::Bf16);
        let (mut want_out, mut want_lse) = (dev.alloc::<bf16>(rope.len()).unwrap(), up(dev, &stale(dims.lse_len())));
        let out = (ValuesMut::Bf16(&mut want_out), None);
        cuda::attention::causal_attention_forward(dev, dense, &dims, Bf16, out, &mut want_lse).unwrap();
        let mut want_dqkv = dev.alloc::<bf16>(3 * rope.len()).unwrap();
        let (saved, dqkv) = (Values::Bf16(&want_out), ValuesMut::Bf16(&mut want_dqkv));
        cuda::attention::causal_attention_backward_packed(
            dev,
            QkvInputs::Dense(dense),
            saved,
            &want_lse,
            dout,
            &dims,
            dqkv,
            &gcos,
            &gsin,
        )
        .unwrap();

        // The packed product read unrotated.
        let (mut out, mut lse) = (dev.alloc::<bf16>(rope.len()).unwrap(), up(dev, &stale(dims.lse_len())));
        let tables = (&gcos, &gsin);
        cuda::attention::rotary_causal_attention_forward_packed(
            dev,
            Values::Bf16(&packed),
            &dims,
            ValuesMut::Bf16(&mut out),
            &mut lse,
            tables,
        )
        .unwrap();
        // Tolerance 0: equal values, element by element (the first difference is named).
        assert_close_to(&format!("output {case}"), &down_bf16(dev, &out), &down_bf16(dev, &want_out), 0.0, 0.0);
        assert_close_to(&format!("lse {case}"), &down(dev, &lse), &down(dev, &want_lse), 0.0, 0.0);
        let mut dqkv = dev.alloc::<bf16>(3 * rope.len()).unwrap();
        let inputs = QkvInputs::Packed(Values::Bf16(&packed));
        let saved = Values::Bf16(&out);
        cuda::attention::causal_attention_backward_packed(
            dev,
            inputs,
            saved,
            &lse,
            dout,
            &dims,
            ValuesMut::Bf16(&mut dqkv),
            &gcos,
            &gsin,
        )
        .unwrap();
        let (got, want) = (down_bf16(dev, &dqkv), down_bf16(dev, &want_dqkv));
        assert_close_to(&format!("packed gradient {case}"), &got, &want, 0.0, 0.0);
    }
}

/// What the kernels cannot read from a packed product is refused before any launch.
#[test]
fn rotating_on_load_refuses_what_it_cannot_serve() {
    let dev = device_or_skip!();
    let (seq, head_dim) = (4, 16);
    let dims = AttentionDims { batch: 1, q_seq: seq, kv_seq: seq, heads: 1, head_dim, scale: 1.0 };
    let len = seq * head_dim;
    let (cos, sin) = cpu::rope::rope_table(seq, head_dim, 10_000.0);
    let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
    let (mut out, mut lse) = (dev.alloc::<bf16>(len).unwrap(), up(dev, &vec![0.0; seq]));
    let mut refuse = |qkv: Values, dims: &AttentionDims, tables: (&DeviceBuffer<f32>, &DeviceBuffer<f32>)| {
        let result = cuda::attention::rotary_causal_attention_forward_packed(
            dev,
            qkv,
            dims,
            ValuesMut::Bf16(&mut out),
            &mut lse,
            tables,
        );
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    // An f32 product (RoPE rotates f32 values before the staging rounds them: not this path).
    let floats = up(dev, &vec![0.5; 3 * len]);
    refuse(Values::F32(&floats), &dims, (&gcos, &gsin));
    // A product of the wrong length.
    let short = up_bf16(dev, &vec![0.5; 2 * len]);
    refuse(Values::Bf16(&short), &dims, (&gcos, &gsin));
    // Tables shorter than the sequence.
    let packed = up_bf16(dev, &vec![0.5; 3 * len]);
    let (cos, sin) = cpu::rope::rope_table(seq - 1, head_dim, 10_000.0);
    let (short_cos, short_sin) = (up(dev, &cos), up(dev, &sin));
    refuse(Values::Bf16(&packed), &dims, (&short_cos, &short_sin));
    // Queries that are not the keys' tokens (a packed product has one length).
    refuse(Values::Bf16(&packed), &AttentionDims { q_seq: seq - 1, ..dims }, (&gcos, &gsin));
}
