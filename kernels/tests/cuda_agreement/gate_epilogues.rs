//! The fused gate kernel writing what its consumer would: attention's q, k and v, q and k
//! rotated by RoPE (`fused_gate_forward_rotary_qkv`), and the FFN's SwiGLU
//! (`fused_gate_forward_swiglu`), each against the path it replaces: the packed gated output
//! (`fused_gate_forward_unfused`), then RoPE's packed forward (`rope_qkv_forward`) or SwiGLU of
//! its halves (`swiglu_halves_forward`); and the gate's backward computing SwiGLU's backward
//! (`OutputGrad::Swiglu`) against SwiGLU's backward launch, then the gate's; and the output
//! projection's gate inside the residual add and RMSNorm (`fused_gate_forward_add_rms_norm`)
//! against the gate into bf16, then `add_rms_norm_forward`.

use half::bf16;
use kernels::cpu;
use kernels::cpu::fused_gate::FusedGateDims;
use kernels::cpu::matmul::Store;
use kernels::cpu::rope::RopeDims;
use kernels::cpu::unary::Unary;
use kernels::cuda::fused_gate::{
    DeviceFusedGateGrads, DeviceGateGrads, GateGroup, GateProducts, OutputGrad, ResidualNorm, RotaryQkv,
};
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer, DeviceValues, Values, ValuesMut};

use super::fused_gate::{DeviceGate, GateCase};
use super::{assert_close_to, down_bf16, up, up_bf16, Rng};

/// `count` projections of one input (q, k and v; gate and up) of `dims` each, random, on the
/// device, and that input in bf16.
fn device_group(
    dev: &CudaDevice,
    rng: &mut Rng,
    dims: FusedGateDims,
    count: usize,
) -> (Vec<DeviceGate>, DeviceBuffer<bf16>) {
    let cases: Vec<GateCase> = (0..count).map(|_| GateCase::new(dims, rng, true)).collect();
    (cases.iter().map(|c| DeviceGate::new(dev, c)).collect(), up_bf16(dev, &cases[0].x))
}

/// The launchers' view of `gates` (each of `dims`, φ `phi`).
fn launch_group(gates: &[DeviceGate], dims: FusedGateDims, phi: Unary) -> Vec<GateGroup<'_>> {
    gates.iter().map(|g| GateGroup { dims, params: g.params(phi) }).collect()
}

/// The gated values are the same f32 values in both paths (the same kernel arithmetic per
/// column), rotated by the same arithmetic (common.cuh's `rope_rotate_pair`), so q and k agree
/// to one bf16 step of each value (room for the compiler fusing a product otherwise; on the
/// emulated device they are the same bits) and v, which is not rotated, bit for bit. A wrong
/// partner column, position, sign or output is off by O(1).
#[test]
fn rotary_qkv_gate_is_rope_of_the_packed_gate() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(31);
    // Head dims of the tensor cores' and one of three pairs (D = 6); partial row blocks.
    for (batch, seq, heads, head_dim, rank_channel, phi) in
        [(2, 35, 2, 16, 8, Unary::Sigmoid), (1, 70, 3, 64, 12, Unary::Silu), (3, 5, 4, 6, 8, Unary::Sigmoid)]
    {
        let (rows, d_out) = (batch * seq, heads * head_dim);
        let dims = FusedGateDims { rows, d_in: 48, d_out, rank_channel, rank_scalar: 4 };
        let what = format!("B {batch}, T {seq}, H {heads}, D {head_dim}");
        let (gates, x) = device_group(dev, &mut rng, dims, 3);
        let group = launch_group(&gates, dims, phi);
        let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
        let zu_len = rows * 3 * dims.width();
        // A table longer than the sequence, as the engine's cached one is.
        let (cos, sin) = cpu::rope::rope_table(seq + 3, head_dim, 10_000.0);
        let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));

        // Unfused: the packed gated output in f32, then RoPE into bf16 q, k and v.
        let mut zu = DeviceValues::alloc(dev, zu_len, true).unwrap();
        let mut gated = dev.alloc::<f32>(rows * 3 * d_out).unwrap();
        cuda::fused_gate::fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, ValuesMut::F32(&mut gated))
            .unwrap();
        let rope = RopeDims { batch, seq, heads, head_dim, pos_offset: 0 };
        let mut want = [0, 1, 2].map(|_| dev.alloc::<bf16>(rows * d_out).unwrap());
        let [q, k, v] = &mut want;
        cuda::rope::rope_qkv_forward(dev, Values::F32(&gated), rope, [q, k, v].map(ValuesMut::Bf16), &gcos, &gsin)
            .unwrap();

        // Fused: the gate kernel writes them.
        let mut fused_zu = DeviceValues::alloc(dev, zu_len, true).unwrap();
        let mut got = [0, 1, 2].map(|_| dev.alloc::<bf16>(rows * d_out).unwrap());
        let [q, k, v] = &mut got;
        let outs = RotaryQkv { seq, head_dim, cos: &gcos, sin: &gsin, outs: [q, k, v] };
        cuda::fused_gate::fused_gate_forward_rotary_qkv(dev, &group, &x, &packed, &mut fused_zu, outs).unwrap();

        let bits = |zu: &DeviceValues| match zu.values() {
            Values::Bf16(b) => dev.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            Values::F32(_) => unreachable!("allocated in bf16"),
        };
        assert_eq!(bits(&fused_zu), bits(&zu), "the saved ZU {what}");
        for (part, (got, want)) in ["q", "k"].iter().zip(got.iter().zip(&want)) {
            let want = down_bf16(dev, want);
            let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_close_to(
                &format!("rotated {part} {what}"),
                &down_bf16(dev, got),
                &want,
                1.0 / 256.0,
                1e-6 * largest,
            );
        }
        assert_eq!(down_bf16(dev, &got[2]), down_bf16(dev, &want[2]), "v {what}");
    }
}

/// What the rotary epilogue cannot serve is refused, not written out of place.
#[test]
fn rotary_qkv_gate_refuses_what_it_cannot_serve() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(32);
    let (seq, heads, head_dim) = (4, 2, 8);
    let dims = FusedGateDims { rows: 2 * seq, d_in: 16, d_out: heads * head_dim, rank_channel: 4, rank_scalar: 4 };
    let (gates, x) = device_group(dev, &mut rng, dims, 3);
    let group = launch_group(&gates, dims, Unary::Sigmoid);
    let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
    let (cos, sin) = cpu::rope::rope_table(seq, head_dim, 10_000.0);
    let (gcos, gsin) = (up(dev, &cos), up(dev, &sin));
    let (short_cos, short_sin) = cpu::rope::rope_table(seq - 1, head_dim, 10_000.0);
    let (short_cos, short_sin) = (up(dev, &short_cos), up(dev, &short_sin));
    let mut outs = [0, 1, 2].map(|_| dev.alloc::<bf16>(dims.rows * dims.d_out).unwrap());
    let refuse = |group: &[GateGroup],
                  bf16_zu: bool,
                  seq: usize,
                  head_dim: usize,
                  tables: [&DeviceBuffer<f32>; 2],
                  outs: &mut [DeviceBuffer<bf16>; 3]| {
        let [q, k, v] = outs;
        let rope = RotaryQkv { seq, head_dim, cos: tables[0], sin: tables[1], outs: [q, k, v] };
        let width: usize = group.iter().map(|g| g.dims.width()).sum();
        let mut zu = DeviceValues::alloc(dev, dims.rows * width, bf16_zu).unwrap();
        let result = cuda::fused_gate::fused_gate_forward_rotary_qkv(dev, group, &x, &packed, &mut zu, rope);
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    let tables = [&gcos, &gsin];
    // Two projections, not q, k and v.
    refuse(&group[..2], true, seq, head_dim, tables, &mut outs);
    // An f32 ZU (f32 products).
    refuse(&group, false, seq, head_dim, tables, &mut outs);
    // Rows that are not whole sequences.
    refuse(&group, true, seq + 1, head_dim, tables, &mut outs);
    // A head dim that does not split the width, or is odd.
    refuse(&group, true, seq, 6, tables, &mut outs);
    refuse(&group, true, seq, 1, tables, &mut outs);
    // Tables shorter than the sequence.
    refuse(&group, true, seq, head_dim, [&short_cos, &short_sin], &mut outs);
    // An output of the wrong length.
    let mut short = [0, 1, 2].map(|i| dev.alloc::<bf16>(dims.rows * dims.d_out - i).unwrap());
    refuse(&group, true, seq, head_dim, tables, &mut short);
}

/// The bits of a bf16 buffer.
fn bits(dev: &CudaDevice, buffer: &DeviceBuffer<bf16>) -> Vec<u16> {
    dev.download(buffer).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// SwiGLU's epilogue reads the gated values as they are stored (rounded to bf16) with
/// swiglu.cu's arithmetic, so the gated output and SwiGLU's are the two launches' bits.
#[test]
fn swiglu_gate_is_swiglu_of_the_packed_gate() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(33);
    // Two column tiles (300 > 256), an odd width, partial row blocks.
    for (rows, d_out, rank_channel, phi) in
        [(70, 96, 8, Unary::Silu), (33, 300, 12, Unary::Sigmoid), (5, 17, 8, Unary::Silu)]
    {
        let dims = FusedGateDims { rows, d_in: 48, d_out, rank_channel, rank_scalar: 4 };
        let what = format!("{dims:?} {phi:?}");
        let (gates, x) = device_group(dev, &mut rng, dims, 2);
        let group = launch_group(&gates, dims, phi);
        let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
        let zu_len = rows * 2 * dims.width();

        let mut zu = DeviceValues::alloc(dev, zu_len, true).unwrap();
        let mut gated = dev.alloc::<bf16>(rows * 2 * d_out).unwrap();
        cuda::fused_gate::fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, ValuesMut::Bf16(&mut gated))
            .unwrap();
        let mut y = dev.alloc::<bf16>(rows * d_out).unwrap();
        cuda::swiglu::swiglu_halves_forward(dev, Values::Bf16(&gated), d_out, (ValuesMut::Bf16(&mut y), None)).unwrap();

        let mut fused_zu = DeviceValues::alloc(dev, zu_len, true).unwrap();
        let mut fused_gated = dev.alloc::<bf16>(rows * 2 * d_out).unwrap();
        let mut fused_y = dev.alloc::<bf16>(rows * d_out).unwrap();
        cuda::fused_gate::fused_gate_forward_swiglu(
            dev,
            &group,
            &x,
            &packed,
            &mut fused_zu,
            &mut fused_gated,
            &mut fused_y,
        )
        .unwrap();
        assert_eq!(bits(dev, &fused_gated), bits(dev, &gated), "the gated output {what}");
        assert_eq!(bits(dev, &fused_y), bits(dev, &y), "SwiGLU's output {what}");
    }
    // Gate and up of different widths, three projections, an f32 ZU or outputs of the wrong
    // length are refused.
    let dims = |d_out| FusedGateDims { rows: 4, d_in: 16, d_out, rank_channel: 4, rank_scalar: 4 };
    let mut cases = [8, 12, 8].map(|d_out| GateCase::new(dims(d_out), &mut rng, true));
    let x = cases[0].x.clone();
    cases.iter_mut().for_each(|c| c.x = x.clone());
    let gates: Vec<DeviceGate> = cases.iter().map(|c| DeviceGate::new(dev, c)).collect();
    let group_of = |at: &[usize]| -> Vec<GateGroup> {
        at.iter().map(|&i| GateGroup { dims: cases[i].dims, params: gates[i].params(Unary::Silu) }).collect()
    };
    let (uneven, even) = (group_of(&[0, 1]), group_of(&[0, 2]));
    let x = up_bf16(dev, &x);
    let refuse = |group: &[GateGroup], bf16_zu: bool, gated_len: usize, y_len: usize| {
        let packed = cuda::fused_gate::pack_weight(dev, group).unwrap();
        let width: usize = group.iter().map(|g| g.dims.width()).sum();
        let mut zu = DeviceValues::alloc(dev, 4 * width, bf16_zu).unwrap();
        let (mut gated, mut y) = (dev.alloc::<bf16>(gated_len).unwrap(), dev.alloc::<bf16>(y_len).unwrap());
        let result = cuda::fused_gate::fused_gate_forward_swiglu(dev, group, &x, &packed, &mut zu, &mut gated, &mut y);
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    refuse(&uneven, true, 4 * 20, 4 * 8);
    refuse(&group_of(&[0, 2, 0]), true, 4 * 24, 4 * 8);
    refuse(&even, false, 4 * 16, 4 * 8);
    refuse(&even, true, 4 * 16, 4 * 8 - 1);
    refuse(&even, true, 4 * 16 - 1, 4 * 8);
}

/// Every gradient buffer of a gated group's backward (`fused_gate_backward`'s outputs).
struct GroupGrads {
    x: DeviceBuffer<f32>,
    weights: DeviceBuffer<f32>,
    b_channel: DeviceBuffer<f32>,
    b_scalar: DeviceBuffer<f32>,
    /// Each projection's `[da, db, dα]` of its channel modulator, then of its scalar one.
    modulators: Vec<[DeviceBuffer<f32>; 6]>,
}

impl GroupGrads {
    /// Buffers for `group`'s gradients, NaN until the backward writes them.
    fn stale(dev: &CudaDevice, group: &[GateGroup]) -> GroupGrads {
        let d = group[0].dims;
        let width: usize = group.iter().map(|g| g.dims.width()).sum();
        let out_width: usize = group.iter().map(|g| g.dims.d_out).sum();
        let nan = |len: usize| up(dev, &vec![f32::NAN; len]);
        GroupGrads {
            x: nan(d.rows * d.d_in),
            weights: nan(width * d.d_in),
            b_channel: nan(out_width * d.rank_channel),
            b_scalar: nan(group.len() * d.rank_scalar),
            modulators: group.iter().map(|g| [d.rank_channel, g.dims.d_out, 1, d.rank_scalar, 1, 1].map(nan)).collect(),
        }
    }

    /// The launcher's view of the buffers (dx written in f32).
    fn device(&mut self) -> DeviceFusedGateGrads<'_> {
        let (mut channel, mut scalar) = (Vec::new(), Vec::new());
        for [ca, cb, calpha, sa, sb, salpha] in &mut self.modulators {
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

    /// Every buffer's bits, in field order.
    fn bits(&self, dev: &CudaDevice) -> Vec<Vec<u32>> {
        let all = [&self.x, &self.weights, &self.b_channel, &self.b_scalar].into_iter();
        let all = all.chain(self.modulators.iter().flatten());
        all.map(|b| dev.download(b).unwrap().iter().map(|v| v.to_bits()).collect()).collect()
    }
}

/// SwiGLU's backward inside the gate's row kernel (`OutputGrad::Swiglu`) computes `dẐ` with
/// swiglu.cu's arithmetic (common.cuh's `swiglu_gate_grad` and `swiglu_up_grad`), rounded to
/// bf16 as SwiGLU's backward stores it, so every gradient is the bits of SwiGLU's backward
/// launch followed by the gate's backward of its result. A swapped gate and up, a missing
/// rounding or a wrong row stride moves them.
#[test]
fn swiglu_backward_in_the_gate_is_swiglus_then_the_gates() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(34);
    // Two column tiles (300 > 256), an odd width, partial row blocks, the register rank path
    // and the other one (12).
    for (rows, d_out, rank_channel, phi) in
        [(70, 96, 8, Unary::Silu), (33, 300, 12, Unary::Sigmoid), (5, 17, 8, Unary::Silu)]
    {
        let dims = FusedGateDims { rows, d_in: 48, d_out, rank_channel, rank_scalar: 4 };
        let what = format!("{dims:?} {phi:?}");
        let (gates, x) = device_group(dev, &mut rng, dims, 2);
        let group = launch_group(&gates, dims, phi);
        let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
        let mut zu = DeviceValues::alloc(dev, rows * 2 * dims.width(), true).unwrap();
        let mut gated = dev.alloc::<bf16>(rows * 2 * d_out).unwrap();
        let mut y = dev.alloc::<bf16>(rows * d_out).unwrap();
        cuda::fused_gate::fused_gate_forward_swiglu(dev, &group, &x, &packed, &mut zu, &mut gated, &mut y).unwrap();
        let dy = up_bf16(dev, &rng.vec(rows * d_out, -1.0, 1.0));
        let products = GateProducts::Bf16 { x: &x, packed: &packed };

        // SwiGLU's backward (bf16 alone, as under bf16 products), then the gate's.
        let mut dgated = dev.alloc::<bf16>(rows * 2 * d_out).unwrap();
        let (gated_values, dy_values) = (Values::Bf16(&gated), Values::Bf16(&dy));
        cuda::swiglu::swiglu_halves_backward(dev, gated_values, dy_values, d_out, ValuesMut::Bf16(&mut dgated))
            .unwrap();
        let mut want = GroupGrads::stale(dev, &group);
        let direct = OutputGrad::Direct(Values::Bf16(&dgated));
        cuda::fused_gate::fused_gate_backward(dev, &group, &zu, direct, products, &mut want.device()).unwrap();

        let mut got = GroupGrads::stale(dev, &group);
        let swiglu = OutputGrad::Swiglu { dout: &dy, gated: &gated };
        cuda::fused_gate::fused_gate_backward(dev, &group, &zu, swiglu, products, &mut got.device()).unwrap();
        let names = ["dx", "[dW; dA_c; dA_s]", "channel dB", "scalar dB"];
        let modulator_names = ["channel da", "channel db", "channel dα", "scalar da", "scalar db", "scalar dα"];
        let names = names
            .into_iter()
            .map(String::from)
            .chain((0..2).flat_map(|i| modulator_names.iter().map(move |n| format!("projection {i} {n}"))));
        for ((name, got), want) in names.zip(got.bits(dev)).zip(want.bits(dev)) {
            let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            let first = got.iter().zip(&want).position(|(g, w)| g != w);
            assert!(got.len() == want.len() && differ == 0, "{name} {what}: {differ} differ, the first at {first:?}");
        }
    }
}

/// What SwiGLU's backward inside the gate cannot serve is refused: a group that is not two
/// projections of one width, an f32 ZU, and SwiGLU's output gradient or the gated output of
/// the wrong length.
#[test]
fn swiglu_backward_in_the_gate_refuses_what_it_cannot_serve() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(35);
    let rows = 4;
    let dims = |d_out| FusedGateDims { rows, d_in: 16, d_out, rank_channel: 4, rank_scalar: 4 };
    let mut cases = [8, 12, 8].map(|d_out| GateCase::new(dims(d_out), &mut rng, true));
    let x = cases[0].x.clone();
    cases.iter_mut().for_each(|c| c.x = x.clone());
    let gates: Vec<DeviceGate> = cases.iter().map(|c| DeviceGate::new(dev, c)).collect();
    let group_of = |at: &[usize]| -> Vec<GateGroup> {
        at.iter().map(|&i| GateGroup { dims: cases[i].dims, params: gates[i].params(Unary::Silu) }).collect()
    };
    let x = up_bf16(dev, &x);
    let refuse = |group: &[GateGroup], bf16_zu: bool, dout_len: usize, gated_len: usize| {
        let packed = cuda::fused_gate::pack_weight(dev, group).unwrap();
        let width: usize = group.iter().map(|g| g.dims.width()).sum();
        let zu = DeviceValues::alloc(dev, rows * width, bf16_zu).unwrap();
        let (dout, gated) = (dev.alloc::<bf16>(dout_len).unwrap(), dev.alloc::<bf16>(gated_len).unwrap());
        let products = GateProducts::Bf16 { x: &x, packed: &packed };
        let mut grads = GroupGrads::stale(dev, group);
        let swiglu = OutputGrad::Swiglu { dout: &dout, gated: &gated };
        let result = cuda::fused_gate::fused_gate_backward(dev, group, &zu, swiglu, products, &mut grads.device());
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    refuse(&group_of(&[0, 1]), true, rows * 8, rows * 20);
    refuse(&group_of(&[0, 2, 0]), true, rows * 12, rows * 24);
    refuse(&group_of(&[0]), true, rows * 4, rows * 8);
    refuse(&group_of(&[0, 2]), false, rows * 8, rows * 16);
    refuse(&group_of(&[0, 2]), true, rows * 8 - 1, rows * 16);
    refuse(&group_of(&[0, 2]), true, rows * 8, rows * 16 + 1);
}

/// The gated output projection's residual add and RMSNorm (`fused_gate_forward_add_rms_norm`)
/// computes `Ẑ` with the gate kernel's arithmetic (fused_gate.cu's `gated_value`), rounded to
/// bf16 as the gate stores it, and the add and the norm with norm.cu's (common.cuh's
/// `warp_add_rms_norm_row`), so the saved ZU, the sum, the normalised sum (bf16 alone, or f32) and
/// each row's rstd are the bits of the gate into bf16 then `add_rms_norm_forward`. A skipped
/// rounding, a wrong row or a wrong gate moves them.
#[test]
fn gated_add_rms_norm_is_the_gate_then_the_add_and_norm() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(36);
    // Widths a warp's lanes hold in one chunk of 4 columns or several, not a multiple of 4
    // (17: column by column), and past the 1,024 columns a lane keeps in registers (1,100);
    // more rows than a block's 8 warps; the register rank path and the other one (12).
    for (rows, d_out, rank_channel, phi, y_bf16) in [
        (7, 96, 8, Unary::Silu, true),
        (5, 300, 12, Unary::Sigmoid, true),
        (9, 17, 8, Unary::Silu, false),
        (3, 256, 8, Unary::Sigmoid, false),
        (11, 1100, 8, Unary::Silu, true),
    ] {
        let dims = FusedGateDims { rows, d_in: 48, d_out, rank_channel, rank_scalar: 4 };
        let what = format!("{dims:?} {phi:?} bf16 y {y_bf16}");
        let case = GateCase::new(dims, &mut rng, true);
        let gate = DeviceGate::new(dev, &case);
        let group = [GateGroup { dims, params: gate.params(phi) }];
        let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
        let x = up_bf16(dev, &case.x);
        let stream = up(dev, &rng.vec(rows * d_out, -2.0, 2.0));
        let weight = up(dev, &rng.vec(d_out, 0.5, 1.5));
        let norm_dims = cuda::norm::NormDims { rows, cols: d_out, eps: 1e-5 };
        let alloc_y = || DeviceValues::alloc(dev, rows * d_out, y_bf16).unwrap();
        let y_bits = |y: &DeviceValues| match y.values() {
            Values::Bf16(b) => bits(dev, b).into_iter().map(u32::from).collect::<Vec<_>>(),
            Values::F32(f) => dev.download(f).unwrap().iter().map(|v| v.to_bits()).collect(),
        };
        let f32_bits = |b: &DeviceBuffer<f32>| dev.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();

        // The gate into bf16, then the residual add and the norm.
        let mut zu = DeviceValues::alloc(dev, rows * dims.width(), true).unwrap();
        let mut gated = dev.alloc::<bf16>(rows * d_out).unwrap();
        cuda::fused_gate::fused_gate_forward_unfused(dev, &group, &x, &packed, &mut zu, ValuesMut::Bf16(&mut gated))
            .unwrap();
        let (mut sum, mut rstd, mut y) = (dev.alloc::<f32>(rows * d_out).unwrap(), dev.alloc(rows).unwrap(), alloc_y());
        let outs = (&mut sum, y.values_mut(), None);
        cuda::norm::add_rms_norm_forward(dev, (&stream, Values::Bf16(&gated)), &weight, &norm_dims, outs, &mut rstd)
            .unwrap();

        // In one launch after the GEMM.
        let mut fused_zu = DeviceValues::alloc(dev, rows * dims.width(), true).unwrap();
        let (mut fused_sum, mut fused_rstd, mut fused_y) =
            (dev.alloc::<f32>(rows * d_out).unwrap(), dev.alloc(rows).unwrap(), alloc_y());
        let norm = ResidualNorm {
            x: &stream,
            weight: &weight,
            eps: 1e-5,
            sum: &mut fused_sum,
            y: fused_y.values_mut(),
            rstd: &mut fused_rstd,
        };
        cuda::fused_gate::fused_gate_forward_add_rms_norm(dev, &group, &x, &packed, &mut fused_zu, norm).unwrap();
        let zu_bits = |zu: &DeviceValues| y_bits(zu);
        assert_eq!(zu_bits(&fused_zu), zu_bits(&zu), "the saved ZU {what}");
        assert_eq!(f32_bits(&fused_sum), f32_bits(&sum), "the sum {what}");
        assert_eq!(y_bits(&fused_y), y_bits(&y), "the normalised sum {what}");
        assert_eq!(f32_bits(&fused_rstd), f32_bits(&rstd), "rstd {what}");
    }
}

/// What the gated residual add and norm cannot serve is refused: more than one projection,
/// an f32 ZU, and a stream, weight or output of the wrong length.
#[test]
fn gated_add_rms_norm_refuses_what_it_cannot_serve() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(37);
    let (rows, d_out) = (4, 8);
    let dims = FusedGateDims { rows, d_in: 16, d_out, rank_channel: 4, rank_scalar: 4 };
    let mut cases = [0, 1].map(|_| GateCase::new(dims, &mut rng, true));
    let x = cases[0].x.clone();
    cases.iter_mut().for_each(|c| c.x = x.clone());
    let gates: Vec<DeviceGate> = cases.iter().map(|c| DeviceGate::new(dev, c)).collect();
    let group: Vec<GateGroup> = gates.iter().map(|g| GateGroup { dims, params: g.params(Unary::Silu) }).collect();
    let x = up_bf16(dev, &x);
    let refuse = |group: &[GateGroup], bf16_zu: bool, [stream, weight, sum, y, rstd]: [usize; 5]| {
        let packed = cuda::fused_gate::pack_weight(dev, group).unwrap();
        let width: usize = group.iter().map(|g| g.dims.width()).sum();
        let mut zu = DeviceValues::alloc(dev, rows * width, bf16_zu).unwrap();
        let (stream, weight) = (dev.alloc::<f32>(stream).unwrap(), dev.alloc::<f32>(weight).unwrap());
        let (mut sum, mut y, mut rstd) =
            (dev.alloc::<f32>(sum).unwrap(), dev.alloc::<bf16>(y).unwrap(), dev.alloc::<f32>(rstd).unwrap());
        let norm = ResidualNorm {
            x: &stream,
            weight: &weight,
            eps: 1e-5,
            sum: &mut sum,
            y: ValuesMut::Bf16(&mut y),
            rstd: &mut rstd,
        };
        let result = cuda::fused_gate::fused_gate_forward_add_rms_norm(dev, group, &x, &packed, &mut zu, norm);
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
    };
    let lens = [rows * d_out, d_out, rows * d_out, rows * d_out, rows];
    refuse(&group, true, [2 * rows * d_out, d_out, 2 * rows * d_out, 2 * rows * d_out, rows]);
    refuse(&group[..1], false, lens);
    for i in 0..5 {
        let mut wrong = lens;
        wrong[i] += 1;
        refuse(&group[..1], true, wrong);
    }
}
