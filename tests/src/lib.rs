//! Shared helpers for the cross-crate tests: proptest strategies for shapes and values,
//! non-contiguous views, and the assertion helpers every test file uses.
//!
//! The value strategies encode each op's safe input domain, so a failing gradient check
//! points at the op rather than at the finite differences:
//! - [`positive`]: bounded away from 0 (log, sqrt, rsqrt, powf, div denominators);
//! - [`away_from_zero`]: both signs, but never near the kink of relu/abs at 0;
//! - [`interleaved`]: two lattices offset by a quarter step, so `maximum(a, b)` never
//!   meets a tie within a finite-difference step;
//! - [`distinct`]: a shuffled lattice, so `max_axis` has a unique winner.
//!
//! Gradient checks go through [`assert_gradcheck`] (`autograd::gradcheck`: the toolkit's
//! extrapolated central differences, its f32 tolerance row); forward checks through
//! [`assert_close`] against f64 references.

use std::ops::RangeInclusive;

use ::gradcheck::Tolerance;
use autograd::{gradcheck, GradcheckReport, Var};
use proptest::prelude::*;
use tensor::{Device, Result, Tensor, Tokens};

/// The largest size of one dimension in random shapes.
pub const MAX_DIM: usize = 5;

/// One dimension: size 1 a third of the time (broadcasting and squeeze edge cases),
/// otherwise 1..=[`MAX_DIM`].
pub fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(1usize), 2 => 1..=MAX_DIM]
}

/// A shape whose rank lies in `rank`, each size from [`dim`].
pub fn shape_with_rank(rank: RangeInclusive<usize>) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim(), rank)
}

/// A shape of rank 1-4 with sizes 1..=5, size-1 dimensions included on purpose.
pub fn shape() -> impl Strategy<Value = Vec<usize>> {
    shape_with_rank(1..=4)
}

/// A shape and a valid axis of it.
pub fn shape_and_axis() -> impl Strategy<Value = (Vec<usize>, usize)> {
    shape().prop_flat_map(|s| {
        let rank = s.len();
        (Just(s), 0..rank)
    })
}

/// Two shapes that broadcast together (NumPy rules): both derive from one full shape,
/// each with some dimensions set to 1, and one of them (either side) may lose leading
/// dimensions, down to rank 0.
pub fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    broadcast_pair_from(shape())
}

/// [`broadcast_pair`] derived from full shapes drawn from `full`.
pub fn broadcast_pair_from(full: impl Strategy<Value = Vec<usize>>) -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    full.prop_flat_map(|full| {
        let rank = full.len();
        let ones = || prop::collection::vec(prop::bool::weighted(0.3), rank);
        (Just(full), ones(), ones(), 0..=rank, any::<bool>())
    })
    .prop_map(|(full, ones_a, ones_b, drop, swap)| {
        let squash = |dims: &[usize], ones: &[bool]| -> Vec<usize> {
            dims.iter().zip(ones).map(|(&d, &one)| if one { 1 } else { d }).collect()
        };
        let a = squash(&full, &ones_a);
        let b = squash(&full[drop..], &ones_b[drop..]);
        if swap {
            (b, a)
        } else {
            (a, b)
        }
    })
}

/// The shape two operands broadcast to (test-side reimplementation of the rule).
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| if i < rank - s.len() { 1 } else { s[i - (rank - s.len())] };
    (0..rank).map(|i| at(a, i).max(at(b, i))).collect()
}

/// Number of elements of `shape`.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `n` values uniform in `[lo, hi]`.
pub fn values(n: usize, lo: f32, hi: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(lo..=hi, n)
}

/// `n` values in `[lo, hi]` (0 < lo): log, sqrt, rsqrt and powf inputs, divisors.
pub fn positive(n: usize, lo: f32, hi: f32) -> impl Strategy<Value = Vec<f32>> {
    assert!(lo > 0.0, "positive: lower bound must exceed 0");
    values(n, lo, hi)
}

/// `n` values with `lo ≤ |x| ≤ hi` and random sign: relu/abs inputs stay off the kink at
/// 0, and divisors of either sign stay off 0.
pub fn away_from_zero(n: usize, lo: f32, hi: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((lo..=hi, any::<bool>()).prop_map(|(v, neg)| if neg { -v } else { v }), n)
}

/// `n` values on the lattice `0.5·k + offset` (k in −4..=4) jittered by ±0.05. Two such
/// vectors with offsets 0.1 and 0.35 differ by at least 0.15 everywhere, whatever the
/// broadcasting: `maximum`/`minimum` never tie within a finite-difference step.
pub fn interleaved(n: usize, offset: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((-4i32..=4, -0.05f32..=0.05).prop_map(move |(k, j)| 0.5 * k as f32 + offset + j), n)
}

/// `n` pairwise distinct values `spacing` apart (a shuffled lattice centred on 0), for
/// `max_axis` (unique argmax) and norms (no constant rows).
pub fn distinct(n: usize, spacing: f32) -> impl Strategy<Value = Vec<f32>> {
    Just((0..n).collect::<Vec<usize>>())
        .prop_shuffle()
        .prop_map(move |perm| perm.into_iter().map(|i| (i as f32 - (n as f32 - 1.0) / 2.0) * spacing).collect())
}

/// A tensor of `shape` with values from `strategy(numel)`.
pub fn tensor_from<S: Strategy<Value = Vec<f32>>>(
    shape: Vec<usize>,
    strategy: impl Fn(usize) -> S,
) -> impl Strategy<Value = Tensor> {
    strategy(numel(&shape)).prop_map(move |data| tensor(data, &shape))
}

/// A tensor of `shape` with values uniform in `[lo, hi]`.
pub fn uniform_tensor(shape: Vec<usize>, lo: f32, hi: f32) -> impl Strategy<Value = Tensor> {
    tensor_from(shape, move |n| values(n, lo, hi))
}

/// `Tensor::from_vec` that panics with the shape on a length mismatch (test inputs only).
pub fn tensor(data: Vec<f32>, shape: &[usize]) -> Tensor {
    let len = data.len();
    Tensor::from_vec(data, shape).unwrap_or_else(|e| panic!("test tensor of {len} values as {shape:?}: {e}"))
}

/// A seeded random tensor (for the non-proptest tests).
pub fn seeded(shape: &[usize], lo: f32, hi: f32, seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, lo, hi, &mut tensor::Rng::new(seed))
}

/// The proptest configuration of the gradient and forward checks: few cases per test
/// (each gradient check runs two forwards per input element), shrinking kept short.
/// `PROPTEST_CASES` in the environment overrides `cases` (for long bug hunts).
pub fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    ProptestConfig { cases, max_shrink_iters: 256, ..ProptestConfig::default() }
}

/// Where an op's inputs may be drawn from (see the module docs for why each exists).
#[derive(Clone, Copy, Debug)]
pub enum Domain {
    /// Uniform in `[lo, hi]`.
    Uniform(f32, f32),
    /// Uniform in `[lo, hi]` with `0 < lo`.
    Positive(f32, f32),
    /// `lo ≤ |x| ≤ hi`, random sign.
    AwayFromZero(f32, f32),
    /// The jittered half-integer lattice shifted by the offset ([`interleaved`]).
    Interleaved(f32),
    /// Pairwise distinct, this far apart ([`distinct`]).
    Distinct(f32),
    /// Rows of `cols` values, each a shuffled lattice `spacing` apart centred on 0 with
    /// jitter below `spacing/8`: every row of ≥ 2 values has a variance bounded away from
    /// 0 and small magnitudes (LayerNorm inputs).
    DistinctRows {
        /// Values per row.
        cols: usize,
        /// Distance between neighbouring lattice points.
        spacing: f32,
    },
}

impl Domain {
    /// `n` values from this domain.
    pub fn values(self, n: usize) -> BoxedStrategy<Vec<f32>> {
        match self {
            Domain::Uniform(lo, hi) => values(n, lo, hi).boxed(),
            Domain::Positive(lo, hi) => positive(n, lo, hi).boxed(),
            Domain::AwayFromZero(lo, hi) => away_from_zero(n, lo, hi).boxed(),
            Domain::Interleaved(offset) => interleaved(n, offset).boxed(),
            Domain::Distinct(spacing) => distinct(n, spacing).boxed(),
            Domain::DistinctRows { cols, spacing } => {
                assert!(cols > 0 && n.is_multiple_of(cols), "DistinctRows: {n} values are not rows of {cols}");
                let row = (distinct(cols, spacing), values(cols, -spacing / 8.0, spacing / 8.0))
                    .prop_map(|(lattice, jitter)| lattice.iter().zip(jitter).map(|(a, b)| a + b).collect::<Vec<f32>>());
                prop::collection::vec(row, n / cols).prop_map(|rows| rows.concat()).boxed()
            }
        }
    }
}

/// A tensor of `shape` with values from `domain`.
pub fn tensor_in(shape: Vec<usize>, domain: Domain) -> BoxedStrategy<Tensor> {
    domain.values(numel(&shape)).prop_map(move |data| tensor(data, &shape)).boxed()
}

/// How a gradient-check input reaches the op: either the input itself (contiguous), or
/// a non-contiguous view of it ([`strided_var`]), in which case the stored input has
/// [`strided_storage_shape`].
#[derive(Clone, Debug)]
pub struct Layout {
    /// The shape the op sees.
    pub shape: Vec<usize>,
    /// True when the op sees a narrowed, transposed view.
    pub strided: bool,
}

impl Layout {
    /// The shape of the stored gradient-check input.
    pub fn stored_shape(&self) -> Vec<usize> {
        if self.strided {
            strided_storage_shape(&self.shape)
        } else {
            self.shape.clone()
        }
    }

    /// The stored input whose [`Layout::view`] has the values of `t` (padding: 0.5).
    pub fn store(&self, t: &Tensor) -> Tensor {
        assert_eq!(t.shape(), self.shape.as_slice(), "Layout::store: shape");
        let rank = self.shape.len();
        if !self.strided || rank == 0 {
            return t.clone();
        }
        let swapped = if rank >= 2 { t.transpose(rank - 2, rank - 1).expect("transpose") } else { t.clone() };
        let row = swapped.shape()[rank - 1];
        let values = swapped.to_vec();
        let mut data = Vec::new();
        for chunk in values.chunks(row.max(1)) {
            data.push(0.5);
            data.extend_from_slice(chunk);
        }
        tensor(data, &strided_storage_shape(&self.shape))
    }

    /// What the op is applied to, built from the stored input inside the checked function.
    pub fn view(&self, x: &Var) -> Result<Var> {
        if self.strided {
            strided_var(x, &self.shape)
        } else {
            Ok(x.clone())
        }
    }
}

/// A gradient-check input whose *viewed* values (what the op sees) come from `domain`,
/// strided half of the time: the stored tensor is then built with [`Layout::store`].
pub fn input(shape: Vec<usize>, domain: Domain) -> BoxedStrategy<(Layout, Tensor)> {
    (any::<bool>(), tensor_in(shape.clone(), domain))
        .prop_map(move |(strided, t)| {
            let layout = Layout { shape: shape.clone(), strided };
            let stored = layout.store(&t);
            (layout, stored)
        })
        .boxed()
}

// ---------------------------------------------------------------------------------------
// Non-contiguous inputs.

/// A view equal to `t` (same shape and values) whose strides are not row-major: the
/// values sit interleaved with NaN in a buffer of twice the size (stride 2 on every
/// dimension), and for rank ≥ 2 the last two dimensions are stored swapped and
/// transposed back. An op that reads the storage as if it were contiguous picks up a
/// NaN or a wrong element.
pub fn non_contiguous(t: &Tensor) -> Tensor {
    let rank = t.rank();
    let stored = if rank >= 2 {
        t.transpose(rank - 2, rank - 1).expect("transpose").contiguous().expect("copy")
    } else {
        t.clone()
    };
    let mut padded_shape = stored.shape().to_vec();
    padded_shape.push(2);
    let data: Vec<f32> = stored.to_vec().into_iter().flat_map(|v| [f32::NAN, v]).collect();
    let view = tensor(data, &padded_shape).narrow(rank, 1, 1).expect("narrow").squeeze(rank).expect("squeeze");
    let view = if rank >= 2 { view.transpose(rank - 2, rank - 1).expect("transpose") } else { view };
    assert_eq!(view.shape(), t.shape(), "non_contiguous: shape changed");
    if t.numel() > 1 {
        assert!(!view.is_contiguous(), "non_contiguous: {:?} came out contiguous", t.shape());
    }
    view
}

/// The stored shape behind [`strided_var`]: the last two dimensions swapped (rank ≥ 2),
/// then the last one grown by one element of padding.
pub fn strided_storage_shape(shape: &[usize]) -> Vec<usize> {
    let mut stored = shape.to_vec();
    let rank = stored.len();
    if rank >= 2 {
        stored.swap(rank - 2, rank - 1);
    }
    if let Some(last) = stored.last_mut() {
        *last += 1;
    }
    stored
}

/// Inside a gradient check: turns an input of shape `strided_storage_shape(shape)` into a
/// differentiable non-contiguous view of `shape` (narrow past the padding, then transpose
/// back), so the op under test reads permuted, offset strides.
pub fn strided_var(x: &Var, shape: &[usize]) -> Result<Var> {
    let rank = shape.len();
    if rank == 0 {
        return Ok(x.clone());
    }
    let stored = x.shape();
    let narrowed = x.narrow(rank - 1, 1, stored[rank - 1] - 1)?;
    if rank >= 2 {
        narrowed.transpose(rank - 2, rank - 1)
    } else {
        Ok(narrowed)
    }
}

// ---------------------------------------------------------------------------------------
// Assertions.

/// Checks the gradients of `f` at `inputs` with [`autograd::gradcheck`], panicking with the
/// failure (which input, which element, analytic vs numeric) and the input shapes.
pub fn assert_gradcheck(f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor]) -> GradcheckReport {
    match gradcheck(f, inputs) {
        Ok(report) => report,
        Err(failure) => {
            let shapes: Vec<&[usize]> = inputs.iter().map(Tensor::shape).collect();
            panic!("{failure} (input shapes {shapes:?})")
        }
    }
}

/// Asserts `got` matches `expected` elementwise within `atol + rtol·|expected|`
/// ([`close`](::gradcheck::close)), naming the first bad index. Lengths must agree. A reference
/// beyond f32's range stands for the infinity f32 rounds it to, which `got` must then be.
pub fn assert_close(what: &str, got: &[f32], expected: &[f64], rtol: f64, atol: f64) {
    let expected: Vec<f64> =
        expected.iter().map(|&e| if (e as f32).is_infinite() { f64::from(e as f32) } else { e }).collect();
    ::gradcheck::assert_close(what, got, &expected, Tolerance { atol, rtol });
}

/// [`assert_close`] for two f32 slices.
pub fn assert_close_f32(what: &str, got: &[f32], expected: &[f32], rtol: f64, atol: f64) {
    let expected: Vec<f64> = expected.iter().map(|&e| e as f64).collect();
    assert_close(what, got, &expected, rtol, atol);
}

/// Unwraps a result, panicking with the error's message (names the op and the shapes).
pub fn ok<T>(what: &str, result: Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// `ids` as [`Tokens`] on `device` (what the embedding and the LM head's loss read), or a
/// panic with the error's message.
pub fn token_ids(ids: &[u32], device: Device) -> Tokens {
    ok("Tokens::new", Tokens::new(ids, device))
}

/// The gradient a leaf received, or a panic naming it.
pub fn grad_of(name: &str, v: &Var) -> Vec<f32> {
    v.grad().unwrap_or_else(|| panic!("{name} received no gradient")).to_vec()
}

/// GPU 0, where the `cuda_*` agreement tests run.
#[cfg(feature = "cuda")]
pub const GPU: tensor::Device = tensor::Device::Cuda(0);

/// True (after saying so) when there is no GPU to test on: every CUDA test starts with
/// `if no_gpu() { return; }`, so CI (no GPU) passes them with a message.
#[cfg(feature = "cuda")]
pub fn no_gpu() -> bool {
    if tensor::cuda::is_available() {
        return false;
    }
    assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: no CUDA device");
    eprintln!("skipping: no CUDA device");
    true
}

/// A copy of a host tensor on [`GPU`].
#[cfg(feature = "cuda")]
pub fn gpu(t: &Tensor) -> Tensor {
    ok("to_device", t.to_device(GPU))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_contiguous_views_keep_values_and_break_strides() {
        for shape in [vec![], vec![5], vec![2, 3], vec![2, 1, 3], vec![3, 2, 2, 2]] {
            let t = seeded(&shape, -1.0, 1.0, 3);
            let v = non_contiguous(&t);
            assert_eq!(v.to_vec(), t.to_vec(), "{shape:?}");
        }
    }

    #[test]
    fn strided_var_is_a_view_of_the_stored_input() {
        let shape = [2, 3, 4];
        let stored = strided_storage_shape(&shape);
        assert_eq!(stored, vec![2, 4, 4]);
        let x = Var::constant(seeded(&stored, -1.0, 1.0, 4));
        let v = ok("strided_var", strided_var(&x, &shape));
        assert_eq!(v.shape(), shape.to_vec());
        assert!(!v.value().is_contiguous());
        // Element (i, j, k) of the view is stored at (i, k, j + 1).
        let (s, got) = (x.value().to_vec(), v.value().to_vec());
        for (i, j, k) in [(0, 0, 0), (1, 2, 3), (0, 1, 2)] {
            assert_eq!(got[(i * 3 + j) * 4 + k], s[(i * 4 + k) * 4 + j + 1], "({i}, {j}, {k})");
        }
    }

    #[test]
    fn stored_inputs_view_back_to_their_values() {
        for shape in [vec![], vec![4], vec![2, 3], vec![3, 1, 2]] {
            let t = seeded(&shape, -1.0, 1.0, 6);
            let layout = Layout { shape: shape.clone(), strided: true };
            let stored = layout.store(&t);
            assert_eq!(stored.shape(), strided_storage_shape(&shape).as_slice());
            let view = ok("view", layout.view(&Var::constant(stored)));
            assert_eq!(view.value().to_vec(), t.to_vec(), "{shape:?}");
        }
    }

    #[test]
    fn broadcast_shape_rule() {
        assert_eq!(broadcast_shape(&[2, 1, 3], &[4, 1]), vec![2, 4, 3]);
        assert_eq!(broadcast_shape(&[], &[5]), vec![5]);
    }
}
