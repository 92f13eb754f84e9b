//! The fused Transponder gate projection (bf16 representable inputs and f32 inputs) and its
//! shape checks.

use half::bf16;
use kernels::cpu;
use kernels::cpu::fused_gate::{FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams};
use kernels::cpu::matmul::Store;
use kernels::cpu::unary::Unary;
use kernels::cuda::fused_gate::{
    DeviceFusedGateGrads, DeviceFusedGateParams, DeviceGateGrads, DeviceGateParams, GateGroup, GateProducts,
};
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer, ValuesMut};

use super::{assert_close, assert_close_to, down, stale, up, up_bf16, Rng};

/// Host-side parameters of one fused projection.
pub(super) struct GateCase {
    pub(super) dims: FusedGateDims,
    pub(super) x: Vec<f32>,
    w: Vec<f32>,
    channel: [Vec<f32>; 4],
    scalar: [Vec<f32>; 4],
    alphas: (f32, f32),
}

fn round_bf16(v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
}

impl GateCase {
    /// Random parameters; `x`, `W` and the `A`s bf16-representable when `exact`.
    pub(super) fn new(dims: FusedGateDims, rng: &mut Rng, exact: bool) -> GateCase {
        let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = dims;
        let bound = 1.0 / (d_in as f32).sqrt();
        let round = |v: Vec<f32>| if exact { round_bf16(v) } else { v };
        GateCase {
            dims,
            x: round(rng.vec(rows * d_in, -2.0, 2.0)),
            w: round(rng.vec(d_out * d_in, -bound, bound)),
            channel: [
                round(rng.vec(rc * d_in, -bound, bound)),
                rng.vec(rc, -0.5, 0.5),
                rng.vec(d_out * rc, -1.0, 1.0),
                rng.vec(d_out, -0.5, 0.5),
            ],
            scalar: [
                round(rng.vec(rs * d_in, -bound, bound)),
                rng.vec(rs, -0.5, 0.5),
                rng.vec(rs, -1.0, 1.0),
                rng.vec(1, -0.5, 0.5),
            ],
            alphas: (1.3, 0.7),
        }
    }

    /// The case with `x`, `W` and the `A`s rounded to bf16, as the device multiplies them.
    fn rounded(&self) -> GateCase {
        let [ca, cab, cb, cbb] = self.channel.clone();
        let [sa, sab, sb, sbb] = self.scalar.clone();
        GateCase {
            dims: self.dims,
            x: round_bf16(self.x.clone()),
            w: round_bf16(self.w.clone()),
            channel: [round_bf16(ca), cab, cb, cbb],
            scalar: [round_bf16(sa), sab, sb, sbb],
            alphas: self.alphas,
        }
    }

    fn params(&self, phi: Unary) -> FusedGateParams<'_> {
        let gate = gate_params;
        FusedGateParams {
            weight: &self.w,
            channel: gate(&self.channel, self.alphas.0),
            scalar: gate(&self.scalar, self.alphas.1),
            phi,
        }
    }
}

/// One modulator's host parameters `[A, a, B, b]`.
fn gate_params(p: &[Vec<f32>; 4], alpha: f32) -> GateParams<'_> {
    GateParams { a_weight: &p[0], a_bias: &p[1], b_weight: &p[2], b_bias: &p[3], alpha }
}

/// One modulator's device parameters `[A, a, B, b, α]`.
fn device_gate_params(p: &[DeviceBuffer<f32>]) -> DeviceGateParams<'_> {
    DeviceGateParams { a_weight: &p[0], a_bias: &p[1], b_weight: &p[2], b_bias: &p[3], alpha: &p[4] }
}

/// The same parameters on the device, α_c and α_s as one-element buffers.
pub(super) struct DeviceGate {
    w: DeviceBuffer<f32>,
    channel: Vec<DeviceBuffer<f32>>,
    scalar: Vec<DeviceBuffer<f32>>,
}

impl DeviceGate {
    pub(super) fn new(dev: &CudaDevice, case: &GateCase) -> DeviceGate {
        DeviceGate {
            w: up(dev, &case.w),
            channel: case.channel.iter().chain([&vec![case.alphas.0]]).map(|v| up(dev, v)).collect(),
            scalar: case.scalar.iter().chain([&vec![case.alphas.1]]).map(|v| up(dev, v)).collect(),
        }
    }

    pub(super) fn params(&self, phi: Unary) -> DeviceFusedGateParams<'_> {
        let gate = device_gate_params;
        DeviceFusedGateParams { weight: &self.w, channel: gate(&self.channel), scalar: gate(&self.scalar), phi }
    }
}

/// The bound, relative to the largest value, on the device's saved `ZU` against the CPU's
/// f32 product: it is bf16 (8 significant bits, as autocast saves a product).
const BF16_ZU: f32 = 1e-2;

/// Runs the fused forward (the tensor-core kernel with the gate in its epilogue) on the
/// device and on the CPU and compares them with the relative bound `rel` (of the largest
/// value), then the unfused forward and the backward ([`check_group`], a group of one).
fn check_fused_gate(dev: &CudaDevice, case: &GateCase, phi: Unary, rel: f32) {
    let dims = case.dims;
    let FusedGateDims { rows, d_out, .. } = dims;
    // The device's forward multiplies bf16 copies of x, W and the A's (its backward reads
    // the f32 originals): the reference forward runs on the same rounded values.
    let rounded = case.rounded();
    let (mut zu, mut out) = (vec![0.0; rows * dims.width()], vec![0.0; rows * d_out]);
    cpu::fused_gate::fused_gate_forward(&dims, &rounded.x, &rounded.params(phi), &mut zu, &mut out);

    let gate = DeviceGate::new(dev, case);
    let gp = gate.params(phi);
    let packed = cuda::fused_gate::pack_weight(dev, &[GateGroup { dims, params: gp }]).unwrap();
    let gx16 = up_bf16(dev, &case.x);
    let mut gzu = dev.alloc(rows * dims.width()).unwrap();
    let mut gout = dev.alloc(rows * d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &gx16, &packed, &gp, Some(&mut gzu), ValuesMut::F32(&mut gout))
        .unwrap();
    let what = format!("{dims:?} {phi:?}");
    let fused = down(dev, &gout);
    assert_close(&format!("fused forward {what}"), &fused, &out, 0.0, rel);
    let gzu: Vec<f32> = dev.download(&gzu).unwrap().iter().map(|v| v.to_f32()).collect();
    assert_close(&format!("fused forward zu {what}"), &gzu, &zu, 0.0, rel.max(BF16_ZU));
    // Without saving, the same output.
    let mut gout2 = dev.alloc(rows * d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &gx16, &packed, &gp, None, ValuesMut::F32(&mut gout2)).unwrap();
    assert_eq!(down(dev, &gout2), fused, "saving zu changed the output");
    // In bf16: the f32 output rounded to nearest even, bit for bit.
    let mut gout16 = dev.alloc::<bf16>(rows * d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &gx16, &packed, &gp, None, ValuesMut::Bf16(&mut gout16)).unwrap();
    let rounded_fused: Vec<u16> = fused.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let got16: Vec<u16> = dev.download(&gout16).unwrap().iter().map(|v| v.to_bits()).collect();
    assert_eq!(got16, rounded_fused, "the bf16 output is not the f32 one rounded ({what})");
    for bf16_zu in [false, true] {
        check_group(dev, std::slice::from_ref(case), phi, rel, bf16_zu);
    }
}

/// A group of projections of one input (`cases` share `x`, rows, d_in and ranks) through the
/// engine's path on the device (one GEMM and one gate launch forward, one backward) against
/// each projection alone on the CPU: outputs side by side, `dx` summed, and every parameter's
/// gradient, with f32 products (bound `rel`) and bf16 ones, the device saving `ZU` in f32 or
/// (`bf16_zu`) bf16; then the CPU gates its `ZU` rounded to bf16 too, and its backward reads
/// that.
fn check_group(dev: &CudaDevice, cases: &[GateCase], phi: Unary, rel: f32, bf16_zu: bool) {
    let FusedGateDims { rows, d_in, rank_channel: rc, rank_scalar: rs, .. } = cases[0].dims;
    let x = &cases[0].x;
    let out_width: usize = cases.iter().map(|c| c.dims.d_out).sum();
    let what = format!("{:?} {phi:?} (bf16 ZU: {bf16_zu})", cases.iter().map(|c| c.dims).collect::<Vec<_>>());
    // The CPU, projection by projection: the forward on the rounded values the device
    // multiplies, the backward from its ZU with the f32 x and parameters (as the device's
    // backward reads them), for its columns of one output gradient.
    let dout = Rng::new(rows as u64).vec(rows * out_width, -1.0, 1.0);
    let mut want_out = vec![0.0; rows * out_width];
    // Each projection's ZU and saved gate values, and its output in its columns of want_out.
    let mut forwards = Vec::new();
    let mut at = 0;
    for case in cases {
        let dims = case.dims;
        let d_out = dims.d_out;
        let rounded = case.rounded();
        let (mut zu, mut out) = (vec![0.0; rows * dims.width()], vec![0.0; rows * d_out]);
        cpu::fused_gate::fused_gate_forward(&dims, &rounded.x, &rounded.params(phi), &mut zu, &mut out);
        if bf16_zu {
            zu.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32());
        }
        let saved = cpu::fused_gate::fused_gate_from_zu(&dims, &rounded.params(phi), &zu, &mut out);
        for n in 0..rows {
            want_out[n * out_width + at..n * out_width + at + d_out].copy_from_slice(&out[n * d_out..(n + 1) * d_out]);
        }
        forwards.push((zu, saved));
        at += d_out;
    }
    // The backward for an output gradient: dx summed over the projections, and every
    // parameter's gradient in the device's packed order.
    let cpu_backward = |dout: &[f32]| {
        let mut want_dx = vec![0.0; rows * d_in];
        let mut want = Vec::new();
        let mut at = 0;
        for (case, (zu, saved)) in cases.iter().zip(&forwards) {
            let dims = case.dims;
            let d_out = dims.d_out;
            let dout_part: Vec<f32> =
                (0..rows).flat_map(|n| dout[n * out_width + at..n * out_width + at + d_out].to_vec()).collect();
            at += d_out;
            let (mut dx, mut dw) = (stale(rows * d_in), stale(d_out * d_in));
            let mut dc: Vec<Vec<f32>> = [rc * d_in, rc, d_out * rc, d_out].iter().map(|&l| stale(l)).collect();
            let mut ds: Vec<Vec<f32>> = [rs * d_in, rs, rs, 1].iter().map(|&l| stale(l)).collect();
            let (mut dalpha_c, mut dalpha_s) = (f32::NAN, f32::NAN);
            {
                let [ca, cab, cb, cbb] = &mut dc[..] else { unreachable!() };
                let [sa, sab, sb, sbb] = &mut ds[..] else { unreachable!() };
                let mut grads = FusedGateGrads {
                    x: &mut dx,
                    weight: &mut dw,
                    channel: GateGrads { a_weight: ca, a_bias: cab, b_weight: cb, b_bias: cbb, alpha: &mut dalpha_c },
                    scalar: GateGrads { a_weight: sa, a_bias: sab, b_weight: sb, b_bias: sbb, alpha: &mut dalpha_s },
                };
                let mut dzu = vec![0.0; zu.len()];
                let p = case.params(phi);
                cpu::fused_gate::fused_gate_backward(&dims, &case.x, &p, zu, saved, &dout_part, &mut dzu, &mut grads);
            }
            want_dx.iter_mut().zip(&dx).for_each(|(total, d)| *total += d);
            // In the device's packed order: [dW; dA_c; dA_s], then the rest of each modulator.
            want.push([dw, dc[0].clone(), ds[0].clone()].concat());
            want.extend(dc[1..].iter().cloned().chain(ds[1..].iter().cloned()));
            want.extend([vec![dalpha_c], vec![dalpha_s]]);
        }
        (want_dx, want)
    };
    let wanted = cpu_backward(&dout);

    let gates: Vec<DeviceGate> = cases.iter().map(|c| DeviceGate::new(dev, c)).collect();
    let group: Vec<GateGroup> =
        cases.iter().zip(&gates).map(|(c, g)| GateGroup { dims: c.dims, params: g.params(phi) }).collect();
    let packed = cuda::fused_gate::pack_weight(dev, &group).unwrap();
    let (gx, gx16) = (up(dev, x), up_bf16(dev, x));
    let width: usize = cases.iter().map(|c| c.dims.width()).sum();
    let (mut gzu, mut gout) =
        (cuda::DeviceValues::alloc(dev, rows * width, bf16_zu).unwrap(), dev.alloc(rows * out_width).unwrap());
    let out = ValuesMut::F32(&mut gout);
    cuda::fused_gate::fused_gate_forward_unfused(dev, &group, &gx16, &packed, &mut gzu, out).unwrap();
    assert_close(&format!("forward {what}"), &down(dev, &gout), &want_out, 0.0, rel);

    // The backward into stale (NaN) gradient buffers: it must write every element. dx is
    // added onto `dx_base` instead when it is given (Store::Accumulate), and written in bf16
    // alone with `dx_bf16` (an input whose readers take bf16). The output gradient is read in
    // bf16 with `dout_bf16` (as SwiGLU's and RoPE's backward write it under bf16 products).
    let gpu_backward = |products: GateProducts, dx_base: Option<&[f32]>, dout_bf16: bool, dx_bf16: bool| {
        let mut gdx = up(dev, &dx_base.map_or_else(|| stale(rows * d_in), <[f32]>::to_vec));
        let mut gdx16 = up_bf16(dev, &stale(rows * d_in));
        let x_store = if dx_base.is_some() { Store::Accumulate } else { Store::Overwrite };
        // Every projection's [dW; dA_c; dA_s] in one buffer, as the backward writes them.
        let mut gdweights = up(dev, &stale(width * d_in));
        // Every B_c's gradient in one buffer, every B_s's in another.
        let mut gdb_channel = up(dev, &stale(out_width * rc));
        let mut gdb_scalar = up(dev, &stale(cases.len() * rs));
        let mut gdc: Vec<Vec<DeviceBuffer<f32>>> =
            cases.iter().map(|c| [rc, c.dims.d_out, 1].iter().map(|&l| up(dev, &stale(l))).collect()).collect();
        let mut gds: Vec<Vec<DeviceBuffer<f32>>> =
            cases.iter().map(|_| [rs, 1, 1].iter().map(|&l| up(dev, &stale(l))).collect()).collect();
        {
            fn modulator(g: &mut [DeviceBuffer<f32>]) -> DeviceGateGrads<'_> {
                let [a_bias, b_bias, alpha] = g else { unreachable!() };
                DeviceGateGrads { a_bias, b_bias, alpha }
            }
            let mut grads = DeviceFusedGateGrads {
                x: if dx_bf16 { ValuesMut::Bf16(&mut gdx16) } else { ValuesMut::F32(&mut gdx) },
                x_store,
                weights: &mut gdweights,
                b_channel: &mut gdb_channel,
                b_scalar: &mut gdb_scalar,
                channel: gdc.iter_mut().map(|g| modulator(g)).collect(),
                scalar: gds.iter_mut().map(|g| modulator(g)).collect(),
            };
            let (gdout, gdout16) = (up(dev, &dout), up_bf16(dev, &dout));
            let dout = if dout_bf16 { cuda::Values::Bf16(&gdout16) } else { cuda::Values::F32(&gdout) };
            let dout = cuda::fused_gate::OutputGrad::Direct(dout);
            cuda::fused_gate::fused_gate_backward(dev, &group, &gzu, dout, products, &mut grads)?;
        }
        let (weights, b_channel, b_scalar) = (down(dev, &gdweights), down(dev, &gdb_channel), down(dev, &gdb_scalar));
        let mut got = Vec::new();
        let (mut at, mut out_at) = (0, 0);
        for (i, case) in cases.iter().enumerate() {
            let d_out = case.dims.d_out;
            got.push(weights[at * d_in..(at + case.dims.width()) * d_in].to_vec());
            at += case.dims.width();
            let (c, s) = (&gdc[i], &gds[i]);
            got.extend([down(dev, &c[0]), b_channel[out_at * rc..(out_at + d_out) * rc].to_vec(), down(dev, &c[1])]);
            got.extend([down(dev, &s[0]), b_scalar[i * rs..(i + 1) * rs].to_vec(), down(dev, &s[1])]);
            got.extend([down(dev, &c[2]), down(dev, &s[2])]);
            out_at += d_out;
        }
        let dx = if dx_bf16 {
            dev.download(&gdx16).unwrap().into_iter().map(bf16::to_f32).collect()
        } else {
            down(dev, &gdx)
        };
        Ok::<_, CudaError>((dx, got))
    };
    let names = ["[dW; dA_c; dA_s]", "channel da", "channel dB", "channel db", "scalar da", "scalar dB", "scalar db"];
    let names: Vec<String> = (0..cases.len())
        .flat_map(|i| names.iter().chain(&["channel dα", "scalar dα"]).map(move |n| format!("projection {i} {n}")))
        .collect();
    // bf16 operands: about 8 significant bits each, so a bound relative to the largest entry.
    let bf16 = GateProducts::Bf16 { x: &gx16, packed: &packed };
    let f32 = GateProducts::F32 { x: &gx };
    let check =
        |what: &str, (dx, got): (Vec<f32>, Vec<Vec<f32>>), (want_dx, want): &(Vec<f32>, Vec<Vec<f32>>), bound| {
            assert_close(&format!("dx {what}"), &dx, want_dx, 0.0, bound);
            for ((name, got), want) in names.iter().zip(&got).zip(want) {
                assert_close(&format!("{name} {what}"), got, want, 0.0, bound);
            }
        };
    for (products, bound) in [(f32, rel), (bf16, 3e-2)] {
        check(&format!("{what} ({products:?})"), gpu_backward(products, None, false, false).unwrap(), &wanted, bound);
    }
    // dout in bf16 (as SwiGLU's and RoPE's backward write it) beside a bf16 ZU: the CPU's
    // backward of the rounded dout. Beside an f32 ZU it is refused.
    let run = gpu_backward(bf16, None, true, false);
    if bf16_zu {
        let rounded: Vec<f32> = dout.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        check(&format!("{what} (bf16 products, bf16 dout)"), run.unwrap(), &cpu_backward(&rounded), 3e-2);
    } else {
        assert!(matches!(run, Err(CudaError::Shape { .. })), "a bf16 dout beside an f32 ZU: {:?}", run.err());
    }
    // dx added onto the gradient an input already has (an input read by several ops).
    let dx_base = Rng::new(rows as u64 + 1).vec(rows * d_in, -1.0, 1.0);
    let want_sum: Vec<f32> = wanted.0.iter().zip(&dx_base).map(|(dx, base)| base + dx).collect();
    let (dx, _) = gpu_backward(f32, Some(&dx_base), false, false).unwrap();
    assert_close(&format!("dx added onto a gradient so far {what}"), &dx, &want_sum, 0.0, rel);
    // dx in bf16 alone under bf16 products: the f32 dx rounded (to within one bf16 step, the
    // product's own sums rounded once), the other gradients the same bits. Refused beside f32
    // products, and when added onto a gradient so far.
    let (dx_f32, grads_f32) = gpu_backward(bf16, None, false, false).unwrap();
    let (dx_half, grads_half) = gpu_backward(bf16, None, false, true).unwrap();
    assert_close_to(&format!("dx in bf16 {what}"), &dx_half, &dx_f32, 1.0 / 256.0, 0.0);
    assert_eq!(grads_half, grads_f32, "the parameters' gradients do not depend on dx's type {what}");
    for (products, dx_base) in [(f32, None), (bf16, Some(&dx_base[..]))] {
        let run = gpu_backward(products, dx_base, false, true);
        assert!(matches!(run, Err(CudaError::Shape { .. })), "a bf16 dx refused {what}: {:?}", run.err());
    }
}

/// q, k and v, or gate and up: projections of one input of different widths in one group.
#[test]
fn a_group_of_fused_projections_agrees_with_each_alone() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(18);
    let dims = |d_out, rank_channel| FusedGateDims { rows: 70, d_in: 48, d_out, rank_channel, rank_scalar: 4 };
    for (widths, rank_channel, phi) in [(vec![64, 96, 40], 8, Unary::Sigmoid), (vec![33, 33], 12, Unary::Silu)] {
        let mut cases: Vec<GateCase> =
            widths.iter().map(|&w| GateCase::new(dims(w, rank_channel), &mut rng, true)).collect();
        // One input for the whole group.
        let x = cases[0].x.clone();
        cases.iter_mut().for_each(|c| c.x = x.clone());
        for bf16_zu in [false, true] {
            check_group(dev, &cases, phi, 1e-4, bf16_zu);
        }
    }
    // Projections of different ranks cannot share a group.
    let cases = [GateCase::new(dims(16, 8), &mut rng, true), GateCase::new(dims(16, 4), &mut rng, true)];
    let gates: Vec<DeviceGate> = cases.iter().map(|c| DeviceGate::new(dev, c)).collect();
    let group: Vec<GateGroup> =
        cases.iter().zip(&gates).map(|(c, g)| GateGroup { dims: c.dims, params: g.params(Unary::Sigmoid) }).collect();
    let result = cuda::fused_gate::pack_weight(dev, &group);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "ranks 8 and 4 in one group: {result:?}");
}

#[test]
fn fused_gate_agrees_with_bf16_representable_inputs() {
    let dev = device_or_skip!();
    if dev.compute_capability().0 < 8 {
        return println!("skipping: the fused projection needs compute capability 8.0 ({dev:?})");
    }
    let mut rng = Rng::new(15);
    let dims =
        |rows, d_in, d_out, rank_channel, rank_scalar| FusedGateDims { rows, d_in, d_out, rank_channel, rank_scalar };
    for (d, phi) in [
        (dims(300, 64, 96, 8, 8), Unary::Sigmoid),
        (dims(129, 37, 200, 8, 8), Unary::Silu),
        (dims(256, 128, 130, 16, 8), Unary::Relu),
        (dims(77, 256, 64, 32, 16), Unary::Sigmoid),
        (dims(1, 8, 1, 1, 1), Unary::Silu),
        // Wider than the row kernels' 512-column tiles: three tiles, the last one partly
        // filled, on the register path and (rank 12, odd width) off it.
        (dims(40, 32, 1100, 8, 4), Unary::Silu),
        (dims(19, 16, 1031, 12, 3), Unary::Sigmoid),
        // More rows than the backward's 256 blocks of 16: each block walks 32 rows, the last
        // one fewer.
        (dims(4500, 8, 40, 8, 4), Unary::Silu),
    ] {
        let case = GateCase::new(d, &mut rng, true);
        check_fused_gate(dev, &case, phi, 1e-4);
    }
}

#[test]
fn fused_gate_agrees_in_bf16_from_f32_inputs() {
    let dev = device_or_skip!();
    if dev.compute_capability().0 < 8 {
        return println!("skipping: the fused projection needs compute capability 8.0 ({dev:?})");
    }
    let mut rng = Rng::new(16);
    let dims = FusedGateDims { rows: 512, d_in: 512, d_out: 512, rank_channel: 8, rank_scalar: 8 };
    let case = GateCase::new(dims, &mut rng, false);
    check_fused_gate(dev, &case, Unary::Sigmoid, 1e-2);
}

#[test]
fn fused_gate_rejects_bad_shapes() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(17);
    let dims = FusedGateDims { rows: 4, d_in: 8, d_out: 8, rank_channel: 40, rank_scalar: 40 };
    let case = GateCase::new(dims, &mut rng, true);
    let gate = DeviceGate::new(dev, &case);
    let result = cuda::fused_gate::pack_weight(dev, &[GateGroup { dims, params: gate.params(Unary::Sigmoid) }]);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "rank 80 accepted: {result:?}");
    let dims = FusedGateDims { rank_channel: 8, rank_scalar: 8, ..dims };
    let case = GateCase::new(dims, &mut rng, true);
    let gate = DeviceGate::new(dev, &case);
    let wrong = FusedGateDims { d_in: 9, ..dims };
    let result = cuda::fused_gate::pack_weight(dev, &[GateGroup { dims: wrong, params: gate.params(Unary::Sigmoid) }]);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "wrong d_in accepted: {result:?}");
}
