//! AdamW, Adam and SGD (with momentum and Nesterov) over several steps.

use kernels::cpu;
use kernels::cpu::optim::AdamHyper;
use kernels::cuda;

use super::{assert_elementwise, down, up, Rng};

#[test]
fn optimizers_agree_over_steps() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(13);
    let len = 100_003;
    let p0 = rng.vec(len, -1.0, 1.0);
    for decoupled in [true, false] {
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; len], vec![0.0; len]);
        let (mut gp, mut gm, mut gv) = (up(dev, &p0), dev.zeros(len).unwrap(), dev.zeros(len).unwrap());
        for step in 1..=5 {
            let grad = rng.vec(len, -1.0, 1.0);
            let h = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step };
            let gg = up(dev, &grad);
            if decoupled {
                cpu::optim::adamw_step(&mut p, &grad, &mut m, &mut v, &h);
                cuda::optim::adamw_step(dev, &mut gp, &gg, &mut gm, &mut gv, &h).unwrap();
            } else {
                cpu::optim::adam_step(&mut p, &grad, &mut m, &mut v, &h);
                cuda::optim::adam_step(dev, &mut gp, &gg, &mut gm, &mut gv, &h).unwrap();
            }
        }
        assert_elementwise(&format!("adam(decoupled {decoupled}) p"), &down(dev, &gp), &p);
        assert_elementwise("adam m", &down(dev, &gm), &m);
        assert_elementwise("adam v", &down(dev, &gv), &v);
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
