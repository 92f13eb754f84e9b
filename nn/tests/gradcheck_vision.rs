//! Property-based gradient checks of the vision ops and layers: `conv2d` over kernel,
//! stride, padding and bias combinations; batch norm in training mode (with and without
//! affine) and in evaluation mode; max pooling; global average pooling; and both CoMT
//! modulators (pixel-modulated BatchNorm, sliding-window convolution), each gate range.
//!
//! Ops go through [`autograd::gradcheck`] (every element of every input against f64 central
//! differences). Layers own their parameters, so [`check_module`] perturbs them in place on
//! a random sample of elements of every parameter and of the input.

mod common;

use autograd::{gradcheck, Result, Var};
use common::{check_module, randomise};
use nn::modulator::Phi;
use nn::vision::{Conv2d, GateRange, PixelBatchNorm2d, SlidingWindowConv2d};
use proptest::prelude::*;
use tensor::{Rng, Tensor};

/// Elements checked per tensor in [`check_module`].
const SAMPLES_PER_TENSOR: usize = 8;

fn random(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, rng)
}

fn assert_gradcheck(what: &str, f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs) {
        panic!("{what}: {e}");
    }
}

/// Running statistics for a `channels`-wide batch norm (constants: they get no gradient).
fn running(channels: usize, rng: &mut Rng) -> (Var, Var) {
    let mean = Var::constant(random(&[channels], rng));
    let var = Var::constant(Tensor::rand_uniform(&[channels], 0.5, 2.0, rng));
    (mean, var)
}

/// The batch standard deviation of each channel of `x[N, C, H, W]`.
fn channel_stds(x: &Tensor) -> Vec<f64> {
    let (n, c, s) = (x.shape()[0], x.shape()[1], x.shape()[2] * x.shape()[3]);
    let v = x.to_vec();
    (0..c)
        .map(|ch| {
            let values: Vec<f64> =
                (0..n).flat_map(|i| &v[(i * c + ch) * s..(i * c + ch + 1) * s]).map(|&a| a as f64).collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            (values.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / values.len() as f64).sqrt()
        })
        .collect()
}

fn phi_of(index: usize) -> Phi {
    // ReLU's kink would need rejection sampling; sigmoid and SiLU cover the smooth rule.
    [Phi::Sigmoid, Phi::Silu][index % 2]
}

fn range_of(unit: bool) -> GateRange {
    if unit {
        GateRange::Unit
    } else {
        GateRange::Double
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn conv2d(seed in any::<u64>(), n in 1usize..3, c in 1usize..4, o in 1usize..4, h in 3usize..7, w in 3usize..7,
              kernel in 1usize..4, stride in 1usize..3, padding in 0usize..2, bias in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let mut inputs = vec![random(&[n, c, h, w], &mut rng), random(&[o, c, kernel, kernel], &mut rng)];
        if bias {
            inputs.push(random(&[o], &mut rng));
        }
        assert_gradcheck(
            &format!("conv2d k{kernel} s{stride} p{padding} bias {bias}"),
            |v| v[0].conv2d(&v[1], v.get(2), stride, padding),
            &inputs,
        );
    }

    #[test]
    fn batch_norm_train(seed in any::<u64>(), n in 1usize..4, c in 1usize..4, h in 2usize..4, w in 2usize..4,
                        affine in any::<bool>(), bias in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let (mean, var) = running(c, &mut rng);
        let x = Tensor::rand_normal(&[n, c, h, w], 0.5, 2.0, &mut rng);
        // A channel whose few values nearly coincide has a huge, sharply curved gradient that
        // central differences cannot resolve: reject those draws, not the rule.
        prop_assume!(channel_stds(&x).iter().all(|&s| s > 0.5));
        let mut inputs = vec![x];
        if affine {
            inputs.push(random(&[c], &mut rng));
            if bias {
                inputs.push(random(&[c], &mut rng));
            }
        }
        assert_gradcheck(
            &format!("batch_norm2d train, affine {affine}"),
            |v| v[0].batch_norm2d(v.get(1), v.get(2), [&mean, &var], true, 0.1, 1e-5),
            &inputs,
        );
    }

    #[test]
    fn batch_norm_eval(seed in any::<u64>(), n in 1usize..3, c in 1usize..4, h in 1usize..4, w in 1usize..4,
                       affine in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let (mean, var) = running(c, &mut rng);
        let mut inputs = vec![random(&[n, c, h, w], &mut rng)];
        if affine {
            inputs.extend([random(&[c], &mut rng), random(&[c], &mut rng)]);
        }
        let before = (mean.value().to_vec(), var.value().to_vec());
        assert_gradcheck(
            &format!("batch_norm2d eval, affine {affine}"),
            |v| v[0].batch_norm2d(v.get(1), v.get(2), [&mean, &var], false, 0.1, 1e-5),
            &inputs,
        );
        prop_assert_eq!(before, (mean.value().to_vec(), var.value().to_vec()), "eval must not touch the running statistics");
    }

    #[test]
    fn max_pool2d(seed in any::<u64>(), n in 1usize..3, c in 1usize..3, h in 3usize..7, w in 3usize..7,
                  kernel in 2usize..4, stride in 1usize..3, padding in 0usize..2) {
        // Distinct values 0.05 apart, shuffled: no window has a tie a step could flip.
        let len = n * c * h * w;
        let mut rng = Rng::new(seed);
        let mut values: Vec<f32> = (0..len).map(|i| i as f32 * 0.05 - 1.0).collect();
        for i in (1..len).rev() {
            values.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let x = Tensor::from_vec(values, &[n, c, h, w]).unwrap();
        assert_gradcheck(&format!("max_pool2d k{kernel} s{stride} p{padding}"), |v| v[0].max_pool2d(kernel, stride, padding), &[x]);
    }

    #[test]
    fn global_avg_pool(seed in any::<u64>(), n in 1usize..3, c in 1usize..4, h in 1usize..5, w in 1usize..5) {
        let mut rng = Rng::new(seed);
        assert_gradcheck("global_avg_pool", |v| v[0].global_avg_pool(), &[random(&[n, c, h, w], &mut rng)]);
    }

    #[test]
    fn pixel_modulated_batch_norm(seed in any::<u64>(), n in 1usize..3, c in 1usize..5, h in 2usize..4, w in 2usize..4,
                                  hidden in 1usize..4, phi in 0usize..2, unit in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let layer = PixelBatchNorm2d::new(c, hidden, phi_of(phi), range_of(unit), &mut rng);
        randomise(&layer, 0.7, &mut rng);
        let x = Var::parameter(Tensor::rand_normal(&[n, c, h, w], 0.3, 1.5, &mut rng));
        let m = layer.modulator.forward(&layer.norm.forward(&x, true).unwrap()).unwrap();
        prop_assert_eq!(m.shape(), vec![n, 1, h, w]);
        let top = if unit { 1.0 } else { 2.0 };
        prop_assert!(m.value().to_vec().iter().all(|&g| g > 0.0 && g < top));
        check_module(&layer, &x, |x| layer.forward(x, true), seed, SAMPLES_PER_TENSOR);
        // Evaluation reads the running statistics, and its gradients are checked too.
        check_module(&layer, &x, |x| layer.forward(x, false), seed ^ 1, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn sliding_window_conv(seed in any::<u64>(), n in 1usize..3, c in 1usize..4, o in 1usize..4, h in 3usize..6,
                           w in 3usize..6, kernel in prop::sample::select(vec![1usize, 3]), stride in 1usize..3,
                           hidden in 1usize..3, phi in 0usize..2, unit in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let conv = Conv2d::new(c, o, kernel, stride, kernel / 2, false, &mut rng);
        let layer = SlidingWindowConv2d::new(conv, hidden, phi_of(phi), range_of(unit), &mut rng);
        // Weights of about 1/√fan-in keep the outputs O(1): larger ones make the f32 rounding
        // of the weighted output sum, divided by the step, rival the tolerance.
        randomise(&layer, 0.35, &mut rng);
        let x = Var::parameter(random(&[n, c, h, w], &mut rng));
        let y = layer.forward(&x).unwrap();
        let m = layer.modulator.forward(&x).unwrap();
        let out_shape = layer.conv.forward(&x).unwrap().shape();
        prop_assert_eq!(y.shape(), out_shape.clone());
        prop_assert_eq!(m.shape(), vec![n, 1, out_shape[2], out_shape[3]]);
        check_module(&layer, &x, |x| layer.forward(x), seed, SAMPLES_PER_TENSOR);
    }
}
