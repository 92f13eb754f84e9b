//! Gradient checks of every differentiable op: analytic gradients from `backward` against
//! extrapolated central differences (`autograd::gradcheck`, the toolkit's f32 row) on random shapes,
//! broadcasting pairs and non-contiguous views. Input domains stay off kinks, ties and
//! near-zero denominators (see `transponder_tests` docs), so a failure points at the op.
//!
//! Below the property tests: gradient accumulation (reuse, repeated backward, zero_grad),
//! `no_grad`/`detach`, and the documented tie/kink conventions.

use autograd::ops::{GatedProjectionVars, Unary};
use autograd::{is_grad_enabled, no_grad, Var};
use proptest::prelude::*;
use tensor::ops::ProductOutput;
use tensor::{Device, Rng, Tensor};
use transponder_tests::*;

/// Cases per property: enough to hit size-1 dims, rank 0 and strided views, small enough
/// that the whole suite runs in seconds.
const CASES: u32 = 20;

// ---------------------------------------------------------------------------------------
// Strategies local to this file.

/// Two broadcast-compatible inputs, each possibly strided, from the given domains.
fn binary_inputs(a: Domain, b: Domain) -> impl Strategy<Value = ((Layout, Tensor), (Layout, Tensor))> {
    broadcast_pair().prop_flat_map(move |(sa, sb)| (input(sa, a), input(sb, b)))
}

/// Two inputs of one random shape (no broadcasting), each possibly strided.
fn same_shape_inputs(a: Domain, b: Domain) -> impl Strategy<Value = ((Layout, Tensor), (Layout, Tensor))> {
    shape().prop_flat_map(move |s| (input(s.clone(), a), input(s, b)))
}

/// An input of a random shape from `domain`, possibly strided.
fn any_input(domain: Domain) -> impl Strategy<Value = (Layout, Tensor)> {
    shape().prop_flat_map(move |s| input(s, domain))
}

/// An input of a random shape, a valid axis and a keepdim flag.
fn reduce_inputs(domain: Domain) -> impl Strategy<Value = ((Layout, Tensor), usize, bool)> {
    shape_and_axis().prop_flat_map(move |(s, axis)| (input(s, domain), Just(axis), any::<bool>()))
}

fn binary_check(op: fn(&Var, &Var) -> tensor::Result<Var>, (la, a): (Layout, Tensor), (lb, b): (Layout, Tensor)) {
    assert_gradcheck(|x| op(&la.view(&x[0])?, &lb.view(&x[1])?), &[a, b]);
}

// ---------------------------------------------------------------------------------------
// Binary and scalar ops.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn add_broadcasts((a, b) in binary_inputs(Domain::Uniform(-2.0, 2.0), Domain::Uniform(-2.0, 2.0))) {
        binary_check(Var::add, a, b);
    }

    #[test]
    fn sub_broadcasts((a, b) in binary_inputs(Domain::Uniform(-2.0, 2.0), Domain::Uniform(-2.0, 2.0))) {
        binary_check(Var::sub, a, b);
    }

    #[test]
    fn mul_broadcasts((a, b) in binary_inputs(Domain::Uniform(-2.0, 2.0), Domain::Uniform(-2.0, 2.0))) {
        binary_check(Var::mul, a, b);
    }

    #[test]
    fn div_broadcasts((a, b) in binary_inputs(Domain::Uniform(-2.0, 2.0), Domain::AwayFromZero(0.5, 2.0))) {
        binary_check(Var::div, a, b);
    }

    #[test]
    fn maximum_broadcasts((a, b) in binary_inputs(Domain::Interleaved(0.1), Domain::Interleaved(0.35))) {
        binary_check(Var::maximum, a, b);
    }

    #[test]
    fn minimum_broadcasts((a, b) in binary_inputs(Domain::Interleaved(0.35), Domain::Interleaved(0.1))) {
        binary_check(Var::minimum, a, b);
    }

    #[test]
    fn swiglu((g, u) in same_shape_inputs(Domain::Uniform(-5.0, 5.0), Domain::Uniform(-2.0, 2.0))) {
        binary_check(Var::swiglu, g, u);
    }

    #[test]
    fn swiglu_saturated((g, u) in same_shape_inputs(Domain::AwayFromZero(8.0, 20.0), Domain::Uniform(-2.0, 2.0))) {
        // silu(g) → g or 0: the recomputed σ(g) must give slopes near 1 or 0, not NaN.
        binary_check(Var::swiglu, g, u);
    }

    #[test]
    fn swiglu_halves(seed in any::<u64>(), lead in 1usize..3, rows in 1usize..4, half in 1usize..10) {
        // [lead, rows, 2·half]: the gate's half and up's half of one product per row.
        let x = Tensor::rand_uniform(&[lead, rows, 2 * half], -4.0, 4.0, &mut Rng::new(seed));
        assert_gradcheck(|v| v[0].swiglu_halves(), std::slice::from_ref(&x));
        let x = Var::parameter(x);
        let (fused, reference) = (x.swiglu_halves().unwrap(), x.swiglu_halves_reference().unwrap());
        for (a, b) in fused.value().to_vec().iter().zip(reference.value().to_vec()) {
            prop_assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{} vs {}", a, b);
        }
    }

    #[test]
    fn packed_linear(
        seed in any::<u64>(),
        rows in 1usize..5,
        d_in in 1usize..6,
        outs in proptest::collection::vec(1usize..5, 1..4),
    ) {
        // x: [2, rows, in] and one weight [out_i, in] per projection.
        let mut rng = Rng::new(seed);
        let mut values = vec![Tensor::rand_uniform(&[2, rows, d_in], -1.0, 1.0, &mut rng)];
        values.extend(outs.iter().map(|&out| Tensor::rand_uniform(&[out, d_in], -1.0, 1.0, &mut rng)));
        assert_gradcheck(|v| v[0].packed_linear(&v[1..].iter().collect::<Vec<_>>(), ProductOutput::F32), &values);
        let vars: Vec<Var> = values.into_iter().map(Var::parameter).collect();
        let weights: Vec<&Var> = vars[1..].iter().collect();
        let fused = vars[0].packed_linear(&weights, ProductOutput::Bf16).unwrap().value().to_vec();
        prop_assert_eq!(fused, vars[0].packed_linear_reference(&weights).unwrap().value().to_vec());
    }

    #[test]
    fn add_scalar_and_mul_scalar(((l, x), s) in (any_input(Domain::Uniform(-2.0, 2.0)), -3.0f32..3.0)) {
        assert_gradcheck(|v| l.view(&v[0])?.add_scalar(s), std::slice::from_ref(&x));
        assert_gradcheck(|v| l.view(&v[0])?.mul_scalar(s), &[x]);
    }
}

// ---------------------------------------------------------------------------------------
// Unary ops: one property per op, each on its safe domain, contiguous or strided.

macro_rules! unary_gradchecks {
    ($($name:ident: $domain:expr => |$x:ident| $body:expr;)*) => {
        proptest! {
            #![proptest_config(config(CASES))]
            $(
                #[test]
                fn $name((layout, x) in any_input($domain)) {
                    assert_gradcheck(|v| { let $x = layout.view(&v[0])?; $body }, &[x]);
                }
            )*
        }
    };
}

unary_gradchecks! {
    neg: Domain::Uniform(-3.0, 3.0) => |x| x.neg();
    exp: Domain::Uniform(-2.0, 2.0) => |x| x.exp();
    log: Domain::Positive(0.3, 4.0) => |x| x.log();
    sqrt: Domain::Positive(0.3, 4.0) => |x| x.sqrt();
    rsqrt: Domain::Positive(0.3, 4.0) => |x| x.rsqrt();
    powf_cube: Domain::Positive(0.3, 2.0) => |x| x.powf(3.0);
    powf_half: Domain::Positive(0.3, 4.0) => |x| x.powf(0.5);
    powf_negative: Domain::Positive(0.5, 3.0) => |x| x.powf(-1.5);
    powf_zero: Domain::Positive(0.3, 3.0) => |x| x.powf(0.0);
    square: Domain::Uniform(-3.0, 3.0) => |x| x.square();
    abs: Domain::AwayFromZero(0.05, 3.0) => |x| x.abs();
    sigmoid: Domain::Uniform(-5.0, 5.0) => |x| x.sigmoid();
    tanh: Domain::Uniform(-3.0, 3.0) => |x| x.tanh();
    relu: Domain::AwayFromZero(0.05, 3.0) => |x| x.relu();
    silu: Domain::Uniform(-5.0, 5.0) => |x| x.silu();
    gelu: Domain::Uniform(-4.0, 4.0) => |x| x.gelu();
    gelu_tanh: Domain::Uniform(-4.0, 4.0) => |x| x.gelu_tanh();
    // The SIMD paths switch formulas at |x| = 0.625 (tanh) and 1 (erfc): straddle them.
    tanh_near_switch: Domain::Uniform(0.55, 0.7) => |x| x.tanh();
    gelu_near_switch: Domain::Uniform(-1.6, 1.6) => |x| x.gelu();
    // Large magnitudes: saturation must give derivatives near 0, not NaN.
    sigmoid_saturated: Domain::AwayFromZero(8.0, 20.0) => |x| x.sigmoid();
    tanh_saturated: Domain::AwayFromZero(4.0, 12.0) => |x| x.tanh();
}

// ---------------------------------------------------------------------------------------
// Reductions over a random axis, with and without keepdim.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn sum_axis(((l, x), axis, keepdim) in reduce_inputs(Domain::Uniform(-2.0, 2.0))) {
        assert_gradcheck(|v| l.view(&v[0])?.sum_axis(axis, keepdim), &[x]);
    }

    #[test]
    fn mean_axis(((l, x), axis, keepdim) in reduce_inputs(Domain::Uniform(-2.0, 2.0))) {
        assert_gradcheck(|v| l.view(&v[0])?.mean_axis(axis, keepdim), &[x]);
    }

    #[test]
    fn max_axis(((l, x), axis, keepdim) in reduce_inputs(Domain::Distinct(0.1))) {
        assert_gradcheck(|v| l.view(&v[0])?.max_axis(axis, keepdim), &[x]);
    }

    #[test]
    fn sum_all_and_mean_all((l, x) in any_input(Domain::Uniform(-2.0, 2.0))) {
        assert_gradcheck(|v| l.view(&v[0])?.sum_all(), std::slice::from_ref(&x));
        assert_gradcheck(|v| l.view(&v[0])?.mean_all(), &[x]);
    }
}

// ---------------------------------------------------------------------------------------
// Matmul: 2-D, batched, broadcast batch dimensions, transposed/strided operand views.

/// `(a, b)` for `a[..., m, k] · b[..., k, n]` with broadcast-compatible batch shapes of
/// rank 0-2 (from `batch`), each operand possibly a strided (transposed, offset) view.
fn matmul_inputs(
    batch: impl Strategy<Value = (Vec<usize>, Vec<usize>)>,
) -> impl Strategy<Value = ((Layout, Tensor), (Layout, Tensor))> {
    (batch, 1..=4usize, 1..=4usize, 1..=4usize).prop_flat_map(|((ba, bb), m, k, n)| {
        let a = [ba.as_slice(), &[m, k]].concat();
        let b = [bb.as_slice(), &[k, n]].concat();
        (input(a, Domain::Uniform(-1.5, 1.5)), input(b, Domain::Uniform(-1.5, 1.5)))
    })
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn matmul_2d((a, b) in matmul_inputs(Just((vec![], vec![])))) {
        binary_check(Var::matmul, a, b);
    }

    #[test]
    fn matmul_batched((a, b) in matmul_inputs((1..=3usize).prop_map(|bt| (vec![bt], vec![bt])))) {
        binary_check(Var::matmul, a, b);
    }

    #[test]
    fn matmul_broadcast_batch((a, b) in matmul_inputs(broadcast_pair_from(shape_with_rank(1..=2)))) {
        binary_check(Var::matmul, a, b);
    }

    #[test]
    fn matmul_with_transposed_weight((m, k, n) in (1..=4usize, 1..=4usize, 1..=4usize), seed in any::<u64>()) {
        // x · wᵀ with w stored [n, k], the layout of a linear layer.
        let x = seeded(&[2, m, k], -1.5, 1.5, seed);
        let w = seeded(&[n, k], -1.5, 1.5, seed ^ 1);
        assert_gradcheck(|v| v[0].matmul(&v[1].transpose(0, 1)?), &[x, w]);
    }
}

// ---------------------------------------------------------------------------------------
// Views (on contiguous and strided inputs) and cat.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn reshape(((l, x), target) in shape().prop_flat_map(|s| (
        input(s.clone(), Domain::Uniform(-2.0, 2.0)),
        Just(s).prop_shuffle(),
        any::<prop::sample::Index>(),
    )).prop_map(|(i, mut target, pick)| {
        // The same dims in another order (same numel), one of them inferred sometimes.
        let slot = pick.index(target.len() + 1);
        if slot < target.len() {
            target[slot] = usize::MAX;
        }
        (i, target)
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.reshape(&target), std::slice::from_ref(&x));
        let n = l.shape.iter().product::<usize>();
        assert_gradcheck(|v| l.view(&v[0])?.reshape(&[n]), &[x]);
    }

    #[test]
    fn permute(((l, x), axes) in shape().prop_flat_map(|s| {
        let rank = s.len();
        (input(s, Domain::Uniform(-2.0, 2.0)), Just((0..rank).collect::<Vec<_>>()).prop_shuffle())
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.permute(&axes), &[x]);
    }

    #[test]
    fn transpose(((l, x), a, b) in shape().prop_flat_map(|s| {
        let rank = s.len();
        (input(s, Domain::Uniform(-2.0, 2.0)), 0..rank, 0..rank)
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.transpose(a, b), &[x]);
    }

    #[test]
    fn narrow(((l, x), axis, start, len) in shape_and_axis().prop_flat_map(|(s, axis)| {
        let size = s[axis];
        (input(s, Domain::Uniform(-2.0, 2.0)), Just(axis), 0..size)
            .prop_flat_map(move |(i, axis, start)| (Just(i), Just(axis), Just(start), 1..=size - start))
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.narrow(axis, start, len), &[x]);
    }

    #[test]
    fn expand(((l, x), target) in broadcast_pair().prop_flat_map(|(sa, sb)| {
        let full = broadcast_shape(&sa, &sb);
        (input(sa, Domain::Uniform(-2.0, 2.0)), Just(full))
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.expand(&target), &[x]);
    }

    #[test]
    fn unsqueeze_then_squeeze(((l, x), axis) in shape().prop_flat_map(|s| {
        let rank = s.len();
        (input(s, Domain::Uniform(-2.0, 2.0)), 0..=rank)
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.unsqueeze(axis), std::slice::from_ref(&x));
        assert_gradcheck(|v| l.view(&v[0])?.unsqueeze(axis)?.mul_scalar(2.0)?.squeeze(axis), &[x]);
    }

    #[test]
    fn squeeze_size_one_dim(((l, x), axis) in shape_and_axis().prop_flat_map(|(mut s, axis)| {
        s[axis] = 1;
        (input(s, Domain::Uniform(-2.0, 2.0)), Just(axis))
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.squeeze(axis), &[x]);
    }

    #[test]
    fn cat(parts in shape_and_axis().prop_flat_map(|(s, axis)| {
        prop::collection::vec(1..=3usize, 1..=3).prop_flat_map(move |sizes| {
            let inputs: Vec<_> = sizes.iter().map(|&n| {
                let mut part = s.clone();
                part[axis] = n;
                input(part, Domain::Uniform(-2.0, 2.0))
            }).collect();
            (inputs, Just(axis))
        })
    })) {
        let (parts, axis) = parts;
        let (layouts, tensors): (Vec<Layout>, Vec<Tensor>) = parts.into_iter().unzip();
        assert_gradcheck(|v| {
            let views = layouts.iter().zip(v).map(|(l, x)| l.view(x)).collect::<tensor::Result<Vec<_>>>()?;
            Var::cat(&views.iter().collect::<Vec<_>>(), axis)
        }, &tensors);
    }
}

// ---------------------------------------------------------------------------------------
// select / masked_fill: the condition carries no gradient; each branch gets its share.

/// `(cond, a, b)` shapes that broadcast together, cond values 0/1.
fn select_inputs() -> impl Strategy<Value = (Tensor, (Layout, Tensor), (Layout, Tensor))> {
    (broadcast_pair(), prop::bool::weighted(0.5)).prop_flat_map(|((sa, sb), cond_full)| {
        let full = broadcast_shape(&sa, &sb);
        let cond_shape = if cond_full { full } else { sb.clone() };
        let n = numel(&cond_shape);
        let cond = prop::collection::vec(prop::bool::ANY, n)
            .prop_map(move |bits| tensor(bits.iter().map(|&c| f32::from(u8::from(c))).collect(), &cond_shape));
        (cond, input(sa, Domain::Uniform(-2.0, 2.0)), input(sb, Domain::Uniform(-2.0, 2.0)))
    })
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn select_broadcasts((cond, (la, a), (lb, b)) in select_inputs()) {
        assert_gradcheck(|v| Var::select(&cond, &la.view(&v[0])?, &lb.view(&v[1])?), &[a, b]);
    }

    #[test]
    fn masked_fill((mask, (l, x), value) in shape().prop_flat_map(|s| {
        let n = numel(&s);
        let mask = prop::collection::vec(prop::bool::ANY, n)
            .prop_map({ let s = s.clone(); move |bits| tensor(bits.iter().map(|&c| f32::from(u8::from(c))).collect(), &s) });
        (mask, input(s, Domain::Uniform(-2.0, 2.0)), -5.0f32..5.0)
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.masked_fill(&mask, value), &[x]);
    }
}

// ---------------------------------------------------------------------------------------
// Softmax family, cross-entropy, norms.

/// Cross-entropy inputs: logits `[N, V]` (possibly strided), targets, and the ignore
/// index: out of range (`V`), inside the range (so real class ids get ignored), or none.
fn cross_entropy_inputs() -> impl Strategy<Value = ((Layout, Tensor), Vec<u32>, Option<u32>)> {
    (1..=6usize, 1..=6usize, 0..3u8).prop_flat_map(|(rows, vocab, mode)| {
        let ignore = match mode {
            0 => Some(vocab as u32),
            1 => Some(0),
            _ => None,
        };
        let target = prop_oneof![3 => 0..vocab as u32, 1 => Just(ignore.unwrap_or(0))];
        (input(vec![rows, vocab], Domain::Uniform(-3.0, 3.0)), prop::collection::vec(target, rows), Just(ignore))
    })
}

/// LM-head inputs: `h [N, C]` and `W [V, C]` (each possibly strided), targets, the ignore
/// index (as [`cross_entropy_inputs`]) and a cap on the rows per chunk: none (one chunk), or
/// 1-3 rows, so that N is cut into several chunks, often not a multiple of the cap.
#[allow(clippy::type_complexity)]
fn linear_cross_entropy_inputs(
) -> impl Strategy<Value = ((Layout, Tensor), (Layout, Tensor), Vec<u32>, Option<u32>, Option<usize>)> {
    (1..=7usize, 1..=5usize, 1..=6usize, 0..3u8, prop::option::of(1..=3usize)).prop_flat_map(
        |(rows, width, vocab, mode, chunk)| {
            let ignore = match mode {
                0 => Some(vocab as u32),
                1 => Some(0),
                _ => None,
            };
            let target = prop_oneof![3 => 0..vocab as u32, 1 => Just(ignore.unwrap_or(0))];
            (
                input(vec![rows, width], Domain::Uniform(-2.0, 2.0)),
                input(vec![vocab, width], Domain::Uniform(-1.5, 1.5)),
                prop::collection::vec(target, rows),
                Just(ignore),
                Just(chunk),
            )
        },
    )
}

/// The loss and the gradients of `h` and `W` (in that order) of the fused LM-head loss, or of
/// the composite it replaces (`fused` false), on leaves holding `h` and `w` seen through
/// their layouts, back-propagating `upstream`.
fn lm_head_loss_and_grads(
    fused: bool,
    (lh, h): (&Layout, &Tensor),
    (lw, w): (&Layout, &Tensor),
    (targets, ignore): (&[u32], Option<u32>),
    chunk: Option<usize>,
    upstream: f32,
) -> [Vec<f32>; 3] {
    let (hv, wv) = (Var::parameter(h.clone()), Var::parameter(w.clone()));
    let (hx, wx) = (ok("view", lh.view(&hv)), ok("view", lw.view(&wv)));
    let targets = &token_ids(targets, Device::Cpu);
    let loss = if fused {
        hx.linear_cross_entropy(&wx, targets, ignore, chunk)
    } else {
        hx.linear_cross_entropy_reference(&wx, targets, ignore)
    };
    let loss = ok("loss", loss);
    ok("backward", loss.backward_with(Tensor::scalar(upstream)));
    [loss.value().to_vec(), grad_of("h", &hv), grad_of("W", &wv)]
}

/// The rows of norm inputs: rank 1-3 with last dim `C`.
fn norm_shape() -> impl Strategy<Value = Vec<usize>> {
    (shape_with_rank(0..=2), 1..=6usize).prop_map(|(lead, c)| [lead.as_slice(), &[c]].concat())
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn softmax((l, x) in any_input(Domain::Uniform(-3.0, 3.0))) {
        assert_gradcheck(|v| l.view(&v[0])?.softmax(), &[x]);
    }

    #[test]
    fn log_softmax((l, x) in any_input(Domain::Uniform(-3.0, 3.0))) {
        assert_gradcheck(|v| l.view(&v[0])?.log_softmax(), &[x]);
    }

    #[test]
    fn cross_entropy(((l, x), targets, ignore) in cross_entropy_inputs()) {
        assert_gradcheck(|v| l.view(&v[0])?.cross_entropy(&targets, ignore), &[x]);
    }

    #[test]
    fn linear_cross_entropy(((lh, h), (lw, w), targets, ignore, chunk) in linear_cross_entropy_inputs()) {
        // The numeric side runs under no_grad: the forward without its gradient products.
        let targets = token_ids(&targets, Device::Cpu);
        assert_gradcheck(|v| lh.view(&v[0])?.linear_cross_entropy(&lw.view(&v[1])?, &targets, ignore, chunk), &[h, w]);
    }

    #[test]
    fn linear_cross_entropy_is_the_linear_layer_then_cross_entropy(
        ((lh, h), (lw, w), targets, ignore, chunk) in linear_cross_entropy_inputs(),
        upstream in prop_oneof![Just(1.0f32), 0.1f32..3.0],
    ) {
        // Loss and both gradients of the fused op against the composite it replaces: bit for
        // bit for contiguous inputs in one chunk with an upstream gradient of 1 (the same
        // kernels on the same operands in the same order), to f32 rounding otherwise (dW
        // summed chunk by chunk; the upstream factor applied after the products instead of
        // before; the fused op makes strided inputs contiguous, the composite reads them in place).
        let run = |fused: bool| lm_head_loss_and_grads(fused, (&lh, &h), (&lw, &w), (&targets, ignore), chunk, upstream);
        let (fused, reference) = (run(true), run(false));
        if chunk.is_none() && upstream == 1.0 && !lh.strided && !lw.strided {
            prop_assert_eq!(fused, reference);
        } else {
            for (what, (got, want)) in ["loss", "dh", "dW"].iter().zip(fused.iter().zip(&reference)) {
                assert_close_f32(what, got, want, 1e-5, 1e-6);
            }
        }
    }

    #[test]
    fn softmax_family_on_large_logits(x in shape_with_rank(1..=2).prop_flat_map(|s| tensor_in(s, Domain::Uniform(-15.0, 15.0)))) {
        // Peaked distributions: gradients must stay exact, not overflow or vanish wrongly.
        assert_gradcheck(|v| v[0].softmax(), std::slice::from_ref(&x));
        assert_gradcheck(|v| v[0].log_softmax(), std::slice::from_ref(&x));
        let rows = x.numel() / x.shape()[x.rank() - 1];
        let logits = ok("reshape", x.reshape(&[rows, usize::MAX]));
        assert_gradcheck(|v| v[0].cross_entropy(&vec![0; rows], None), &[logits]);
    }

    #[test]
    fn rms_norm(((l, x), w) in norm_shape().prop_flat_map(|s| {
        let c = s[s.len() - 1];
        (input(s, Domain::AwayFromZero(0.3, 2.0)), tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)))
    })) {
        assert_gradcheck(|v| l.view(&v[0])?.rms_norm(&v[1], 1e-5), &[x, w]);
    }

    #[test]
    fn add_rms_norm(((l, x), (m, d), w) in norm_shape().prop_flat_map(|s| {
        let c = s[s.len() - 1];
        (
            input(s.clone(), Domain::AwayFromZero(0.3, 2.0)),
            input(s, Domain::Uniform(-0.1, 0.1)),
            tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
        )
    })) {
        // Both outputs carry a gradient: the residual stream and its norm.
        assert_gradcheck(
            |v| {
                let (sum, normed) = l.view(&v[0])?.add_rms_norm(&m.view(&v[1])?, &v[2], 1e-5)?;
                sum.mul(&normed)
            },
            &[x, d, w],
        );
    }

    #[test]
    fn layer_norm(((l, x), w, b, affine) in norm_shape().prop_flat_map(|s| {
        let c = s[s.len() - 1];
        (
            input(s, Domain::DistinctRows { cols: c, spacing: 0.4 }),
            tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
            tensor_in(vec![c], Domain::Uniform(-2.0, 2.0)),
            0..4u8,
        )
    })) {
        match affine {
            0 => assert_gradcheck(|v| l.view(&v[0])?.layer_norm(None, None, 1e-5), &[x]),
            1 => assert_gradcheck(|v| l.view(&v[0])?.layer_norm(Some(&v[1]), None, 1e-5), &[x, w]),
            2 => assert_gradcheck(|v| l.view(&v[0])?.layer_norm(None, Some(&v[1]), 1e-5), &[x, b]),
            _ => assert_gradcheck(|v| l.view(&v[0])?.layer_norm(Some(&v[1]), Some(&v[2]), 1e-5), &[x, w, b]),
        };
    }
}

// ---------------------------------------------------------------------------------------
// Transformer ops: rope, embedding, causal attention.

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn rope(((l, x), theta, pos_offset) in (1..=2usize, 1..=4usize, 1..=2usize, 1..=4usize).prop_flat_map(|(b, t, h, half)| (
        input(vec![b, t, h, 2 * half], Domain::Uniform(-2.0, 2.0)),
        prop_oneof![Just(10_000.0f32), Just(10.0f32)],
        0..=12usize,
    ))) {
        assert_gradcheck(|v| l.view(&v[0])?.rope(theta, pos_offset), &[x]);
    }

    #[test]
    fn embedding((w, ids, ids_shape) in (1..=4usize, 1..=4usize, shape_with_rank(1..=2)).prop_flat_map(|(vocab, c, ids_shape)| {
        // Up to 25 ids over at most 4 rows: rows repeat, so scatter-add must accumulate.
        let n = numel(&ids_shape);
        (uniform_tensor(vec![vocab, c], -2.0, 2.0), prop::collection::vec(0..vocab as u32, n), Just(ids_shape))
    })) {
        let ids = token_ids(&ids, Device::Cpu);
        assert_gradcheck(|v| v[0].embedding(&ids, &ids_shape), &[w]);
    }

    #[test]
    fn causal_attention(((lq, q), (lk, k), (lv, v), scale) in (1..=2usize, 1..=5usize, 1..=2usize, 1..=8usize)
        .prop_flat_map(|(b, tk, h, d)| (Just((b, tk, h, d)), 1..=tk))
        .prop_flat_map(|((b, tk, h, d), tq)| {
            let domain = Domain::Uniform(-1.5, 1.5);
            (
                input(vec![b, tq, h, d], domain),
                input(vec![b, tk, h, d], domain),
                input(vec![b, tk, h, d], domain),
                Just(1.0 / (d as f32).sqrt()),
            )
        }))
    {
        assert_gradcheck(
            |x| Var::causal_attention(&lq.view(&x[0])?, &lk.view(&x[1])?, &lv.view(&x[2])?, scale),
            &[q, k, v],
        );
    }

    #[test]
    fn rotary_causal_attention(((lq, q), (lk, k), (lv, v), theta) in (1..=2usize, 1..=4usize, 1..=2usize, 1..=3usize)
        .prop_flat_map(|(b, t, h, half)| {
            let (shape, domain) = (vec![b, t, h, 2 * half], Domain::Uniform(-1.5, 1.5));
            (
                input(shape.clone(), domain),
                input(shape.clone(), domain),
                input(shape, domain),
                prop_oneof![Just(10_000.0f32), Just(10.0f32)],
            )
        }))
    {
        assert_gradcheck(
            |x| Var::rotary_causal_attention(&lq.view(&x[0])?, &lk.view(&x[1])?, &lv.view(&x[2])?, 0.6, theta),
            &[q, k, v],
        );
    }

    #[test]
    fn rotary_causal_attention_of_packed_qkv(((lqkv, qkv), heads, theta) in (1..=2usize, 1..=4usize, 1..=2usize, 1..=3usize)
        .prop_flat_map(|(b, t, h, half)| {
            (
                input(vec![b, t, 3 * h * 2 * half], Domain::Uniform(-1.5, 1.5)),
                Just(h),
                prop_oneof![Just(10_000.0f32), Just(10.0f32)],
            )
        }))
    {
        assert_gradcheck(|x| Var::rotary_causal_attention_packed(&lqkv.view(&x[0])?, heads, 0.6, theta), &[qkv]);
    }

    #[test]
    fn fused_gated_rotary_attention(
        seed in any::<u64>(), b in 1..=2usize, t in 1..=3usize, heads in 1..=2usize, half in 1..=2usize,
        ranks in (1..=2usize, 1..=2usize), silu in any::<bool>(),
    ) {
        let inputs = gated_qkv_inputs(seed, [b, t, 3], heads * 2 * half, ranks);
        let phi = if silu { Unary::Silu } else { Unary::Sigmoid };
        assert_gradcheck(|x| gated_rotary_attention(x, phi, heads), &inputs);
    }

    #[test]
    fn fused_gated_swiglu(
        seed in any::<u64>(), rows in 1..=3usize, d_in in 1..=3usize, width in 1..=3usize,
        ranks in (1..=2usize, 1..=2usize), silu in any::<bool>(),
    ) {
        let mut inputs = gated_qkv_inputs(seed, [1, rows, d_in], width, ranks);
        inputs.truncate(23);  // x, then gate's and up's eleven
        let phi = if silu { Unary::Silu } else { Unary::Sigmoid };
        assert_gradcheck(|x| x[0].fused_gated_swiglu(&[gated_projection(&x[1..12]), gated_projection(&x[12..23])], phi), &inputs);
    }

    #[test]
    fn fused_gated_add_rms_norm(
        seed in any::<u64>(), rows in 1..=3usize, d_in in 1..=3usize, width in 1..=4usize,
        ranks in (1..=2usize, 1..=2usize), silu in any::<bool>(),
    ) {
        let mut inputs = gated_qkv_inputs(seed, [1, rows, d_in], width, ranks);
        inputs.truncate(12);  // x, then one projection's eleven
        inputs.push(seeded(&[1, rows, width], -1.5, 1.5, seed.wrapping_add(7)));  // the stream
        inputs.push(seeded(&[width], 0.5, 1.5, seed.wrapping_add(8)));  // the norm's weight
        let phi = if silu { Unary::Silu } else { Unary::Sigmoid };
        assert_gradcheck(|x| gated_add_rms_norm(x, phi), &inputs);
    }

    #[test]
    fn causal_attention_peaked_scores(seed in any::<u64>(), tq in 1..=4usize) {
        // scale 1 and |q·k| up to ~16: nearly one-hot attention rows.
        let q = seeded(&[1, tq, 2, 4], -2.0, 2.0, seed);
        let [k, v] = [1, 2].map(|i| seeded(&[1, 4, 2, 4], -2.0, 2.0, seed.wrapping_add(i)));
        assert_gradcheck(|x| Var::causal_attention(&x[0], &x[1], &x[2], 1.0), &[q, k, v]);
    }

    #[test]
    fn causal_attention_square_multi_head(seed in any::<u64>(), d in 1..=8usize) {
        // Tq = Tk, several heads and batches, scale ≠ 1/√D.
        let [q, k, v] = [0, 1, 2].map(|i| seeded(&[2, 4, 3, d], -1.5, 1.5, seed.wrapping_add(i)));
        assert_gradcheck(|x| Var::causal_attention(&x[0], &x[1], &x[2], 0.7), &[q, k, v]);
    }
}

/// The fused op is the composition it replaces, bit for bit: forward and every gradient.
#[test]
fn rotary_causal_attention_is_rope_then_attention_exactly() {
    let [q, k, v] = [0, 1, 2].map(|i| seeded(&[2, 5, 3, 8], -1.5, 1.5, 90 + i));
    let run = |fused: bool| {
        let [q, k, v] = [&q, &k, &v].map(|t| Var::parameter(t.clone()));
        let out = if fused {
            Var::rotary_causal_attention(&q, &k, &v, 0.4, 10_000.0)
        } else {
            q.rope(10_000.0, 0).and_then(|qr| Var::causal_attention(&qr, &k.rope(10_000.0, 0)?, &v, 0.4))
        }
        .unwrap();
        out.mul(&out).unwrap().sum_all().unwrap().backward().unwrap();
        let grads = [&q, &k, &v].map(|x| x.grad().unwrap().to_vec());
        (out.value().to_vec(), grads)
    };
    assert_eq!(run(true), run(false));
}

/// Attention of the packed QKV rows is the op on q, k and v cut out of them, bit for bit:
/// forward and the gradient of the packed rows.
#[test]
fn rotary_causal_attention_of_packed_qkv_is_the_op_on_its_parts_exactly() {
    let (b, t, h, d) = (2, 5, 3, 8);
    let qkv = seeded(&[b, t, 3 * h * d], -1.5, 1.5, 93);
    let run = |packed: bool| {
        let qkv = Var::parameter(qkv.clone());
        let out = if packed {
            Var::rotary_causal_attention_packed(&qkv, h, 0.4, 10_000.0)
        } else {
            let part = |i: usize| qkv.narrow(2, i * h * d, h * d)?.reshape(&[b, t, h, d]);
            Var::rotary_causal_attention(&part(0).unwrap(), &part(1).unwrap(), &part(2).unwrap(), 0.4, 10_000.0)
        }
        .unwrap();
        out.mul(&out).unwrap().sum_all().unwrap().backward().unwrap();
        (out.value().to_vec(), qkv.grad().unwrap().to_vec())
    };
    assert_eq!(run(true), run(false));
}

/// `[x, then q's, k's and v's W, A_c, a_c, B_c, b_c, α_c, A_s, a_s, B_s, b_s, α_s]` of
/// attention's gated q, k and v: `x: [B, T, d_in]`, each projection `d_out` wide, ranks
/// `(r_c, r_s)` (the first 23, x and two projections, serve the FFN's gate and up).
fn gated_qkv_inputs(seed: u64, [b, t, d_in]: [usize; 3], d_out: usize, (rc, rs): (usize, usize)) -> Vec<Tensor> {
    let mut seeds = seed..;
    let mut next = |shape: &[usize], bound: f32| seeded(shape, -bound, bound, seeds.next().unwrap_or(seed));
    let mut inputs = vec![next(&[b, t, d_in], 1.5)];
    for _ in 0..3 {
        let projection = [
            next(&[d_out, d_in], 0.8),
            next(&[rc, d_in], 0.8),
            next(&[rc], 0.3),
            next(&[d_out, rc], 0.8),
            next(&[d_out], 0.3),
            Tensor::from_vec(vec![1.2], &[1]).unwrap(),
            next(&[rs, d_in], 0.8),
            next(&[rs], 0.3),
            next(&[1, rs], 0.8),
            next(&[1], 0.3),
            Tensor::from_vec(vec![0.7], &[1]).unwrap(),
        ];
        inputs.extend(projection);
    }
    inputs
}

/// The projection of `gated_qkv_inputs`' order starting at `p[0]`.
fn gated_projection(p: &[Var]) -> GatedProjectionVars<'_> {
    GatedProjectionVars {
        weight: &p[0],
        channel: [&p[1], &p[2], &p[3], &p[4], &p[5]],
        scalar: [&p[6], &p[7], &p[8], &p[9], &p[10]],
    }
}

/// [`Var::fused_gated_add_rms_norm`] of `x[0]` by the projection `x[1..12]` onto the stream
/// `x[12]` with the norm weight `x[13]`: both results, the sum and the normalised sum, in one
/// scalar's reach (their product).
fn gated_add_rms_norm(x: &[Var], phi: Unary) -> tensor::Result<Var> {
    let (sum, normed) = x[0].fused_gated_add_rms_norm(gated_projection(&x[1..12]), phi, &x[12], &x[13], 1e-5)?;
    sum.mul(&normed)
}

/// `Var::fused_gated_rotary_attention` of `gated_qkv_inputs`' vars, scale 0.6, base 10,000.
fn gated_rotary_attention(x: &[Var], phi: Unary, heads: usize) -> tensor::Result<Var> {
    let projections = [gated_projection(&x[1..12]), gated_projection(&x[12..23]), gated_projection(&x[23..34])];
    x[0].fused_gated_rotary_attention(&projections, phi, heads, 0.6, 10_000.0)
}

/// Attention over gated q, k and v as one op is the fused gated group, then attention over its
/// packed output, bit for bit (the CPU runs those two ops): forward and every gradient.
#[test]
fn fused_gated_rotary_attention_is_the_group_then_attention_exactly() {
    let inputs = gated_qkv_inputs(40, [2, 5, 6], 2 * 4, (3, 2));
    let run = |one_op: bool| {
        let vars: Vec<Var> = inputs.iter().cloned().map(Var::parameter).collect();
        let out = if one_op {
            gated_rotary_attention(&vars, Unary::Silu, 2)
        } else {
            let projections =
                [gated_projection(&vars[1..12]), gated_projection(&vars[12..23]), gated_projection(&vars[23..34])];
            let qkv = vars[0].fused_gated_projections(&projections, Unary::Silu, ProductOutput::F32).unwrap();
            Var::rotary_causal_attention_packed(&qkv, 2, 0.6, 10_000.0)
        }
        .unwrap();
        out.mul(&out).unwrap().sum_all().unwrap().backward().unwrap();
        (out.value().to_vec(), vars.iter().map(|v| v.grad().unwrap().to_vec()).collect::<Vec<_>>())
    };
    assert_eq!(run(true), run(false));
}

/// The FFN's gated gate and up projections and SwiGLU as one op are the fused gated group,
/// then SwiGLU of its halves, bit for bit (the CPU runs those two ops): forward and every
/// gradient.
#[test]
fn fused_gated_swiglu_is_the_group_then_swiglu_exactly() {
    let mut inputs = gated_qkv_inputs(50, [2, 5, 6], 7, (3, 2));
    inputs.truncate(23);
    let run = |one_op: bool| {
        let vars: Vec<Var> = inputs.iter().cloned().map(Var::parameter).collect();
        let projections = [gated_projection(&vars[1..12]), gated_projection(&vars[12..23])];
        let out = if one_op {
            vars[0].fused_gated_swiglu(&projections, Unary::Silu)
        } else {
            vars[0]
                .fused_gated_projections(&projections, Unary::Silu, ProductOutput::F32)
                .and_then(|g| g.swiglu_halves())
        }
        .unwrap();
        out.mul(&out).unwrap().sum_all().unwrap().backward().unwrap();
        (out.value().to_vec(), vars.iter().map(|v| v.grad().unwrap().to_vec()).collect::<Vec<_>>())
    };
    assert_eq!(run(true), run(false));
}

/// A gated output projection and the residual stream's add and RMSNorm as one op
/// (`Var::fused_gated_add_rms_norm`) are the projection, then `Var::add_rms_norm` of the
/// stream and its output, bit for bit (the CPU runs those two ops): both results and every
/// gradient.
#[test]
fn fused_gated_add_rms_norm_is_the_projection_then_the_add_and_norm_exactly() {
    let mut inputs = gated_qkv_inputs(60, [2, 5, 6], 7, (3, 2));
    inputs.truncate(12);
    inputs.push(seeded(&[2, 5, 7], -1.5, 1.5, 61));
    inputs.push(seeded(&[7], 0.5, 1.5, 62));
    let run = |one_op: bool| {
        let vars: Vec<Var> = inputs.iter().cloned().map(Var::parameter).collect();
        let (sum, normed) = if one_op {
            vars[0].fused_gated_add_rms_norm(gated_projection(&vars[1..12]), Unary::Silu, &vars[12], &vars[13], 1e-5)
        } else {
            let projections = [gated_projection(&vars[1..12])];
            let delta = vars[0].fused_gated_projections(&projections, Unary::Silu, ProductOutput::Bf16).unwrap();
            vars[12].add_rms_norm(&delta, &vars[13], 1e-5)
        }
        .unwrap();
        let out = sum.mul(&normed).unwrap();
        out.sum_all().unwrap().backward().unwrap();
        let results = [sum.value().to_vec(), normed.value().to_vec()];
        (results, vars.iter().map(|v| v.grad().unwrap().to_vec()).collect::<Vec<_>>())
    };
    assert_eq!(run(true), run(false));
}

/// The fused LM-head loss is the composite it replaces, bit for bit, in one chunk of
/// contiguous inputs with an upstream gradient of 1 (a training step's case): loss, dh, dW.
#[test]
fn linear_cross_entropy_is_the_linear_layer_then_cross_entropy_exactly() {
    let (rows, width, vocab) = (11, 16, 37);
    let (h, w) = (seeded(&[rows, width], -2.0, 2.0, 12), seeded(&[vocab, width], -1.0, 1.0, 13));
    let (lh, lw) =
        (Layout { shape: vec![rows, width], strided: false }, Layout { shape: vec![vocab, width], strided: false });
    let mut targets: Vec<u32> = (0..rows).map(|r| (r * 17 % vocab) as u32).collect();
    targets[3] = 5;
    for ignore in [None, Some(5)] {
        let run = |fused: bool| lm_head_loss_and_grads(fused, (&lh, &h), (&lw, &w), (&targets, ignore), None, 1.0);
        assert_eq!(run(true), run(false), "ignore index {ignore:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Gradient accumulation, repeated backward, no_grad, detach.

fn param(data: &[f32]) -> Var {
    Var::parameter(tensor(data.to_vec(), &[data.len()]))
}

#[test]
fn reuse_in_one_op_doubles_the_gradient() {
    let x = param(&[1.5, -2.0, 0.25]);
    ok("backward", ok("x·x", x.mul(&x)).sum_all().and_then(|y| y.backward()));
    assert_close_f32("d(x·x)/dx", &grad_of("x", &x), &[3.0, -4.0, 0.5], 1e-6, 0.0);
}

#[test]
fn reuse_in_two_branches_sums_the_gradients() {
    let x = param(&[0.5, -1.0, 2.0]);
    let y = ok("branches", x.exp().and_then(|e| e.add(&x.mul_scalar(3.0)?)).and_then(|y| y.sum_all()));
    ok("backward", y.backward());
    let expected: Vec<f32> = [0.5f32, -1.0, 2.0].iter().map(|v| v.exp() + 3.0).collect();
    assert_close_f32("d(eˣ + 3x)/dx", &grad_of("x", &x), &expected, 1e-6, 0.0);
}

#[test]
fn broadcast_operand_gradient_sums_over_the_broadcast_rows() {
    let bias = param(&[1.0, 2.0, 3.0]);
    let x = Var::constant(seeded(&[4, 3], -1.0, 1.0, 9));
    ok("backward", x.add(&bias).and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("bias", &bias), vec![4.0, 4.0, 4.0]);
    assert!(x.grad().is_none(), "a constant received a gradient");
}

#[test]
fn gradients_accumulate_across_backward_calls_until_zero_grad() {
    let x = param(&[1.0, -3.0]);
    let y = ok("y", x.square().and_then(|s| s.sum_all()));
    ok("first backward", y.backward());
    assert_eq!(grad_of("x", &x), vec![2.0, -6.0]);
    ok("second backward", y.backward());
    assert_eq!(grad_of("x", &x), vec![4.0, -12.0], "the second backward must add, not overwrite");
    x.zero_grad();
    assert!(x.grad().is_none(), "zero_grad left a gradient");
    ok("third backward", y.backward());
    assert_eq!(grad_of("x", &x), vec![2.0, -6.0]);
}

#[test]
fn backward_with_seed_scales_the_gradient() {
    let x = param(&[1.0, 2.0, 3.0]);
    let y = ok("y", x.mul_scalar(2.0));
    ok("backward_with", y.backward_with(tensor(vec![1.0, 0.5, -1.0], &[3])));
    assert_eq!(grad_of("x", &x), vec![2.0, 1.0, -2.0]);
    assert!(y.backward().is_err(), "backward() from a non-scalar must be an error");
    assert!(y.backward_with(Tensor::ones(&[4])).is_err(), "a seed of the wrong shape must be an error");
}

#[test]
fn no_grad_builds_no_graph() {
    let x = param(&[1.0, 2.0]);
    assert!(is_grad_enabled());
    let y = no_grad(|| {
        assert!(!is_grad_enabled());
        ok("y", x.mul(&x).and_then(|y| y.exp()).and_then(|y| y.sum_all()))
    });
    assert!(is_grad_enabled(), "no_grad did not restore grad mode");
    assert!(!y.requires_grad(), "an op inside no_grad produced a graph node");
    ok("backward of a constant", y.backward());
    assert!(x.grad().is_none(), "backward through a no_grad result reached the leaf");
    let caught = std::panic::catch_unwind(|| no_grad(|| panic!("inside no_grad")));
    assert!(caught.is_err());
    assert!(is_grad_enabled(), "a panic inside no_grad left grad mode off");
}

#[test]
fn detach_cuts_one_path_only() {
    let x = param(&[1.5, -0.5]);
    ok("backward", x.mul(&x.detach()).and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("x", &x), vec![1.5, -0.5], "d(x·stop(x))/dx = stop(x)");
    assert!(!x.detach().requires_grad());
}

#[test]
fn constants_only_graph_needs_no_gradient() {
    let a = Var::constant(Tensor::ones(&[2]));
    let y = ok("y", a.add(&a));
    assert!(!y.requires_grad());
}

#[test]
fn documented_conventions_at_kinks_and_ties() {
    // relu'(0) = abs'(0) = 0 (PyTorch).
    let x = param(&[0.0, 0.0]);
    ok("relu", x.relu().and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("relu x", &x), vec![0.0, 0.0]);
    let x = param(&[0.0]);
    ok("abs", x.abs().and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("abs x", &x), vec![0.0]);

    // maximum/minimum split ties evenly: max(x, x) passes the whole gradient to x.
    let x = param(&[1.0, -2.0]);
    ok("max(x, x)", x.maximum(&x).and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("x", &x), vec![1.0, 1.0]);
    let (a, b) = (param(&[1.0, 3.0]), param(&[1.0, 2.0]));
    ok("min(a, b)", a.minimum(&b).and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("a", &a), vec![0.5, 0.0]);
    assert_eq!(grad_of("b", &b), vec![0.5, 1.0]);

    // max_axis sends the gradient to the first maximum only.
    let x = Var::parameter(tensor(vec![2.0, 5.0, 5.0, 1.0, 7.0, 7.0], &[2, 3]));
    ok("max_axis", x.max_axis(1, false).and_then(|y| y.sum_all()).and_then(|y| y.backward()));
    assert_eq!(grad_of("x", &x), vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0]);
}

#[test]
fn cross_entropy_with_every_row_ignored_has_zero_loss_and_gradient() {
    let logits = Var::parameter(seeded(&[3, 4], -1.0, 1.0, 5));
    let loss = ok("cross_entropy", logits.cross_entropy(&[7, 7, 7], Some(7)));
    assert_eq!(ok("item", loss.value().item()), 0.0);
    ok("backward", loss.backward());
    let g = logits.grad().map(|g| g.to_vec()).unwrap_or_default();
    assert!(g.iter().all(|&v| v == 0.0), "gradient {g:?}");
}

#[test]
fn linear_cross_entropy_computes_only_the_gradients_asked_for() {
    let (h, w) = (seeded(&[5, 3], -1.0, 1.0, 6), seeded(&[4, 3], -1.0, 1.0, 7));
    let targets = token_ids(&[3, 0, 2, 2, 1], Device::Cpu);
    let full = |hv: &Var, wv: &Var| ok("loss", hv.linear_cross_entropy(wv, &targets, None, Some(2)));
    let (hv, wv) = (Var::parameter(h.clone()), Var::parameter(w.clone()));
    let loss = full(&hv, &wv);
    ok("backward", loss.backward());
    // Evaluation: the same loss, and no graph.
    let eval = no_grad(|| full(&hv, &wv));
    assert_eq!(eval.value().to_vec(), loss.value().to_vec());
    assert!(!eval.requires_grad(), "a loss under no_grad is a graph node");
    // A constant h (only the head trains): W's gradient as before, none for h.
    let (hc, wp) = (Var::constant(h), Var::parameter(w));
    ok("backward", full(&hc, &wp).backward());
    assert_eq!(grad_of("W", &wp), grad_of("W", &wv));
    assert!(hc.grad().is_none(), "a constant received a gradient");
}

#[test]
fn linear_cross_entropy_with_every_row_ignored_has_zero_loss_and_gradients() {
    let (h, w) = (Var::parameter(seeded(&[3, 2], -1.0, 1.0, 8)), Var::parameter(seeded(&[4, 2], -1.0, 1.0, 9)));
    let loss =
        ok("linear_cross_entropy", h.linear_cross_entropy(&w, &token_ids(&[7, 7, 7], Device::Cpu), Some(7), Some(2)));
    assert_eq!(ok("item", loss.value().item()), 0.0);
    ok("backward", loss.backward());
    for (name, v) in [("h", &h), ("W", &w)] {
        assert!(grad_of(name, v).iter().all(|&g| g == 0.0), "{name}: {:?}", grad_of(name, v));
    }
    // A target out of range is an error, as in cross_entropy.
    let err = h.linear_cross_entropy(&w, &token_ids(&[0, 4, 1], Device::Cpu), None, None).expect_err("target 4");
    assert!(matches!(err, tensor::Error::IndexOutOfRange { index: 4, size: 4, .. }), "{err}");
    // The ignore index may be ≥ V; another target ≥ V beside it is still an error.
    let targets = token_ids(&[9, 0, 9], Device::Cpu);
    ok("ignored 9 of 4 classes", h.linear_cross_entropy(&w, &targets, Some(9), None));
    let err = h.linear_cross_entropy(&w, &targets, Some(0), None).expect_err("target 9 not ignored");
    assert!(matches!(err, tensor::Error::IndexOutOfRange { index: 9, .. }), "{err}");
}

#[test]
fn embedding_gradient_counts_repeated_ids() {
    let w = Var::parameter(seeded(&[3, 2], -1.0, 1.0, 2));
    ok(
        "embedding",
        w.embedding(&token_ids(&[2, 0, 2, 2], Device::Cpu), &[2, 2])
            .and_then(|y| y.sum_all())
            .and_then(|y| y.backward()),
    );
    assert_eq!(grad_of("w", &w), vec![1.0, 1.0, 0.0, 0.0, 3.0, 3.0]);
}

#[test]
fn gradcheck_catches_a_wrong_backward() {
    // The checker itself must fail loudly: y = x² with a backward that forgets the 2.
    let wrong_square = |v: &[Var]| -> tensor::Result<Var> {
        let x = v[0].value();
        let y = x.mul(&x)?;
        Ok(Var::from_op(y, vec![v[0].clone()], move |dy| Ok(vec![dy.mul(&x)?])))
    };
    let failure = autograd::gradcheck(wrong_square, &[seeded(&[3, 2], 0.5, 2.0, 1)])
        .expect_err("a backward off by a factor of 2 must fail the check");
    assert!(failure.to_string().contains("analytic"), "{failure}");
    // And a backward that drops its input is reported as a missing gradient.
    let cut = |v: &[Var]| v[0].detach().exp();
    let failure = autograd::gradcheck(cut, &[seeded(&[2], 0.5, 2.0, 1)]).expect_err("a cut graph must fail the check");
    assert!(failure.to_string().contains("no gradient"), "{failure}");
}
