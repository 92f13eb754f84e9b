//! Fused optimizer updates: one pass over a parameter tensor, its gradient and its state.
//!
//! Adam (Kingma & Ba 2015, Algorithm 1) with PyTorch's arrangement of the bias corrections:
//!
//! ```text
//! m ← β1·m + (1 − β1)·g
//! v ← β2·v + (1 − β2)·g²
//! p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + eps)
//! ```
//!
//! AdamW (Loshchilov & Hutter 2019, Algorithm 2) first decays the parameter, p ← p·(1 − lr·wd);
//! Adam instead adds wd·p to the gradient. SGD follows `torch.optim.SGD` with dampening 0.
//!
//! PyTorch equivalents: `torch.optim.AdamW`, `torch.optim.Adam`, `torch.optim.SGD` (one
//! parameter's step). These update in place; there is no backward.

use wide::f32x8;

use super::parallel;
use super::simd::{load, store, LANES};

/// Rough cost of one Adam element (a square root, a division and several multiply-adds).
const ADAM_WORK: usize = 8;
/// Rough cost of one SGD element.
const SGD_WORK: usize = 2;

/// Adam/AdamW hyper-parameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to √v̂ in the denominator.
    pub eps: f32,
    /// Weight decay: decoupled for AdamW, L2 (folded into the gradient) for Adam.
    pub weight_decay: f32,
    /// 1-based step number, for the bias corrections.
    pub step: u64,
}

/// AdamW (decoupled weight decay: param -= lr·wd·param), in place on param, m, v.
pub fn adamw_step(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
    adam_update(param, grad, m, v, &AdamConstants::new(h, true));
}

/// Adam with L2 decay folded into the gradient (g + wd·param), PyTorch torch.optim.Adam semantics.
pub fn adam_step(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamHyper) {
    adam_update(param, grad, m, v, &AdamConstants::new(h, false));
}

/// SGD with momentum (PyTorch semantics: buf = momentum·buf + (g + wd·p); p -= lr·buf; nesterov optional).
///
/// A zeroed buffer reproduces PyTorch's first step (which copies the gradient into it).
/// With `momentum == 0` the buffer is not touched and may be empty.
pub fn sgd_step(
    param: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) {
    assert_eq!(grad.len(), param.len(), "sgd_step: grad and param differ in length");
    if momentum == 0.0 {
        parallel::for_each_chunk_mut(param, SGD_WORK, |start, p| {
            let g = &grad[start..start + p.len()];
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr * (g + weight_decay * *p);
            }
        });
        return;
    }
    assert_eq!(momentum_buf.len(), param.len(), "sgd_step: momentum_buf and param differ in length");
    parallel::for_each_chunk2_mut(param, momentum_buf, SGD_WORK, |start, p, buf| {
        let g = &grad[start..start + p.len()];
        for ((p, b), &g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
            let d = g + weight_decay * *p;
            *b = momentum * *b + d;
            *p -= lr * if nesterov { d + momentum * *b } else { *b };
        }
    });
}

/// Per-step scalars shared by every element.
struct AdamConstants {
    beta1: f32,
    beta2: f32,
    eps: f32,
    /// lr / (1 − β1ᵗ)
    step_size: f32,
    /// 1 / √(1 − β2ᵗ)
    inv_sqrt_correction2: f32,
    /// AdamW: p ← p·decay first. Adam: 1.
    decay: f32,
    /// Adam: g ← g + l2·p. AdamW: 0.
    l2: f32,
}

impl AdamConstants {
    fn new(h: &AdamHyper, decoupled: bool) -> Self {
        assert!(h.step >= 1, "adam: step is 1-based");
        let t = i32::try_from(h.step).unwrap_or(i32::MAX);
        let correction1 = 1.0 - f64::from(h.beta1).powi(t);
        let correction2 = 1.0 - f64::from(h.beta2).powi(t);
        Self {
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            step_size: (f64::from(h.lr) / correction1) as f32,
            inv_sqrt_correction2: (1.0 / correction2.sqrt()) as f32,
            decay: if decoupled { 1.0 - h.lr * h.weight_decay } else { 1.0 },
            l2: if decoupled { 0.0 } else { h.weight_decay },
        }
    }

    /// Scalar reference for one element: returns the new (p, m, v).
    fn element(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay;
        let g = g + self.l2 * p;
        let m = self.beta1 * m + (1.0 - self.beta1) * g;
        let v = self.beta2 * v + (1.0 - self.beta2) * g * g;
        let denom = v.sqrt() * self.inv_sqrt_correction2 + self.eps;
        (p - self.step_size * m / denom, m, v)
    }
}

fn adam_update(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamConstants) {
    assert_eq!(grad.len(), param.len(), "adam: grad and param differ in length");
    let (beta1, beta2) = (f32x8::splat(c.beta1), f32x8::splat(c.beta2));
    let (one_minus_beta1, one_minus_beta2) = (1.0 - c.beta1, 1.0 - c.beta2);
    parallel::for_each_chunk3_mut(param, m, v, ADAM_WORK, |start, p, m, v| {
        let g = &grad[start..start + p.len()];
        let simd_end = p.len() - p.len() % LANES;
        for i in (0..simd_end).step_by(LANES) {
            let pv = load(&p[i..]) * c.decay;
            let gv = pv.mul_add(f32x8::splat(c.l2), load(&g[i..]));
            let mv = beta1 * load(&m[i..]) + gv * one_minus_beta1;
            let vv = beta2 * load(&v[i..]) + gv * gv * one_minus_beta2;
            let denom = vv.sqrt().mul_add(f32x8::splat(c.inv_sqrt_correction2), f32x8::splat(c.eps));
            store(pv - mv * c.step_size / denom, &mut p[i..]);
            store(mv, &mut m[i..]);
            store(vv, &mut v[i..]);
        }
        for i in simd_end..p.len() {
            (p[i], m[i], v[i]) = c.element(p[i], g[i], m[i], v[i]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HYPER: AdamHyper = AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1 };

    /// PyTorch's update written out in f64.
    fn adam_f64(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], h: &AdamHyper, decoupled: bool) {
        let (lr, b1, b2, wd) = (h.lr as f64, h.beta1 as f64, h.beta2 as f64, h.weight_decay as f64);
        let t = h.step as i32;
        for i in 0..p.len() {
            if decoupled {
                p[i] *= 1.0 - lr * wd;
            }
            let g = if decoupled { g[i] } else { g[i] + wd * p[i] };
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let denom = v[i].sqrt() / (1.0 - b2.powi(t)).sqrt() + h.eps as f64;
            p[i] -= lr / (1.0 - b1.powi(t)) * m[i] / denom;
        }
    }

    proptest! {
        #[test]
        fn adam_matches_f64_over_steps(len in 1usize..40, decoupled in any::<bool>()) {
            let mut p: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut m, mut v) = (vec![0.0; len], vec![0.0; len]);
            let f64s = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
            let (mut p64, mut m64, mut v64) = (f64s(&p), vec![0.0; len], vec![0.0; len]);
            for step in 1..=5 {
                let g: Vec<f32> = (0..len).map(|i| ((i * step as usize) as f32 * 0.71).cos()).collect();
                let h = AdamHyper { step, ..HYPER };
                if decoupled {
                    adamw_step(&mut p, &g, &mut m, &mut v, &h);
                } else {
                    adam_step(&mut p, &g, &mut m, &mut v, &h);
                }
                adam_f64(&mut p64, &f64s(&g), &mut m64, &mut v64, &h, decoupled);
            }
            for i in 0..len {
                prop_assert!((p[i] as f64 - p64[i]).abs() < 1e-5, "{} vs {}", p[i], p64[i]);
                prop_assert!((m[i] as f64 - m64[i]).abs() < 1e-5);
            }
        }

        #[test]
        fn sgd_matches_pytorch_formula(len in 1usize..40, nesterov in any::<bool>()) {
            let mut p: Vec<f32> = (0..len).map(|i| i as f32 * 0.1).collect();
            let mut buf = vec![0.0; len];
            let (mut p_ref, mut buf_ref) = (p.clone(), vec![None::<f32>; len]);
            for step in 0..3 {
                let g: Vec<f32> = (0..len).map(|i| ((i + step) % 5) as f32 - 2.0).collect();
                sgd_step(&mut p, &g, &mut buf, 0.1, 0.9, 0.01, nesterov);
                for i in 0..len {
                    let d = g[i] + 0.01 * p_ref[i];
                    // PyTorch: the first step clones d into the buffer.
                    let b = buf_ref[i].map_or(d, |b| 0.9 * b + d);
                    buf_ref[i] = Some(b);
                    p_ref[i] -= 0.1 * if nesterov { d + 0.9 * b } else { b };
                }
            }
            prop_assert!(p.iter().zip(&p_ref).all(|(a, b)| (a - b).abs() < 1e-5));
        }
    }

    #[test]
    fn large_tensors_match_scalar_path() {
        let len = 100_003;
        let p0: Vec<f32> = (0..len).map(|i| (i as f32 * 0.013).sin()).collect();
        let g: Vec<f32> = (0..len).map(|i| (i as f32 * 0.029).cos()).collect();
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.01; len], vec![0.02; len]);
        let h = AdamHyper { step: 7, ..HYPER };
        adamw_step(&mut p, &g, &mut m, &mut v, &h);
        let c = AdamConstants::new(&h, true);
        for i in (0..len).step_by(997) {
            let (pe, me, ve) = c.element(p0[i], g[i], 0.01, 0.02);
            assert!((p[i] - pe).abs() < 1e-6 && (m[i] - me).abs() < 1e-7 && (v[i] - ve).abs() < 1e-7);
        }
        // Plain SGD ignores an empty buffer.
        let mut q = p0.clone();
        sgd_step(&mut q, &g, &mut [], 0.5, 0.0, 0.0, false);
        assert!(q.iter().zip(&p0).zip(&g).all(|((q, p), g)| (q - (p - 0.5 * g)).abs() < 1e-6));
    }
}
