//! The fused Transponder gate projection (bf16 representable inputs and f32 inputs) and its
//! shape checks.

use half::bf16;
use kernels::cpu;
use kernels::cpu::fused_gate::{FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams};
use kernels::cpu::matmul::Store;
use kernels::cpu::unary::Unary;
use kernels::cuda::fused_gate::{
    DeviceFusedGateGrads, DeviceFusedGateParams, DeviceGateGrads, DeviceGateParams, GateProducts,
};
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer};

use super::{assert_close, down, stale, up, Rng};

/// Host-side parameters of one fused projection.
struct GateCase {
    dims: FusedGateDims,
    x: Vec<f32>,
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
    fn new(dims: FusedGateDims, rng: &mut Rng, exact: bool) -> GateCase {
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
struct DeviceGate {
    w: DeviceBuffer<f32>,
    channel: Vec<DeviceBuffer<f32>>,
    scalar: Vec<DeviceBuffer<f32>>,
}

impl DeviceGate {
    fn new(dev: &CudaDevice, case: &GateCase) -> DeviceGate {
        DeviceGate {
            w: up(dev, &case.w),
            channel: case.channel.iter().chain([&vec![case.alphas.0]]).map(|v| up(dev, v)).collect(),
            scalar: case.scalar.iter().chain([&vec![case.alphas.1]]).map(|v| up(dev, v)).collect(),
        }
    }

    fn params(&self, phi: Unary) -> DeviceFusedGateParams<'_> {
        let gate = device_gate_params;
        DeviceFusedGateParams { weight: &self.w, channel: gate(&self.channel), scalar: gate(&self.scalar), phi }
    }
}

/// Runs the fused forward, the unfused forward and the backward on the device and on the
/// CPU, and compares them with the relative bound `rel` (of the largest value).
fn check_fused_gate(dev: &CudaDevice, case: &GateCase, phi: Unary, rel: f32) {
    let dims = case.dims;
    let FusedGateDims { rows, d_in, d_out, rank_channel: rc, rank_scalar: rs } = dims;
    let p = case.params(phi);
    // The device's forward multiplies bf16 copies of x, W and the A's (its backward reads
    // the f32 originals): the reference forward runs on the same rounded values.
    let rounded = case.rounded();
    let (mut zu, mut out) = (vec![0.0; rows * dims.width()], vec![0.0; rows * d_out]);
    let saved = cpu::fused_gate::fused_gate_forward(&dims, &rounded.x, &rounded.params(phi), &mut zu, &mut out);

    let gate = DeviceGate::new(dev, case);
    let gp = gate.params(phi);
    let packed = cuda::fused_gate::pack_weight(dev, &dims, &gp).unwrap();
    let halves: Vec<bf16> = case.x.iter().map(|&v| bf16::from_f32(v)).collect();
    let gx16 = dev.upload(&halves).unwrap();
    let mut gzu = dev.alloc(rows * dims.width()).unwrap();
    let mut gout = dev.alloc(rows * d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &gx16, &packed, &gp, Some(&mut gzu), &mut gout).unwrap();
    let what = format!("{dims:?} {phi:?}");
    let fused = down(dev, &gout);
    assert_close(&format!("fused forward {what}"), &fused, &out, 0.0, rel);
    // Without saving, the same output; the unfused path agrees with the fused one.
    let mut gout2 = dev.alloc(rows * d_out).unwrap();
    cuda::fused_gate::fused_gate_forward(dev, &dims, &gx16, &packed, &gp, None, &mut gout2).unwrap();
    assert_eq!(down(dev, &gout2), fused, "saving zu changed the output");
    let (mut gzu_ref, mut gout_ref) = (dev.alloc(rows * dims.width()).unwrap(), dev.alloc(rows * d_out).unwrap());
    cuda::fused_gate::fused_gate_forward_unfused(dev, &dims, &gx16, &packed, &gp, &mut gzu_ref, &mut gout_ref).unwrap();
    assert_close(&format!("unfused vs fused {what}"), &down(dev, &gout_ref), &fused, 0.0, 1e-4);
    assert_close(&format!("unfused vs fused zu {what}"), &down(dev, &gzu_ref), &down(dev, &gzu), 0.0, 1e-4);

    // Backward into stale (NaN) gradient buffers: both devices must write every element.
    let dout = Rng::new(rows as u64).vec(rows * d_out, -1.0, 1.0);
    let mut dx = stale(rows * d_in);
    let mut dw = stale(d_out * d_in);
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
        cpu::fused_gate::fused_gate_backward(&dims, &case.x, &p, &zu, &saved, &dout, &mut dzu, &mut grads);
    }
    let mut want = vec![dx, dw];
    want.extend(dc);
    want.extend(ds);
    want.extend([vec![dalpha_c], vec![dalpha_s]]);
    // The same gradients from the GPU, into stale buffers, with products of `precision`; dx
    // added onto `dx_base` instead when it is given (Store::Accumulate).
    let gpu_backward = |products: GateProducts, dx_base: Option<&[f32]>| -> Vec<Vec<f32>> {
        let mut gdx = up(dev, &dx_base.map_or_else(|| stale(rows * d_in), <[f32]>::to_vec));
        let x_store = if dx_base.is_some() { Store::Accumulate } else { Store::Overwrite };
        // [dW; dA_c; dA_s] in one buffer, as the backward writes them.
        let mut gdweights = up(dev, &stale((d_out + rc + rs) * d_in));
        let mut gdc: Vec<DeviceBuffer<f32>> = [rc, d_out * rc, d_out].iter().map(|&l| up(dev, &stale(l))).collect();
        let mut gds: Vec<DeviceBuffer<f32>> = [rs, rs, 1].iter().map(|&l| up(dev, &stale(l))).collect();
        let (mut gdac, mut gdas) = (up(dev, &[f32::NAN]), up(dev, &[f32::NAN]));
        {
            let [cab, cb, cbb] = &mut gdc[..] else { unreachable!() };
            let [sab, sb, sbb] = &mut gds[..] else { unreachable!() };
            let mut grads = DeviceFusedGateGrads {
                x: &mut gdx,
                x_store,
                weights: &mut gdweights,
                channel: DeviceGateGrads { a_bias: cab, b_weight: cb, b_bias: cbb, alpha: &mut gdac },
                scalar: DeviceGateGrads { a_bias: sab, b_weight: sb, b_bias: sbb, alpha: &mut gdas },
            };
            let gx = up(dev, &case.x);
            let gdout = up(dev, &dout);
            cuda::fused_gate::fused_gate_backward(dev, &dims, &gx, &gp, &gzu, &gdout, products, &mut grads).unwrap();
        }
        let weights = down(dev, &gdweights);
        let (dw, da) = weights.split_at(d_out * d_in);
        let (da_c, da_s) = da.split_at(rc * d_in);
        let mut got = vec![down(dev, &gdx), dw.to_vec(), da_c.to_vec()];
        got.extend(gdc.iter().map(|g| down(dev, g)));
        got.push(da_s.to_vec());
        got.extend(gds.iter().chain([&gdac, &gdas]).map(|g| down(dev, g)));
        got
    };
    let names = ["dx", "dW", "channel dA", "channel da", "channel dB", "channel db"];
    let names = names.iter().chain(&["scalar dA", "scalar da", "scalar dB", "scalar db", "channel dα", "scalar dα"]);
    // bf16 operands: about 8 significant bits each, so a bound relative to the largest entry.
    let bf16 = GateProducts::Bf16 { x: &gx16, packed: &packed };
    for (products, bound) in [(GateProducts::F32, rel), (bf16, 3e-2)] {
        let got = gpu_backward(products, None);
        for ((name, got), want) in names.clone().zip(&got).zip(&want) {
            assert_close(&format!("{name} {what} ({products:?})"), got, want, 0.0, bound);
        }
    }
    // dx added onto the gradient an input already has (an input read by several projections).
    let dx_base = Rng::new(rows as u64 + 1).vec(rows * d_in, -1.0, 1.0);
    let want_dx: Vec<f32> = want[0].iter().zip(&dx_base).map(|(dx, base)| base + dx).collect();
    let got = gpu_backward(GateProducts::F32, Some(&dx_base));
    assert_close(&format!("dx added onto a gradient so far {what}"), &got[0], &want_dx, 0.0, rel);
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
    let result = cuda::fused_gate::pack_weight(dev, &dims, &gate.params(Unary::Sigmoid));
    assert!(matches!(result, Err(CudaError::Shape { .. })), "rank 80 accepted: {result:?}");
    let dims = FusedGateDims { rank_channel: 8, rank_scalar: 8, ..dims };
    let case = GateCase::new(dims, &mut rng, true);
    let gate = DeviceGate::new(dev, &case);
    let wrong = FusedGateDims { d_in: 9, ..dims };
    let result = cuda::fused_gate::pack_weight(dev, &wrong, &gate.params(Unary::Sigmoid));
    assert!(matches!(result, Err(CudaError::Shape { .. })), "wrong d_in accepted: {result:?}");
}
