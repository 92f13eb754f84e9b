//! Elementwise kernels: every unary op forward and backward, broadcast binary ops, scalar
//! ops, axpy, select, strided copies, scaled copies and SwiGLU.

use half::bf16;
use kernels::cpu;
use kernels::cpu::binary::Binary;
use kernels::cpu::unary::Unary;
use kernels::cuda::{self, CudaError, DeviceBuffer};
use kernels::cuda::{Values, ValuesMut};

use super::{assert_elementwise, assert_twin, down, stale, up, Rng};

#[test]
fn unary_forward_and_backward_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(2);
    for op in Unary::ALL {
        let positive = matches!(op, Unary::Log | Unary::Sqrt | Unary::Rsqrt | Unary::Powf(_));
        let x: Vec<f32> =
            rng.vec(5003, -6.0, 6.0).into_iter().map(|v| if positive { v.abs() + 0.1 } else { v }).collect();
        let (mut y, mut dx) = (vec![0.0; x.len()], stale(x.len()));
        let dy = rng.vec(x.len(), -1.0, 1.0);
        let (gx, gdy, mut gy, mut gdx) = (up(dev, &x), up(dev, &dy), dev.zeros(x.len()).unwrap(), up(dev, &dx));
        cpu::unary::unary_forward(op, &x, &mut y);
        cpu::unary::unary_backward(op, &x, &y, &dy, &mut dx);
        cuda::elementwise::unary_forward(dev, op, &gx, &mut gy).unwrap();
        assert_elementwise(&format!("{op:?} forward"), &down(dev, &gy), &y);
        // The backward reads the CPU's y so that only the derivative is compared.
        cuda::elementwise::unary_backward(dev, op, &gx, &up(dev, &y), &gdy, &mut gdx).unwrap();
        assert_elementwise(&format!("{op:?} backward"), &down(dev, &gdx), &dx);
    }
}

/// One broadcast of `binary_forward`: each operand on the host and on the device.
struct Broadcast<'a> {
    a: (&'a [f32], &'a DeviceBuffer<f32>),
    a_offset: usize,
    a_strides: Vec<usize>,
    b: (&'a [f32], &'a DeviceBuffer<f32>),
    b_strides: Vec<usize>,
    shape: Vec<usize>,
}

#[test]
fn binary_broadcasts_scalar_axpy_select_and_copy_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(3);
    let (n, c) = (301, 67);
    let x = rng.vec(n * c + 3, -4.0, 4.0);
    let bias = rng.vec(c, -2.0, 2.0);
    let per_row = rng.vec(n, 0.5, 2.0);
    let (gx, gbias, grow) = (up(dev, &x), up(dev, &bias), up(dev, &per_row));
    let ops = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum];
    // Contiguous with an offset, a bias over rows, a per-row scale, and transposed operands.
    let cases = [
        Broadcast {
            a: (&x, &gx),
            a_offset: 3,
            a_strides: vec![c, 1],
            b: (&x, &gx),
            b_strides: vec![c, 1],
            shape: vec![n, c],
        },
        Broadcast {
            a: (&x, &gx),
            a_offset: 0,
            a_strides: vec![c, 1],
            b: (&bias, &gbias),
            b_strides: vec![0, 1],
            shape: vec![n, c],
        },
        Broadcast {
            a: (&per_row, &grow),
            a_offset: 0,
            a_strides: vec![1, 0],
            b: (&x, &gx),
            b_strides: vec![c, 1],
            shape: vec![n, c],
        },
        Broadcast {
            a: (&x, &gx),
            a_offset: 1,
            a_strides: vec![1, c],
            b: (&x, &gx),
            b_strides: vec![1, c],
            shape: vec![c, n],
        },
    ];
    for op in ops {
        for case in &cases {
            let numel: usize = case.shape.iter().product();
            let mut want = vec![0.0; numel];
            let (a, b) = (case.a.0, case.b.0);
            cpu::binary::binary_forward(
                op,
                a,
                case.a_offset,
                &case.a_strides,
                b,
                0,
                &case.b_strides,
                &case.shape,
                &mut want,
            );
            let mut out = dev.alloc(numel).unwrap();
            let (ga, gb) = (case.a.1, case.b.1);
            cuda::elementwise::binary_forward(
                dev,
                op,
                ga,
                case.a_offset,
                &case.a_strides,
                gb,
                0,
                &case.b_strides,
                &case.shape,
                &mut out,
            )
            .unwrap();
            assert_elementwise(&format!("{op:?} {:?}", case.shape), &down(dev, &out), &want);
        }
        let mut want = vec![0.0; x.len()];
        cpu::binary::scalar_forward(op, &x, 1.5, &mut want);
        let mut out = dev.alloc(x.len()).unwrap();
        cuda::elementwise::scalar_forward(dev, op, &gx, 1.5, &mut out).unwrap();
        assert_elementwise(&format!("{op:?} scalar"), &down(dev, &out), &want);
    }
    let mut dst = rng.vec(x.len(), -1.0, 1.0);
    let mut gdst = up(dev, &dst);
    cpu::binary::axpy(-0.75, &x, &mut dst);
    cuda::elementwise::axpy(dev, -0.75, &gx, &mut gdst).unwrap();
    cpu::binary::add_assign(&mut dst, &x);
    let before_sum = down(dev, &gdst);
    cuda::elementwise::add_assign(dev, &mut gdst, &gx, None).unwrap();
    assert_elementwise("axpy + add_assign", &down(dev, &gdst), &dst);
    // With a bf16 twin: the same sum, and the twin is it rounded to nearest even.
    let (mut gsum, mut gsum16) = (up(dev, &before_sum), dev.alloc::<bf16>(x.len()).unwrap());
    cuda::elementwise::add_assign(dev, &mut gsum, &gx, Some(&mut gsum16)).unwrap();
    assert_twin(dev, "add_assign", &gsum, &gdst, &gsum16);
    let cond: Vec<f32> = (0..x.len()).map(|i| (i % 3 == 0) as u8 as f32).collect();
    let mut want = vec![0.0; x.len()];
    cpu::binary::select(&cond, &x, &dst, &mut want);
    let mut out = dev.alloc(x.len()).unwrap();
    cuda::elementwise::select(dev, &up(dev, &cond), &gx, &gdst, &mut out).unwrap();
    assert_eq!(down(dev, &out), want, "select");
    // A transposed, offset view and a broadcast view.
    for (offset, shape, strides) in [(2usize, vec![c, n], vec![1usize, c]), (0, vec![4, n, c], vec![0, c, 1])] {
        let numel: usize = shape.iter().product();
        let mut want = vec![0.0; numel];
        cpu::copy::copy_strided(&x, offset, &shape, &strides, &mut want);
        let mut out = dev.alloc(numel).unwrap();
        cuda::elementwise::copy_strided(dev, &gx, offset, &shape, &strides, &mut out).unwrap();
        assert_eq!(down(dev, &out), want, "copy_strided {shape:?}");
    }
}

#[test]
fn swiglu_forward_and_backward_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(18);
    // 5003: many blocks and a length that is no multiple of the CPU's SIMD width.
    let n = 5003;
    let (gate, upv, dout) = (rng.vec(n, -12.0, 12.0), rng.vec(n, -3.0, 3.0), rng.vec(n, -2.0, 2.0));
    let (mut y, mut dgate, mut dup) = (vec![0.0; n], stale(n), stale(n));
    let (gg, gu, gdout, mut gy) = (up(dev, &gate), up(dev, &upv), up(dev, &dout), dev.alloc(n).unwrap());
    let (mut gdgate, mut gdup) = (up(dev, &dgate), up(dev, &dup));
    cpu::swiglu::swiglu_forward(&gate, &upv, &mut y);
    cpu::swiglu::swiglu_backward(&gate, &upv, &dout, &mut dgate, &mut dup);
    cuda::swiglu::swiglu_forward(dev, &gg, &gu, (ValuesMut::F32(&mut gy), None)).unwrap();
    cuda::swiglu::swiglu_backward(dev, &gg, &gu, &gdout, ValuesMut::F32(&mut gdgate), ValuesMut::F32(&mut gdup))
        .unwrap();
    assert_elementwise("swiglu forward", &down(dev, &gy), &y);
    // Both sides overwrite their stale gradient buffers.
    assert_elementwise("swiglu dgate", &down(dev, &gdgate), &dgate);
    assert_elementwise("swiglu dup", &down(dev, &gdup), &dup);
    // The forward with a bf16 twin: the same f32 output, and the twin is it rounded to nearest
    // even; the backward's gradients in bf16 alone: the f32 ones rounded.
    let half_buffer = || dev.alloc::<bf16>(n).unwrap();
    let (mut y16, mut dgate16, mut dup16) = (half_buffer(), half_buffer(), half_buffer());
    let mut gy2 = dev.alloc(n).unwrap();
    cuda::swiglu::swiglu_forward(dev, &gg, &gu, (ValuesMut::F32(&mut gy2), Some(&mut y16))).unwrap();
    let alone = (ValuesMut::Bf16(&mut dgate16), ValuesMut::Bf16(&mut dup16));
    cuda::swiglu::swiglu_backward(dev, &gg, &gu, &gdout, alone.0, alone.1).unwrap();
    for (what, values, copy) in [("y", &gy2, &y16), ("dgate", &gdgate, &dgate16), ("dup", &gdup, &dup16)] {
        let values = down(dev, values);
        let rounded: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dev.download(copy).unwrap(), rounded, "swiglu {what}: the bf16 values are the f32 ones rounded");
    }
    assert_eq!(down(dev, &gy2), down(dev, &gy), "swiglu: the twin leaves the f32 output as it was");
    let mut short = dev.alloc(n - 1).unwrap();
    assert!(matches!(
        cuda::swiglu::swiglu_forward(dev, &gg, &gu, (ValuesMut::F32(&mut short), None)),
        Err(CudaError::Shape { .. })
    ));
    let mut short16 = dev.alloc::<bf16>(n - 1).unwrap();
    let wrong_twin = cuda::swiglu::swiglu_forward(dev, &gg, &gu, (ValuesMut::F32(&mut gy), Some(&mut short16)));
    assert!(matches!(wrong_twin, Err(CudaError::Shape { .. })));
}

/// SwiGLU of the two halves of each row of one `[rows, 2·cols]` product, forward and
/// backward (with a bf16 twin, or in bf16 alone), against the CPU's: a width of whole 16-byte groups and one of
/// none (the one-element path), beside the plain kernels on the same values; and from a bf16
/// product, against the CPU's on the same values rounded.
#[test]
fn swiglu_halves_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(19);
    for (rows, cols) in [(37, 12), (29, 7)] {
        let n = rows * cols;
        let (gate_up, dout) = (rng.vec(2 * n, -12.0, 12.0), rng.vec(n, -2.0, 2.0));
        let (mut y, mut d_gate_up) = (vec![0.0; n], stale(2 * n));
        cpu::swiglu::swiglu_halves_forward(&gate_up, cols, &mut y);
        cpu::swiglu::swiglu_halves_backward(&gate_up, &dout, cols, &mut d_gate_up);
        let (g_gate_up, g_dout) = (up(dev, &gate_up), up(dev, &dout));
        let (mut gy, mut g_d) = (dev.alloc(n).unwrap(), up(dev, &stale(2 * n)));
        let (mut y16, mut d16) = (dev.alloc::<bf16>(n).unwrap(), dev.alloc::<bf16>(2 * n).unwrap());
        let f32_input = Values::F32(&g_gate_up);
        cuda::swiglu::swiglu_halves_forward(dev, f32_input, cols, (ValuesMut::F32(&mut gy), Some(&mut y16))).unwrap();
        cuda::swiglu::swiglu_halves_backward(dev, f32_input, Values::F32(&g_dout), cols, ValuesMut::F32(&mut g_d))
            .unwrap();
        cuda::swiglu::swiglu_halves_backward(dev, f32_input, Values::F32(&g_dout), cols, ValuesMut::Bf16(&mut d16))
            .unwrap();
        let what = format!("swiglu halves {rows}×{cols}");
        assert_elementwise(&format!("{what} forward"), &down(dev, &gy), &y);
        assert_elementwise(&format!("{what} backward"), &down(dev, &g_d), &d_gate_up);
        for (values, copy) in [(&gy, &y16), (&g_d, &d16)] {
            let rounded: Vec<bf16> = down(dev, values).iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(dev.download(copy).unwrap(), rounded, "{what}: the bf16 values are the f32 ones rounded");
        }
        // The halves as separate tensors through the plain kernels: the same values.
        let halves: Vec<(Vec<f32>, Vec<f32>)> =
            gate_up.chunks(2 * cols).map(|row| (row[..cols].to_vec(), row[cols..].to_vec())).collect();
        let gate: Vec<f32> = halves.iter().flat_map(|(g, _)| g.clone()).collect();
        let upv: Vec<f32> = halves.iter().flat_map(|(_, u)| u.clone()).collect();
        let mut plain = dev.alloc(n).unwrap();
        cuda::swiglu::swiglu_forward(dev, &up(dev, &gate), &up(dev, &upv), (ValuesMut::F32(&mut plain), None)).unwrap();
        assert_eq!(down(dev, &plain), down(dev, &gy), "{what}: the plain kernel on the halves");

        // From bf16 gate and up values: the f32 kernels' results on the rounded values.
        let rounded: Vec<bf16> = gate_up.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = rounded.iter().map(|v| v.to_f32()).collect();
        let (mut y_rounded, mut d_rounded) = (vec![0.0; n], stale(2 * n));
        cpu::swiglu::swiglu_halves_forward(&widened, cols, &mut y_rounded);
        cpu::swiglu::swiglu_halves_backward(&widened, &dout, cols, &mut d_rounded);
        let g_rounded = dev.upload(&rounded).unwrap();
        let bf16_input = Values::Bf16(&g_rounded);
        cuda::swiglu::swiglu_halves_forward(dev, bf16_input, cols, (ValuesMut::F32(&mut gy), None)).unwrap();
        cuda::swiglu::swiglu_halves_backward(dev, bf16_input, Values::F32(&g_dout), cols, ValuesMut::F32(&mut g_d))
            .unwrap();
        assert_elementwise(&format!("{what} forward from bf16"), &down(dev, &gy), &y_rounded);
        assert_elementwise(&format!("{what} backward from bf16"), &down(dev, &g_d), &d_rounded);
        // dout in bf16 too (the down product's input gradient under bf16 products): the bits of
        // the f32 dout kernel on the same values widened; beside f32 gate and up it is refused.
        let dout16: Vec<bf16> = dout.iter().map(|&v| bf16::from_f32(v)).collect();
        let dout_widened = up(dev, &dout16.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        let g_dout16 = dev.upload(&dout16).unwrap();
        let mut from_bf16 = up(dev, &stale(2 * n));
        let bf16_dout = Values::Bf16(&g_dout16);
        cuda::swiglu::swiglu_halves_backward(dev, bf16_input, bf16_dout, cols, ValuesMut::F32(&mut from_bf16)).unwrap();
        let dout_f32 = Values::F32(&dout_widened);
        cuda::swiglu::swiglu_halves_backward(dev, bf16_input, dout_f32, cols, ValuesMut::F32(&mut g_d)).unwrap();
        assert_eq!(down(dev, &from_bf16), down(dev, &g_d), "{what}: the backward from a bf16 dout");
        let refused =
            cuda::swiglu::swiglu_halves_backward(dev, f32_input, bf16_dout, cols, ValuesMut::F32(&mut from_bf16));
        assert!(matches!(refused, Err(CudaError::Shape { .. })), "a bf16 dout beside f32 gate and up: {refused:?}");
        // The output in bf16 alone (as the FFN's down product reads it): the f32 one rounded.
        let mut y_only = dev.alloc::<bf16>(n).unwrap();
        cuda::swiglu::swiglu_halves_forward(dev, bf16_input, cols, (ValuesMut::Bf16(&mut y_only), None)).unwrap();
        let rounded_y: Vec<bf16> = down(dev, &gy).iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dev.download(&y_only).unwrap(), rounded_y, "{what}: the output in bf16 alone");
        let refused =
            cuda::swiglu::swiglu_halves_forward(dev, bf16_input, cols, (ValuesMut::Bf16(&mut y_only), Some(&mut y16)));
        assert!(matches!(refused, Err(CudaError::Shape { .. })), "a bf16 output with a twin: {refused:?}");
    }
    let mut odd = dev.alloc(5).unwrap();
    let zeros = up(dev, &[0.0; 12]);
    let refused = cuda::swiglu::swiglu_halves_forward(dev, Values::F32(&zeros), 3, (ValuesMut::F32(&mut odd), None));
    assert!(matches!(refused, Err(CudaError::Shape { .. })), "{refused:?}");
}

/// Several buffers times one scalar read on the device, in one launch: each output is its
/// input times the scalar, exactly as the CPU multiplies.
#[test]
fn scaled_copies_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(11);
    let sources = [rng.vec(1000, -3.0, 3.0), rng.vec(7, -3.0, 3.0), rng.vec(70_001, -3.0, 3.0)];
    let s = 0.37f32;
    let inputs: Vec<DeviceBuffer<f32>> = sources.iter().map(|x| up(dev, x)).collect();
    let mut outputs: Vec<DeviceBuffer<f32>> = sources.iter().map(|x| up(dev, &stale(x.len()))).collect();
    let mut parts: Vec<_> = inputs.iter().zip(&mut outputs).collect();
    // Other tests launch on the shared device meanwhile: count this kernel only.
    let launches = || dev.counters().launches_by_kernel.get("scaled_copies").copied().unwrap_or(0);
    let before = launches();
    cuda::elementwise::scaled_copies(dev, &up(dev, &[s]), &mut parts).unwrap();
    assert_eq!(launches() - before, 1, "one launch for every buffer");
    for (x, out) in sources.iter().zip(&outputs) {
        let want: Vec<f32> = x.iter().map(|v| s * v).collect();
        assert_eq!(down(dev, out), want, "scaled copy of {} elements", x.len());
    }
    // Lengths that differ are a shape error.
    let (short, mut long) = (up(dev, &[1.0; 3]), up(dev, &[0.0; 4]));
    assert!(cuda::elementwise::scaled_copies(dev, &up(dev, &[s]), &mut [(&short, &mut long)]).is_err());
}
