//! AdamW, Adam and SGD (with momentum and Nesterov) over several steps.

use kernels::cpu;
use kernels::cpu::optim::AdamHyper;
use kernels::cuda;

use half::bf16;
use kernels::cuda::{DeviceBuffer, DeviceRun};

use super::{assert_elementwise, down, up, Rng};

/// Adam (`decoupled = false`) or AdamW at `h` over `tensors`: its per-step constants copied
/// to the device, as the optimizer does before each update.
fn adam(
    dev: &cuda::CudaDevice,
    tensors: &mut [cuda::optim::AdamTensor],
    h: &AdamHyper,
    decoupled: bool,
    guard: Option<&DeviceBuffer<f32>>,
) -> cuda::Result<()> {
    let constants = up(dev, &cuda::optim::adam_constants(h, decoupled)?);
    cuda::optim::adam_step(dev, tensors, h, (&constants).into(), guard)
}

#[test]
fn optimizers_agree_over_steps() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(13);
    let len = 100_003;
    let p0 = rng.vec(len, -1.0, 1.0);
    // 520 tensors of different lengths: two launches of the multi-tensor kernel (512 + 8),
    // each finding its tensor by a binary search of up to 512 first blocks.
    let lens: Vec<usize> = (0..520).map(|i| if i == 0 { len } else { 1 + 37 * (i % 64) }).collect();
    for decoupled in [true, false] {
        let mut p: Vec<Vec<f32>> = lens.iter().map(|&n| p0[..n].to_vec()).collect();
        let (mut m, mut v): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            (lens.iter().map(|&n| vec![0.0; n]).collect(), lens.iter().map(|&n| vec![0.0; n]).collect());
        let mut gp: Vec<DeviceBuffer<f32>> = p.iter().map(|x| up(dev, x)).collect();
        let mut gm: Vec<DeviceBuffer<f32>> = lens.iter().map(|&n| dev.zeros(n).unwrap()).collect();
        let mut gv: Vec<DeviceBuffer<f32>> = lens.iter().map(|&n| dev.zeros(n).unwrap()).collect();
        // Every other tensor has a bf16 copy, which the update rewrites from the new parameter;
        // tensors 1, 3 and 5 keep theirs back to back in one packed buffer (as a fused gated
        // projection's [W; A_c; A_s]), each update writing its own part in the same launch.
        let copies: Vec<Option<DeviceBuffer<bf16>>> =
            lens.iter().enumerate().map(|(i, &n)| (i % 2 == 0).then(|| dev.alloc(n).unwrap())).collect();
        // Where each tensor's copy starts in the packed buffer (members only).
        let mut packed_at: Vec<Option<usize>> = vec![None; lens.len()];
        let mut packed_len = 0;
        for i in [1, 3, 5] {
            packed_at[i] = Some(packed_len);
            packed_len += lens[i];
        }
        let packed: DeviceBuffer<bf16> = dev.alloc(packed_len).unwrap();
        for step in 1..=5 {
            let grads: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
            let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step };
            let gg: Vec<DeviceBuffer<f32>> = grads.iter().map(|g| up(dev, g)).collect();
            for (((p, m), v), grad) in p.iter_mut().zip(&mut m).zip(&mut v).zip(&grads) {
                let update = if decoupled { cpu::optim::adamw_step } else { cpu::optim::adam_step };
                update(p, grad, m, v, &h);
            }
            let mut tensors: Vec<cuda::optim::AdamTensor> = gp
                .iter_mut()
                .zip(&gg)
                .zip(gm.iter_mut().zip(gv.iter_mut()))
                .zip(copies.iter().enumerate())
                .map(|(((param, grad), (m, v)), (i, copy))| cuda::optim::AdamTensor {
                    param,
                    param_bf16: match (copy, packed_at[i]) {
                        (Some(buffer), _) => Some(cuda::optim::Bf16Destination { buffer, at: 0 }),
                        (None, Some(at)) => Some(cuda::optim::Bf16Destination { buffer: &packed, at }),
                        (None, None) => None,
                    },
                    grad: grad.into(),
                    m,
                    v,
                })
                .collect();
            adam(dev, &mut tensors, &h, decoupled, None).unwrap();
        }
        for (i, n) in lens.iter().enumerate() {
            let what = format!("adam(decoupled {decoupled}) tensor {i} of {n}");
            assert_elementwise(&format!("{what}: p"), &down(dev, &gp[i]), &p[i]);
            assert_elementwise(&format!("{what}: m"), &down(dev, &gm[i]), &m[i]);
            assert_elementwise(&format!("{what}: v"), &down(dev, &gv[i]), &v[i]);
            let rounded: Vec<bf16> = down(dev, &gp[i]).iter().map(|&x| bf16::from_f32(x)).collect();
            if let Some(copy) = &copies[i] {
                assert_eq!(dev.download(copy).unwrap(), rounded, "{what}: the bf16 copy is the new parameter rounded");
            }
            if let Some(at) = packed_at[i] {
                let part = &dev.download(&packed).unwrap()[at..at + n];
                assert_eq!(part, rounded, "{what}: its part of the packed buffer is the new parameter rounded");
            }
        }
    }
    for (momentum, nesterov) in [(0.9, false), (0.9, true), (0.0, false)] {
        let (mut p, mut buf) = (p0.clone(), vec![0.0; len]);
        let (mut gp, mut gbuf) = (up(dev, &p0), dev.zeros(len).unwrap());
        for _ in 0..3 {
            let grad = rng.vec(len, -1.0, 1.0);
            cpu::optim::sgd_step(&mut p, &grad, &mut buf, 0.1, momentum, 0.01, nesterov);
            let lr = up(dev, &[0.1]);
            cuda::optim::sgd_step(dev, &mut gp, &up(dev, &grad), &mut gbuf, &lr, momentum, 0.01, nesterov).unwrap();
        }
        assert_elementwise(&format!("sgd(momentum {momentum}, nesterov {nesterov})"), &down(dev, &gp), &p);
    }
}

#[test]
fn adam_rejects_bf16_copies_that_overlap() {
    let dev = device_or_skip!();
    let (mut p1, mut p2) = (up(dev, &[1.0; 8]), up(dev, &[2.0; 8]));
    let grad = up(dev, &[0.5; 8]);
    let (mut m1, mut v1, mut m2, mut v2) =
        (dev.zeros(8).unwrap(), dev.zeros(8).unwrap(), dev.zeros(8).unwrap(), dev.zeros(8).unwrap());
    let packed: DeviceBuffer<bf16> = dev.alloc(12).unwrap();
    // The second copy starts inside the first: element 4..8 would be written twice.
    let mut tensors = [
        cuda::optim::AdamTensor {
            param: &mut p1,
            param_bf16: Some(cuda::optim::Bf16Destination { buffer: &packed, at: 0 }),
            grad: (&grad).into(),
            m: &mut m1,
            v: &mut v1,
        },
        cuda::optim::AdamTensor {
            param: &mut p2,
            param_bf16: Some(cuda::optim::Bf16Destination { buffer: &packed, at: 4 }),
            grad: (&grad).into(),
            m: &mut m2,
            v: &mut v2,
        },
    ];
    let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
    let err = adam(dev, &mut tensors, &h, true, None).expect_err("overlapping bf16 copies");
    assert!(err.to_string().contains("overlap"), "{err}");
}

/// One AdamW step of three tensors, guarded by `step_guard` over their gradients with
/// `loss_sum` (and the `previous` step's guard, when given): the parameters after it, and
/// the guard as the device wrote it.
fn guarded_adamw(
    dev: &cuda::CudaDevice,
    params: &[Vec<f32>],
    grads: &[Vec<f32>],
    loss_sum: f32,
    max_norm: f32,
    previous: Option<&[f32]>,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut gp: Vec<DeviceBuffer<f32>> = params.iter().map(|x| up(dev, x)).collect();
    // The gradients side by side in one buffer, each read as its run of it (as the packed
    // weight gradient of a fused gated projection is).
    let packed_grads = up(dev, &grads.concat());
    let starts = grads.iter().scan(0, |next, g| Some(std::mem::replace(next, *next + g.len())));
    let gg: Vec<DeviceRun<f32>> =
        starts.zip(grads).map(|(at, g)| DeviceRun::new(&packed_grads, at, g.len()).unwrap()).collect();
    let mut gm: Vec<DeviceBuffer<f32>> = params.iter().map(|x| dev.zeros(x.len()).unwrap()).collect();
    let mut gv: Vec<DeviceBuffer<f32>> = params.iter().map(|x| dev.zeros(x.len()).unwrap()).collect();
    let mut guard = dev.alloc(cuda::optim::STEP_GUARD_LEN).unwrap();
    let previous = previous.map(|values| up(dev, values));
    let previous = previous.as_ref().map_or(cuda::optim::Previous::First, cuda::optim::Previous::Guard);
    cuda::optim::step_guard(dev, &gg, &up(dev, &[loss_sum]), 2.0, max_norm, previous, &mut guard).unwrap();
    let mut tensors: Vec<cuda::optim::AdamTensor> = gp
        .iter_mut()
        .zip(gg)
        .zip(gm.iter_mut().zip(gv.iter_mut()))
        .map(|((param, grad), (m, v))| cuda::optim::AdamTensor { param, param_bf16: None, grad, m, v })
        .collect();
    let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1 };
    adam(dev, &mut tensors, &h, true, Some(&guard)).unwrap();
    drop(tensors);
    (gp.iter().map(|p| down(dev, p)).collect(), down(dev, &guard))
}

/// The step guard on the device gives the host's verdict: the norm of `sum_squares_all` bit for
/// bit, clipping as scaling the gradients first then updating (bit for bit), and no update
/// at all (parameters untouched) when the loss or a gradient is not finite.
#[test]
fn the_step_guard_clips_and_skips_on_the_device() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(14);
    let lens = [5000, 37, 1];
    let params: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let grads: Vec<Vec<f32>> = lens.iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let uploaded: Vec<DeviceBuffer<f32>> = grads.iter().map(|g| up(dev, g)).collect();
    let norm =
        cuda::reduce::sum_squares_all(dev, &uploaded.iter().map(Into::into).collect::<Vec<_>>()).unwrap().sqrt() as f32;
    let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1 };
    for max_norm in [f32::INFINITY, norm / 4.0] {
        let (got, guard) = guarded_adamw(dev, &params, &grads, 3.0, max_norm, None);
        let scale = if norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        assert_eq!(guard, vec![1.0, scale, norm, 1.5], "guard with max_norm {max_norm}");
        for ((p, g), got) in params.iter().zip(&grads).zip(&got) {
            let (mut want, mut m, mut v) = (p.clone(), vec![0.0; p.len()], vec![0.0; p.len()]);
            let clipped: Vec<f32> = g.iter().map(|x| x * scale).collect();
            cpu::optim::adamw_step(&mut want, &clipped, &mut m, &mut v, &h);
            assert_eq!(got, &want, "guarded update with max_norm {max_norm}");
        }
    }
    let (untouched, guard) = guarded_adamw(dev, &params, &grads, f32::NAN, 1.0, None);
    assert_eq!((guard[0], untouched), (0.0, params.clone()), "a NaN loss skips the update");
    let mut bad = grads.clone();
    bad[1][7] = f32::INFINITY;
    let (untouched, guard) = guarded_adamw(dev, &params, &bad, 3.0, 1.0, None);
    assert_eq!((guard[0], guard[2], untouched), (0.0, f32::INFINITY, params), "an infinite gradient skips it");
}

/// A step after a skipped one is skipped too (its own loss and norm finite): the host reads
/// each guard one step late, and the weights of a stopped run stay where they were. After an
/// applied step, the next one runs as if unguarded by it.
#[test]
fn a_step_after_a_skipped_step_is_skipped_on_the_device() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(15);
    let params: Vec<Vec<f32>> = [300, 7].iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let grads: Vec<Vec<f32>> = [300, 7].iter().map(|&n| rng.vec(n, -1.0, 1.0)).collect();
    let (after_skip, guard) = guarded_adamw(dev, &params, &grads, 3.0, 1.0, Some(&[0.0, 1.0, f32::NAN, f32::NAN]));
    assert_eq!((guard[0], guard[3], after_skip), (0.0, 1.5, params.clone()), "the update after a skipped step");
    let (after_update, guard) = guarded_adamw(dev, &params, &grads, 3.0, 1.0, Some(&[1.0, 1.0, 0.5, 1.5]));
    let (unguarded, _) = guarded_adamw(dev, &params, &grads, 3.0, 1.0, None);
    assert_eq!((guard[0], &after_update), (1.0, &unguarded), "the update after an applied step");
}
