//! Property-based gradient checks of the nn modules: every modulator (each resolution, φ,
//! learnable or fixed α, non-contextual, CoMT), the fused projection against the unfused
//! one, the per-token layers, SwiGLU (and its fused gating against `silu().mul()`), attention
//! with RoPE, and each residual rule on a tiny single block (d = 8).
//!
//! Module parameters live inside the modules, so [`check_module`] perturbs them in place:
//! `L = Σ wᵢ·yᵢ` with fixed random weights, back-propagated once, against f64 central
//! differences (`autograd::gradcheck_leaves`) on a random sample of elements of every parameter
//! and of the input.

mod common;

use autograd::Var;
use common::{check_module, randomise};
use nn::attention::{Attention, AttentionConfig};
use nn::ffn::SwiGlu;
use nn::init::WeightInit;
use nn::layers::{DyT, Norm};
use nn::modulator::{
    ComtModulator, Gate, ModulatedProjection, Modulator, ModulatorConfig, NonContextualGate, Phi, Residual,
    ResidualRule, Resolution, Stream,
};
use nn::per_token::{PerTokenTransform, TokenScale};
use nn::Module;
use proptest::prelude::*;
use tensor::{Device, Rng, Tensor, Tokens};

/// Elements checked per tensor: enough to catch a wrong rule, few enough to stay fast.
const SAMPLES_PER_TENSOR: usize = 6;

fn random(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, rng)
}

/// Output and every gradient (parameters, then the input) of `p` on `x`, with the fused op
/// and without, back-propagating the same random output gradient.
fn fused_and_unfused(p: &mut ModulatedProjection, x: &Var, seed: u64) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    [true, false]
        .iter()
        .map(|&fused| {
            p.fused = fused;
            let params = p.named_parameters();
            params.iter().for_each(|q| q.var.zero_grad());
            x.zero_grad();
            let y = p.forward(x).unwrap();
            y.backward_with(Tensor::rand_normal(&y.shape(), 0.0, 1.0, &mut Rng::new(seed))).unwrap();
            let mut grads: Vec<Vec<f32>> = params.iter().map(|q| q.var.grad().unwrap().to_vec()).collect();
            grads.push(x.grad().unwrap().to_vec());
            (y.value().to_vec(), grads)
        })
        .collect()
}

fn phi_of(index: usize) -> Phi {
    [Phi::Sigmoid, Phi::Silu, Phi::Relu][index % 3]
}

/// ReLU has a kink at 0: reject draws whose pre-activations sit within a step of it.
fn away_from_relu_kink(phi: Phi, pre: &Var) -> bool {
    phi != Phi::Relu || pre.value().to_vec().iter().all(|u| u.abs() > 0.02)
}

fn input(shape: &[usize], rng: &mut Rng) -> Var {
    Var::parameter(random(shape, rng))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn modulator(seed in any::<u64>(), rows in 1usize..4, d_in in 1usize..6, d_out in 1usize..6,
                 rank in 1usize..4, phi in 0usize..3, channel in any::<bool>(), learnable in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let (phi, resolution) = (phi_of(phi), if channel { Resolution::Channel } else { Resolution::Scalar });
        let config = ModulatorConfig { rank, phi, learnable_alpha: learnable };
        let m = Modulator::new(d_in, d_out, resolution, config, &mut rng);
        randomise(&m, 0.7, &mut rng);
        let x = input(&[rows, d_in], &mut rng);
        let pre = x.matmul(&m.a_weight.transpose(0, 1).unwrap()).unwrap().add(&m.a_bias).unwrap();
        prop_assume!(away_from_relu_kink(phi, &pre));
        let gate = m.forward(&x).unwrap();
        prop_assert_eq!(gate.shape(), vec![rows, if channel { d_out } else { 1 }]);
        prop_assert!(gate.value().to_vec().iter().all(|&g| g > 0.0 && g < 2.0));
        prop_assert_eq!(m.named_parameters().iter().any(|p| p.name == "alpha"), learnable);
        check_module(&m, &x, |x| m.forward(x), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn non_contextual_and_comt(seed in any::<u64>(), rows in 1usize..4, d_in in 1usize..6, d_out in 1usize..6,
                               hidden in 1usize..4, phi in 0usize..3) {
        let mut rng = Rng::new(seed);
        let fresh = NonContextualGate::new(d_out, true);
        prop_assert!(fresh.forward().unwrap().value().to_vec().iter().all(|&g| (g - 1.0).abs() < 1e-6));
        randomise(&fresh, 0.8, &mut rng);
        let x = input(&[rows, d_out], &mut rng);
        check_module(&fresh, &x, |x| x.mul(&fresh.forward()?), seed, SAMPLES_PER_TENSOR);

        let phi = phi_of(phi);
        let comt = ComtModulator::new(d_in, hidden, phi, &mut rng);
        randomise(&comt, 0.7, &mut rng);
        let x = input(&[rows, d_in], &mut rng);
        let pre = x.matmul(&comt.w1.transpose(0, 1).unwrap()).unwrap().add(&comt.c1).unwrap();
        prop_assume!(away_from_relu_kink(phi, &pre));
        let g = comt.forward(&x).unwrap();
        prop_assert!(g.value().to_vec().iter().all(|&v| v > 0.0 && v < 1.0));
        check_module(&comt, &x, |x| comt.forward(x), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn fused_projection_matches_unfused(seed in any::<u64>(), rows in 1usize..5, d_in in 1usize..7,
                                        d_out in 1usize..7, rank in 1usize..4, phi in 0usize..3) {
        let mut rng = Rng::new(seed);
        let phi = phi_of(phi);
        let mut p = ModulatedProjection::new(d_in, d_out, WeightInit::KaimingUniform, &mut rng);
        p.gates.push(Gate::channel_scalar(d_in, d_out, ModulatorConfig { rank, phi, learnable_alpha: true }, &mut rng));
        randomise(&p, 0.6, &mut rng);
        let x = input(&[2, rows, d_in], &mut rng);
        let results = fused_and_unfused(&mut p, &x, seed);
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 + 1e-4 * y.abs());
        prop_assert!(close(&results[0].0, &results[1].0), "forward differs");
        for (i, (a, b)) in results[0].1.iter().zip(&results[1].1).enumerate() {
            prop_assert!(close(a, b), "gradient {} differs: {:?} vs {:?}", i, a, b);
        }
        p.fused = true;
        let flat = x.reshape(&[2 * rows, d_in]).unwrap();
        let mut pre = Vec::new();
        if let Gate::ChannelScalar { channel, scalar } = &p.gates[0] {
            for m in [channel, scalar] {
                pre.push(flat.matmul(&m.a_weight.transpose(0, 1).unwrap()).unwrap().add(&m.a_bias).unwrap());
            }
        }
        prop_assume!(pre.iter().all(|u| away_from_relu_kink(phi, u)));
        check_module(&p, &x, |x| p.forward(x), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn per_token_layers(seed in any::<u64>(), rows in 1usize..5, dim in 1usize..6, rank in 1usize..4,
                        vocab in 1usize..5) {
        let mut rng = Rng::new(seed);
        let ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab as u64) as u32).collect();
        let ids = Tokens::new(&ids, Device::Cpu).unwrap();
        let ptt = PerTokenTransform::new(vocab, dim, rank, &mut rng);
        let x = input(&[1, rows, dim], &mut rng);
        prop_assert!(ptt.forward(&x, &ids).unwrap().value().to_vec().iter().all(|&v| v == 0.0));
        randomise(&ptt, 0.7, &mut rng);
        check_module(&ptt, &x, |x| ptt.forward(x, &ids), seed, SAMPLES_PER_TENSOR);

        let scale = TokenScale::new(vocab, dim);
        prop_assert_eq!(scale.forward(&x, &ids).unwrap().value().to_vec(), x.value().to_vec());
        randomise(&scale, 1.0, &mut rng);
        check_module(&scale, &x, |x| scale.forward(x, &ids), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn swiglu(seed in any::<u64>(), rows in 1usize..4, d in 1usize..6, hidden in 1usize..7) {
        let mut rng = Rng::new(seed);
        let ffn = SwiGlu::new(d, hidden, WeightInit::KaimingUniform, &mut rng);
        let x = input(&[rows, d], &mut rng);
        check_module(&ffn, &x, |x| ffn.forward(x), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn swiglu_fused_matches_silu_mul(seed in any::<u64>(), rows in 1usize..20, d in 1usize..6, hidden in 1usize..20) {
        // The fused op against `silu().mul()`, alone on wide-ranging inputs (|g| up to ~16,
        // lengths across the SIMD width) and inside the FFN, forward and every gradient.
        let mut rng = Rng::new(seed);
        let g = Var::parameter(Tensor::rand_normal(&[rows, hidden], 0.0, 4.0, &mut rng));
        let u = input(&[rows, hidden], &mut rng);
        let ffn = SwiGlu::new(d, hidden, WeightInit::KaimingUniform, &mut rng);
        randomise(&ffn, 0.8, &mut rng);
        let x = input(&[rows, d], &mut rng);
        let unfused = |x: &Var| -> autograd::Result<Var> {
            let hidden = ffn.gate_proj.forward(x)?.swiglu_reference(&ffn.up_proj.forward(x)?)?;
            ffn.down_proj.forward(&hidden)
        };
        let mut leaves: Vec<Var> = ffn.named_parameters().into_iter().map(|p| p.var).collect();
        leaves.extend([x.clone(), g.clone(), u.clone()]);
        let run = |fused: bool| -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
            leaves.iter().for_each(Var::zero_grad);
            let gated = if fused { g.swiglu(&u) } else { g.swiglu_reference(&u) }.unwrap();
            let y = if fused { ffn.forward(&x) } else { unfused(&x) }.unwrap();
            let mut weights = Rng::new(seed ^ 1);
            gated.backward_with(Tensor::rand_normal(&gated.shape(), 0.0, 1.0, &mut weights)).unwrap();
            y.backward_with(Tensor::rand_normal(&y.shape(), 0.0, 1.0, &mut weights)).unwrap();
            let grads = leaves.iter().map(|v| v.grad().unwrap().to_vec()).collect();
            (gated.value().to_vec(), y.value().to_vec(), grads)
        };
        let (fused, composite) = (run(true), run(false));
        // Elementwise to 1e-5 relative, plus rounding of the vector's largest entry: a
        // gradient is a sum whose terms can be far larger than the result, and the two paths
        // sum them in different orders (seen: 4.3e-6 on an entry of 0.287 beside one of 47.7).
        let close = |a: &[f32], b: &[f32]| {
            let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 + 1e-5 * y.abs() + 1e-6 * scale)
        };
        prop_assert!(close(&fused.0, &composite.0), "swiglu forward differs");
        prop_assert!(close(&fused.1, &composite.1), "FFN forward differs");
        for (i, (a, b)) in fused.2.iter().zip(&composite.2).enumerate() {
            prop_assert!(close(a, b), "gradient {} differs: {:?} vs {:?}", i, a, b);
        }
    }

    #[test]
    fn attention_with_rope(seed in any::<u64>(), batch in 1usize..3, seq in 1usize..5, heads in 1usize..3) {
        let mut rng = Rng::new(seed);
        let config = AttentionConfig { d_model: 4 * heads, n_heads: heads, rope_theta: 10_000.0 };
        let attn = Attention::new(config, WeightInit::KaimingUniform, &mut rng).unwrap();
        randomise(&attn, 0.5, &mut rng);
        let x = input(&[batch, seq, 4 * heads], &mut rng);
        check_module(&attn, &x, |x| attn.forward(x), seed, SAMPLES_PER_TENSOR);
    }

    #[test]
    fn block_rules(seed in any::<u64>(), seq in 1usize..4, rule in 0usize..9) {
        let mut rng = Rng::new(seed);
        let (d, dyt) = (8, rule == 8);
        let rule = [
            ResidualRule::PreNorm { scale: 1.0 },
            ResidualRule::PreNorm { scale: 0.5 },
            ResidualRule::PostNorm { alpha: 1.0 },
            ResidualRule::PostNorm { alpha: 1.6 },
            ResidualRule::ReZero,
            ResidualRule::LaurelRw,
            ResidualRule::LaurelLr { rank: 2 },
            ResidualRule::LaurelPa { earlier: 2 },
            ResidualRule::PreNorm { scale: 1.0 },
        ][rule];
        let config = AttentionConfig { d_model: d, n_heads: 2, rope_theta: 10_000.0 };
        let attn = Attention::new(config, WeightInit::KaimingUniform, &mut rng).unwrap();
        let ffn = SwiGlu::new(d, 12, WeightInit::KaimingUniform, &mut rng);
        let make_norm = || if dyt { Norm::Dyt(DyT::new(d)) } else { Norm::rms(d, 1e-6) };
        let residual = Residual::new(rule, d, make_norm, &mut rng);
        // Zero-initialised weights (ReZero α, LAuReL-LR B, LAuReL-PA γ) would hide gradients.
        randomise(&residual, 0.5, &mut rng);
        let earlier: Vec<Var> = (0..2).map(|_| Var::constant(random(&[1, seq, d], &mut rng))).collect();
        let block = |x: &Var| {
            let between = None::<fn(&Var) -> autograd::Result<Var>>;
            residual.forward(&Stream::new(x.clone()), &earlier, |h| attn.forward_deferred(h), between, |h| ffn.forward_deferred(h))?.value()
        };
        let x = input(&[1, seq, d], &mut rng);
        prop_assert_eq!(block(&x).unwrap().shape(), vec![1, seq, d]);
        for module in [&residual as &dyn Module, &attn, &ffn] {
            check_module(module, &x, block, seed, SAMPLES_PER_TENSOR);
        }
    }
}

/// The fused op runs in blocks of 256 rows, one task each: several blocks, a short last
/// block and a width that is not a multiple of the SIMD lanes must still match the unfused
/// composite (the proptest above stays within one block). Weight gradients sum 900 rows in
/// different orders, so values are compared relative to each tensor's largest magnitude.
#[test]
fn fused_projection_matches_unfused_across_row_blocks() {
    for phi in [Phi::Sigmoid, Phi::Silu] {
        let mut rng = Rng::new(11);
        let (d_in, d_out) = (12, 20);
        let mut p = ModulatedProjection::new(d_in, d_out, WeightInit::KaimingUniform, &mut rng);
        p.gates.push(Gate::channel_scalar(
            d_in,
            d_out,
            ModulatorConfig { rank: 4, phi, learnable_alpha: true },
            &mut rng,
        ));
        randomise(&p, 0.6, &mut rng);
        let x = input(&[3, 300, d_in], &mut rng);
        let results = fused_and_unfused(&mut p, &x, 5);
        let close = |a: &[f32], b: &[f32]| {
            let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * scale)
        };
        assert!(close(&results[0].0, &results[1].0), "{phi:?}: forward differs");
        for (i, (a, b)) in results[0].1.iter().zip(&results[1].1).enumerate() {
            assert!(close(a, b), "{phi:?}: gradient {i} differs");
        }
    }
}
