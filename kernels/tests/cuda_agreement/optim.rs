//! AdamW, Adam and SGD (with momentum and Nesterov) over several steps.

use kernels::cpu;
use kernels::cpu::optim::AdamHyper;
use kernels::cuda;

use half::bf16;
use kernels::cuda::DeviceBuffer;

use super::{assert_elementwise, down, up, Rng};

#[test]
fn optimizers_agree_over_steps() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(13);
    let len = 100_003;
    let p0 = rng.vec(len, -1.0, 1.0);
    // 30 tensors of different lengths: two launches of the multi-tensor kernel (24 + 6).
    let lens: Vec<usize> = (0..30).map(|i| if i == 0 { len } else { 1 + 37 * i }).collect();
    for decoupled in [true, false] {
        let mut p: Vec<Vec<f32>> = lens.iter().map(|&n| p0[..n].to_vec()).collect();
        let (mut m, mut v): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            (lens.iter().map(|&n| vec![0.0; n]).collect(), lens.iter().map(|&n| vec![0.0; n]).collect());
        let mut gp: Vec<DeviceBuffer<f32>> = p.iter().map(|x| up(dev, x)).collect();
        let mut gm: Vec<DeviceBuffer<f32>> = lens.iter().map(|&n| dev.zeros(n).unwrap()).collect();
        let mut gv: Vec<DeviceBuffer<f32>> = lens.iter().map(|&n| dev.zeros(n).unwrap()).collect();
        // Every other tensor has a bf16 copy, which the update rewrites from the new parameter.
        let mut copies: Vec<Option<DeviceBuffer<bf16>>> =
            lens.iter().enumerate().map(|(i, &n)| (i % 2 == 0).then(|| dev.alloc(n).unwrap())).collect();
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
                .zip(copies.iter_mut())
                .map(|(((param, grad), (m, v)), copy)| cuda::optim::AdamTensor {
                    param,
                    param_bf16: copy.as_mut(),
                    grad,
                    m,
                    v,
                })
                .collect();
            let update = if decoupled { cuda::optim::adamw_step } else { cuda::optim::adam_step };
            update(dev, &mut tensors, &h).unwrap();
        }
        for (i, n) in lens.iter().enumerate() {
            let what = format!("adam(decoupled {decoupled}) tensor {i} of {n}");
            assert_elementwise(&format!("{what}: p"), &down(dev, &gp[i]), &p[i]);
            assert_elementwise(&format!("{what}: m"), &down(dev, &gm[i]), &m[i]);
            assert_elementwise(&format!("{what}: v"), &down(dev, &gv[i]), &v[i]);
            if let Some(copy) = &copies[i] {
                let rounded: Vec<bf16> = down(dev, &gp[i]).iter().map(|&x| bf16::from_f32(x)).collect();
                assert_eq!(dev.download(copy).unwrap(), rounded, "{what}: the bf16 copy is the new parameter rounded");
            }
        }
    }
    for (momentum, nesterov) in [(0.9, false), (0.9, true), (0.0, false)] {
        let (mut p, mut buf) = (p0.clone(), vec![0.0; len]);
        let (mut gp, mut gbuf) = (up(dev, &p0), dev.zeros(len).unwrap());
        for _ in 0..3 {
            let grad = rng.vec(len, -1.0, 1.0);
            cpu::optim::sgd_step(&mut p, &grad, &mut buf, 0.1, momentum, 0.01, nesterov);
            cuda::optim::sgd_step(dev, &mut gp, &up(dev, &grad), &mut gbuf, 0.1, momentum, 0.01, nesterov).unwrap();
        }
        assert_elementwise(&format!("sgd(momentum {momentum}, nesterov {nesterov})"), &down(dev, &gp), &p);
    }
}
