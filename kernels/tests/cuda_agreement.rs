//! CPU-vs-CUDA agreement: every CUDA kernel against its CPU counterpart on random inputs,
//! plus the caching allocator's reuse. Run with
//! `cargo test -p kernels --features cuda --release --test cuda_agreement`.
//!
//! Each test first opens the device; without one it prints
//! `skipping: no CUDA device (<reason>)` and returns.
//!
//! Tolerances (|gpu − cpu| ≤ abs + rel·|cpu|, with abs a fraction of the largest |cpu|):
//! elementwise f32 1e-5 relative; reductions, norms, softmax, attention, conv and the f32
//! GEMM paths 1e-4 of the largest value; the bf16 fused projection 1e-4 when its inputs are
//! bf16-representable (only the summation order differs) and 1e-2 from arbitrary f32 inputs.
#![cfg(feature = "cuda")]

use std::sync::OnceLock;

use half::bf16;
use kernels::cpu;
use kernels::cpu::attention::AttentionDims;
use kernels::cpu::binary::Binary;
use kernels::cpu::conv::Conv2dGeometry;
use kernels::cpu::fused_gate::{FusedGateDims, FusedGateGrads, FusedGateParams, GateGrads, GateParams};
use kernels::cpu::matmul::Store;
use kernels::cpu::optim::AdamHyper;
use kernels::cpu::rope::RopeDims;
use kernels::cpu::unary::Unary;
use kernels::cuda::fused_gate::{
    DeviceFusedGateGrads, DeviceFusedGateParams, DeviceGateGrads, DeviceGateParams, GateProducts,
};
use kernels::cuda::{self, CudaDevice, CudaError, DeviceBuffer};

/// The shared device of this test binary, or why there is none.
fn shared_device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Result<CudaDevice, CudaError>> = OnceLock::new();
    match DEVICE.get_or_init(|| CudaDevice::new(0)) {
        Ok(dev) => Some(dev),
        Err(e) => {
            assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: {e}");
            println!("skipping: no CUDA device ({e})");
            None
        }
    }
}

/// Binds the device or returns from the test after printing why it is skipped.
macro_rules! device_or_skip {
    () => {
        match shared_device() {
            Some(dev) => dev,
            None => return,
        }
    };
}

/// A small xorshift generator: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }

    fn vec(&mut self, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(lo, hi)).collect()
    }

    fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n)) as u32
    }
}

/// Asserts `|got − want| ≤ abs_frac·max|want| + rel·|want|` element by element (NaN matches NaN).
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs_frac: f32) {
    let scale = want.iter().filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
    assert_close_to(what, got, want, rel, abs_frac * scale.max(f32::MIN_POSITIVE));
}

/// Asserts `|got − want| ≤ abs + rel·|want|` element by element (NaN matches NaN), for
/// results that cancel: their rounding is relative to the terms summed, not to the result.
fn assert_close_to(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() && g.is_nan() || g == w {
            continue;
        }
        let err = (g - w).abs();
        assert!(err <= abs + rel * w.abs(), "{what}[{i}]: gpu {g} vs cpu {w} (error {err}, bound {abs} + {rel}·|cpu|)");
    }
}

/// Elementwise f32 bound.
fn assert_elementwise(what: &str, got: &[f32], want: &[f32]) {
    assert_close(what, got, want, 1e-5, 1e-6);
}

/// Reduction / accumulation bound.
fn assert_reduced(what: &str, got: &[f32], want: &[f32]) {
    assert_close(what, got, want, 1e-4, 1e-4);
}

/// A gradient buffer with stale contents (NaN): backward kernels overwrite their outputs
/// and never read them (the crate's contract), so any element they skip or read shows.
fn stale(len: usize) -> Vec<f32> {
    vec![f32::NAN; len]
}

fn up(dev: &CudaDevice, host: &[f32]) -> DeviceBuffer<f32> {
    dev.upload(host).expect("upload")
}

fn down(dev: &CudaDevice, buffer: &DeviceBuffer<f32>) -> Vec<f32> {
    dev.download(buffer).expect("download")
}

#[test]
fn every_kernel_family_compiles() {
    let dev = device_or_skip!();
    println!("{dev:?}");
    dev.compile_all().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn caching_allocator_reuses_blocks_across_steps() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => return println!("skipping: no CUDA device ({e})"),
    };
    let sizes = [1000usize, 4096, 123_457, 1 << 20];
    let step = |dev: &CudaDevice| {
        let buffers: Vec<DeviceBuffer<f32>> = sizes.iter().map(|&n| dev.alloc(n).expect("alloc")).collect();
        let tail: DeviceBuffer<bf16> = dev.alloc(777).expect("alloc");
        drop(tail);
        buffers
    };
    drop(step(&dev));
    let first = dev.allocator_stats();
    assert_eq!(first.allocations, sizes.len() as u64 + 1, "{first:?}");
    for _ in 0..3 {
        drop(step(&dev));
    }
    let after = dev.allocator_stats();
    assert_eq!(after.allocations, first.allocations, "a repeated step allocated again: {after:?}");
    assert_eq!(after.reuses, first.reuses + 3 * (sizes.len() as u64 + 1), "{after:?}");
    assert_eq!(after.cached_bytes, after.reserved_bytes, "everything is back in the cache");
    // A size of the same class is served from the cache too.
    let again: DeviceBuffer<f32> = dev.alloc(1001).expect("alloc");
    assert_eq!(dev.allocator_stats().allocations, first.allocations);
    drop(again);
    dev.release_cached_memory();
    let released = dev.allocator_stats();
    assert_eq!((released.reserved_bytes, released.cached_bytes), (0, 0), "{released:?}");
}

#[test]
fn copies_round_trip_and_zero() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(1);
    let host = rng.vec(1003, -3.0, 3.0);
    let buffer = up(dev, &host);
    assert_eq!(down(dev, &buffer), host);
    let halves: Vec<bf16> = host.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(dev.download(&dev.upload(&halves).unwrap()).unwrap(), halves);
    let ids: Vec<u32> = (0..77).map(|i| i * 3).collect();
    assert_eq!(dev.download(&dev.upload(&ids).unwrap()).unwrap(), ids);
    let mut target = dev.zeros::<f32>(10).unwrap();
    assert_eq!(down(dev, &target), vec![0.0; 10]);
    dev.copy_within_device(&buffer, 5, &mut target, 2, 8).unwrap();
    assert_eq!(&down(dev, &target)[2..], &host[5..13]);
    // f32 → bf16 on the device rounds like half::bf16::from_f32, and back is exact.
    let mut converted = dev.alloc::<bf16>(host.len()).unwrap();
    cuda::elementwise::to_bf16(dev, &buffer, &mut converted).unwrap();
    let got = dev.download(&converted).unwrap();
    assert!(got.iter().zip(&halves).all(|(a, b)| a.to_bits() == b.to_bits()), "bf16 rounding differs");
    let mut widened = dev.alloc::<f32>(host.len()).unwrap();
    cuda::elementwise::to_f32(dev, &converted, &mut widened).unwrap();
    assert_eq!(down(dev, &widened), halves.iter().map(|h| h.to_f32()).collect::<Vec<f32>>());
    // Mismatched lengths are errors, not panics.
    assert!(matches!(dev.copy_to_device(&host[..5], &mut target), Err(CudaError::Shape { .. })));
}

const UNARY_OPS: [Unary; 14] = [
    Unary::Neg,
    Unary::Exp,
    Unary::Log,
    Unary::Sqrt,
    Unary::Rsqrt,
    Unary::Abs,
    Unary::Sigmoid,
    Unary::Tanh,
    Unary::Relu,
    Unary::Silu,
    Unary::Gelu,
    Unary::GeluTanh,
    Unary::Powf(2.5),
    Unary::Square,
];

#[test]
fn unary_forward_and_backward_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(2);
    for op in UNARY_OPS {
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
    cuda::elementwise::add_assign(dev, &mut gdst, &gx).unwrap();
    assert_elementwise("axpy + add_assign", &down(dev, &gdst), &dst);
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
fn reductions_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(4);
    for (outer, n, inner) in [(1, 100_000, 1), (37, 513, 1), (3, 5000, 40), (2000, 3, 17), (5, 1, 7)] {
        // Rounded values repeat, so "first maximum" is exercised.
        let x: Vec<f32> = rng.vec(outer * n * inner, -5.0, 5.0).iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let gx = up(dev, &x);
        let mut want = vec![0.0; outer * inner];
        cpu::reduce::sum_axis(&x, outer, n, inner, &mut want);
        let mut out = dev.alloc(outer * inner).unwrap();
        cuda::reduce::sum_axis(dev, &gx, outer, n, inner, &mut out).unwrap();
        assert_reduced(&format!("sum_axis {outer}×{n}×{inner}"), &down(dev, &out), &want);
        let mut argmax = vec![0usize; outer * inner];
        cpu::reduce::max_axis(&x, outer, n, inner, &mut want, &mut argmax);
        let mut garg = dev.alloc::<u32>(outer * inner).unwrap();
        cuda::reduce::max_axis(dev, &gx, outer, n, inner, &mut out, &mut garg).unwrap();
        assert_eq!(down(dev, &out), want, "max_axis values");
        let got: Vec<usize> = dev.download(&garg).unwrap().into_iter().map(|i| i as usize).collect();
        assert_eq!(got, argmax, "max_axis indices {outer}×{n}×{inner}");
        let squares = cuda::reduce::sum_squares(dev, &gx).unwrap();
        let want_squares = cpu::reduce::sum_squares(&x);
        assert!((squares - want_squares).abs() <= 1e-9 * want_squares.max(1.0), "{squares} vs {want_squares}");
    }
    // NaN is the maximum, the first one wins.
    let x = [1.0, f32::NAN, 3.0, f32::NAN];
    let (mut out, mut arg) = (dev.alloc(1).unwrap(), dev.alloc::<u32>(1).unwrap());
    cuda::reduce::max_axis(dev, &up(dev, &x), 1, 4, 1, &mut out, &mut arg).unwrap();
    assert!(down(dev, &out)[0].is_nan());
    assert_eq!(dev.download(&arg).unwrap(), vec![1]);
}

#[test]
fn softmax_and_log_softmax_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(5);
    for (rows, cols) in [(300, 257), (7, 1), (3, 5000), (64, 33)] {
        let x = rng.vec(rows * cols, -20.0, 20.0);
        let dy = rng.vec(rows * cols, -1.0, 1.0);
        let start = stale(rows * cols);
        let (gx, gdy) = (up(dev, &x), up(dev, &dy));
        for log in [false, true] {
            let mut y = vec![0.0; x.len()];
            let mut dx = start.clone();
            let mut gy = dev.alloc(x.len()).unwrap();
            let mut gdx = up(dev, &start);
            if log {
                cpu::softmax::log_softmax_forward(&x, cols, &mut y);
                cpu::softmax::log_softmax_backward(&y, &dy, cols, &mut dx);
                cuda::softmax::log_softmax_forward(dev, &gx, cols, &mut gy).unwrap();
                cuda::softmax::log_softmax_backward(dev, &up(dev, &y), &gdy, cols, &mut gdx).unwrap();
            } else {
                cpu::softmax::softmax_forward(&x, cols, &mut y);
                cpu::softmax::softmax_backward(&y, &dy, cols, &mut dx);
                cuda::softmax::softmax_forward(dev, &gx, cols, &mut gy).unwrap();
                cuda::softmax::softmax_backward(dev, &up(dev, &y), &gdy, cols, &mut gdx).unwrap();
            }
            assert_close(&format!("softmax(log {log}) {rows}×{cols}"), &down(dev, &gy), &y, 1e-5, 1e-6);
            assert_reduced(&format!("softmax backward(log {log}) {rows}×{cols}"), &down(dev, &gdx), &dx);
        }
    }
}

#[test]
fn cross_entropy_agrees_with_ignore_index() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(6);
    for (rows, cols, ignore) in [(64, 5003, None), (300, 37, Some(3u32)), (5, 1, None)] {
        let logits = rng.vec(rows * cols, -8.0, 8.0);
        let targets: Vec<u32> = (0..rows).map(|_| rng.below(cols as u32)).collect();
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let kept = cpu::cross_entropy::cross_entropy_forward(&logits, cols, &targets, ignore, &mut losses, &mut lse);
        let (glogits, gtargets) = (up(dev, &logits), dev.upload(&targets).unwrap());
        let (mut glosses, mut glse) = (dev.alloc(rows).unwrap(), dev.alloc(rows).unwrap());
        let gkept =
            cuda::softmax::cross_entropy_forward(dev, &glogits, cols, &gtargets, ignore, &mut glosses, &mut glse)
                .unwrap();
        assert_eq!(gkept, kept);
        assert_close("cross-entropy losses", &down(dev, &glosses), &losses, 1e-5, 1e-6);
        assert_close("cross-entropy lse", &down(dev, &glse), &lse, 1e-5, 1e-6);
        let start = stale(rows * cols);
        let mut dlogits = start.clone();
        // The GPU reads the mean loss's gradient (0.75) on the device and divides by the count.
        let scale = 0.75 / kept as f32;
        cpu::cross_entropy::cross_entropy_backward(&logits, cols, &targets, ignore, &lse, scale, &mut dlogits);
        let mut gd = up(dev, &start);
        let (upstream, count) = (up(dev, &[0.75]), kept);
        let g_scale = cuda::softmax::MeanLossGrad { upstream: &upstream, count };
        cuda::softmax::cross_entropy_backward(dev, &glogits, cols, &gtargets, ignore, &glse, g_scale, &mut gd).unwrap();
        assert_close("cross-entropy backward", &down(dev, &gd), &dlogits, 1e-5, 1e-6);
    }
    // A target out of range is an error, not a panic.
    let (glogits, bad) = (up(dev, &[0.0, 1.0]), dev.upload(&[2u32]).unwrap());
    let (mut l, mut s) = (dev.alloc(1).unwrap(), dev.alloc(1).unwrap());
    let result = cuda::softmax::cross_entropy_forward(dev, &glogits, 2, &bad, None, &mut l, &mut s);
    assert!(matches!(result, Err(CudaError::Invalid { .. })), "{result:?}");
}

#[test]
fn rms_norm_and_layer_norm_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(7);
    for (rows, cols) in [(2048, 67), (3, 768), (1, 1), (5000, 32)] {
        let (x, w, b, dy) = (
            rng.vec(rows * cols, -2.0, 2.0),
            rng.vec(cols, 0.5, 1.5),
            rng.vec(cols, -1.0, 1.0),
            rng.vec(rows * cols, -1.0, 1.0),
        );
        let (gx, gw, gb, gdy) = (up(dev, &x), up(dev, &w), up(dev, &b), up(dev, &dy));
        // Stale gradient buffers (NaN): both devices must overwrite them.
        let start = stale(rows * cols);
        let wstart = stale(cols);
        // RMSNorm
        let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
        cpu::norm::rms_norm_forward(&x, &w, cols, 1e-5, &mut y, &mut rstd);
        let (mut gy, mut grstd) = (dev.alloc(x.len()).unwrap(), dev.alloc(rows).unwrap());
        cuda::norm::rms_norm_forward(dev, &gx, &gw, cols, 1e-5, &mut gy, &mut grstd).unwrap();
        assert_reduced("rms y", &down(dev, &gy), &y);
        assert_reduced("rms rstd", &down(dev, &grstd), &rstd);
        let (mut dx, mut dw) = (start.clone(), wstart.clone());
        cpu::norm::rms_norm_backward(&x, &w, &rstd, &dy, cols, &mut dx, &mut dw);
        let (mut gdx, mut gdw) = (up(dev, &start), up(dev, &wstart));
        cuda::norm::rms_norm_backward(dev, &gx, &gw, &up(dev, &rstd), &gdy, cols, &mut gdx, &mut gdw).unwrap();
        assert_reduced("rms dx", &down(dev, &gdx), &dx);
        assert_reduced("rms dw", &down(dev, &gdw), &dw);
        // LayerNorm, with and without the affine parameters. Not over one column: there x̂ is
        // 0 up to the rounding of the mean, which rstd = 1/√eps amplifies twice, so dx (= the
        // starting gradient in exact arithmetic) differs between any two summation orders by
        // more than the tolerance (an H100 gave 3.9e-6 on a value of 0.0115).
        for affine in [true, false].into_iter().filter(|_| cols > 1) {
            let (wo, bo) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            let (gwo, gbo) = if affine { (Some(&gw), Some(&gb)) } else { (None, None) };
            let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
            cpu::norm::layer_norm_forward(&x, wo, bo, cols, 1e-5, &mut y, &mut mean, &mut rstd);
            let (mut gy, mut gmean, mut grstd) =
                (dev.alloc(x.len()).unwrap(), dev.alloc(rows).unwrap(), dev.alloc(rows).unwrap());
            cuda::norm::layer_norm_forward(dev, &gx, gwo, gbo, cols, 1e-5, &mut gy, &mut gmean, &mut grstd).unwrap();
            assert_reduced("layer y", &down(dev, &gy), &y);
            assert_reduced("layer mean", &down(dev, &gmean), &mean);
            assert_reduced("layer rstd", &down(dev, &grstd), &rstd);
            let (mut dx, mut dw, mut db) = (start.clone(), wstart.clone(), wstart.clone());
            let (dwo, dbo) = if affine { (Some(&mut dw[..]), Some(&mut db[..])) } else { (None, None) };
            cpu::norm::layer_norm_backward(&x, wo, &mean, &rstd, &dy, cols, &mut dx, dwo, dbo);
            let (mut gdx, mut gdw, mut gdb) = (up(dev, &start), up(dev, &wstart), up(dev, &wstart));
            let (gdwo, gdbo) = if affine { (Some(&mut gdw), Some(&mut gdb)) } else { (None, None) };
            let (gm, gr) = (up(dev, &mean), up(dev, &rstd));
            cuda::norm::layer_norm_backward(dev, &gx, gwo, &gm, &gr, &gdy, cols, &mut gdx, gdwo, gdbo).unwrap();
            assert_reduced("layer dx", &down(dev, &gdx), &dx);
            assert_reduced("layer dw", &down(dev, &gdw), &dw);
            assert_reduced("layer db", &down(dev, &gdb), &db);
        }
    }
    // Shape errors come back before any launch.
    let (gx, gw) = (up(dev, &[1.0; 10]), up(dev, &[1.0; 3]));
    let (mut gy, mut gr) = (dev.alloc(10).unwrap(), dev.alloc(2).unwrap());
    let result = cuda::norm::rms_norm_forward(dev, &gx, &gw, 5, 1e-5, &mut gy, &mut gr);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

#[test]
fn rope_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(8);
    for (batch, seq, heads, head_dim, offset) in [(2, 37, 4, 64, 0), (1, 5, 3, 18, 7), (3, 1, 1, 2, 2)] {
        let (cos, sin) = cpu::rope::rope_table(seq + offset, head_dim, 10000.0);
        let x = rng.vec(batch * seq * heads * head_dim, -2.0, 2.0);
        let (gx, gcos, gsin) = (up(dev, &x), up(dev, &cos), up(dev, &sin));
        let dims = RopeDims { batch, seq, heads, head_dim, pos_offset: offset };
        let mut y = vec![0.0; x.len()];
        cpu::rope::rope_forward(&x, &cos, &sin, &dims, &mut y);
        let mut gy = dev.alloc(x.len()).unwrap();
        cuda::rope::rope_forward(dev, &gx, &gcos, &gsin, &dims, &mut gy).unwrap();
        assert_elementwise("rope forward", &down(dev, &gy), &y);
        let mut dx = stale(x.len());
        cpu::rope::rope_backward(&y, &cos, &sin, &dims, &mut dx);
        let mut gdx = up(dev, &dx);
        cuda::rope::rope_backward(dev, &up(dev, &y), &gcos, &gsin, &dims, &mut gdx).unwrap();
        assert_elementwise("rope backward", &down(dev, &gdx), &dx);
    }
}

#[test]
fn embedding_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(9);
    let (vocab, dim, n) = (1000, 64, 4096);
    let weight = rng.vec(vocab * dim, -1.0, 1.0);
    // Few distinct ids, so rows repeat a lot in the scatter-add.
    let ids: Vec<u32> = (0..n).map(|_| rng.below(97)).collect();
    let (gw, gids) = (up(dev, &weight), dev.upload(&ids).unwrap());
    let mut out = vec![0.0; n * dim];
    cpu::embedding::embedding_forward(&weight, dim, &ids, &mut out);
    let mut gout = dev.alloc(n * dim).unwrap();
    cuda::embedding::embedding_forward(dev, &gw, dim, &gids, &mut gout).unwrap();
    assert_eq!(down(dev, &gout), out, "gather is exact");
    // The backward sums each id's rows in position order, as the CPU does: from zero (as the
    // tensor layer calls it) the two agree bit for bit, and every run gives the same bits.
    let dy = rng.vec(n * dim, -1.0, 1.0);
    let mut dweight = vec![0.0; vocab * dim];
    cpu::embedding::embedding_backward(&ids, &dy, dim, &mut dweight);
    for _ in 0..2 {
        let mut gdw = dev.zeros(vocab * dim).unwrap();
        cuda::embedding::embedding_backward(dev, &ids, &up(dev, &dy), dim, &mut gdw).unwrap();
        assert_eq!(down(dev, &gdw), dweight, "embedding backward is the CPU's, bit for bit");
    }
    // Onto existing values it adds each id's sum once: equal to rounding.
    let mut dweight = weight.clone();
    cpu::embedding::embedding_backward(&ids, &dy, dim, &mut dweight);
    let mut gdw = up(dev, &weight);
    cuda::embedding::embedding_backward(dev, &ids, &up(dev, &dy), dim, &mut gdw).unwrap();
    assert_reduced("embedding backward", &down(dev, &gdw), &dweight);
}

/// One attention problem.
#[derive(Clone, Copy, Debug)]
struct AttentionCase {
    batch: usize,
    q_seq: usize,
    kv_seq: usize,
    heads: usize,
    head_dim: usize,
}

#[test]
fn flash_attention_forward_and_backward_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(10);
    let cases = [
        AttentionCase { batch: 2, q_seq: 70, kv_seq: 70, heads: 3, head_dim: 16 },
        AttentionCase { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 1 },
        // No queries: dk and dv must still be written (zeros).
        AttentionCase { batch: 1, q_seq: 0, kv_seq: 4, heads: 2, head_dim: 8 },
        AttentionCase { batch: 2, q_seq: 5, kv_seq: 133, heads: 2, head_dim: 12 },
        AttentionCase { batch: 3, q_seq: 129, kv_seq: 200, heads: 2, head_dim: 7 },
        AttentionCase { batch: 2, q_seq: 256, kv_seq: 256, heads: 4, head_dim: 64 },
        AttentionCase { batch: 1, q_seq: 100, kv_seq: 100, heads: 2, head_dim: 128 },
    ];
    for c in cases {
        let AttentionCase { batch, q_seq, kv_seq, heads, head_dim } = c;
        let dims = AttentionDims { batch, q_seq, kv_seq, heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
        let q = rng.vec(dims.q_len(), -1.0, 1.0);
        let k = rng.vec(dims.kv_len(), -1.0, 1.0);
        let v = rng.vec(k.len(), -1.0, 1.0);
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; dims.lse_len()]);
        cpu::attention::causal_attention_forward(&q, &k, &v, &dims, &mut out, &mut lse);
        let (gq, gk, gv) = (up(dev, &q), up(dev, &k), up(dev, &v));
        let (mut gout, mut glse) = (dev.alloc(q.len()).unwrap(), dev.alloc(lse.len()).unwrap());
        cuda::attention::causal_attention_forward(dev, &gq, &gk, &gv, &dims, &mut gout, &mut glse).unwrap();
        assert_reduced(&format!("attention out {c:?}"), &down(dev, &gout), &out);
        assert_reduced(&format!("attention lse {c:?}"), &down(dev, &glse), &lse);
        let mut naive = dev.alloc(q.len()).unwrap();
        cuda::attention::causal_attention_naive(dev, &gq, &gk, &gv, &dims, &mut naive).unwrap();
        assert_reduced(&format!("naive attention {c:?}"), &down(dev, &naive), &out);

        let dout = rng.vec(q.len(), -1.0, 1.0);
        let (sq, sk) = (stale(q.len()), stale(k.len()));
        let (mut dq, mut dk, mut dv) = (sq.clone(), sk.clone(), sk.clone());
        cpu::attention::causal_attention_backward(&q, &k, &v, &out, &lse, &dout, &dims, &mut dq, &mut dk, &mut dv);
        let (mut gdq, mut gdk, mut gdv) = (up(dev, &sq), up(dev, &sk), up(dev, &sk));
        cuda::attention::causal_attention_backward(
            dev,
            &gq,
            &gk,
            &gv,
            &up(dev, &out),
            &up(dev, &lse),
            &up(dev, &dout),
            &dims,
            &mut gdq,
            &mut gdk,
            &mut gdv,
        )
        .unwrap();
        assert_reduced(&format!("attention dq {c:?}"), &down(dev, &gdq), &dq);
        assert_reduced(&format!("attention dk {c:?}"), &down(dev, &gdk), &dk);
        assert_reduced(&format!("attention dv {c:?}"), &down(dev, &gdv), &dv);
    }
    // A head dimension past the kernels' limit is refused.
    let big = dev.alloc(256).unwrap();
    let (mut o, mut l) = (dev.alloc(256).unwrap(), dev.alloc(1).unwrap());
    let dims = AttentionDims { batch: 1, q_seq: 1, kv_seq: 1, heads: 1, head_dim: 256, scale: 1.0 };
    let result = cuda::attention::causal_attention_forward(dev, &big, &big, &big, &dims, &mut o, &mut l);
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

#[test]
fn conv2d_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(11);
    let geometry = |batch, in_channels, out_channels, height, width, kernel: usize, stride, padding| Conv2dGeometry {
        batch,
        in_channels,
        out_channels,
        height,
        width,
        kernel_h: kernel,
        kernel_w: kernel,
        stride,
        padding,
    };
    for g in [
        geometry(4, 3, 8, 9, 9, 3, 1, 1),
        geometry(2, 5, 6, 11, 7, 3, 2, 1),
        geometry(3, 16, 32, 8, 8, 1, 1, 0),
        geometry(2, 4, 4, 6, 6, 1, 2, 0),
        geometry(1, 2, 3, 5, 5, 7, 1, 3),
    ] {
        let x = rng.vec(g.batch * g.in_channels * g.height * g.width, -1.0, 1.0);
        let w = rng.vec(g.out_channels * g.in_channels * g.kernel_h * g.kernel_w, -1.0, 1.0);
        let bias = rng.vec(g.out_channels, -1.0, 1.0);
        let y_len = g.batch * g.out_channels * g.out_height() * g.out_width();
        let (gx, gw, gbias) = (up(dev, &x), up(dev, &w), up(dev, &bias));
        for with_bias in [true, false] {
            let b = with_bias.then_some(&bias[..]);
            let mut y = vec![0.0; y_len];
            cpu::conv::conv2d_forward(&g, &x, &w, b, &mut y);
            let mut gy = dev.alloc(y_len).unwrap();
            cuda::conv::conv2d_forward(dev, &g, &gx, &gw, with_bias.then_some(&gbias), &mut gy).unwrap();
            assert_reduced(&format!("conv forward {g:?}"), &down(dev, &gy), &y);
        }
        let dy = rng.vec(y_len, -1.0, 1.0);
        let (sx, sw, sb) = (stale(x.len()), stale(w.len()), stale(bias.len()));
        let (mut dx, mut dw, mut db) = (sx.clone(), sw.clone(), sb.clone());
        cpu::conv::conv2d_backward(&g, &x, &w, &dy, Some(&mut dx), Some(&mut dw), Some(&mut db));
        let (mut gdx, mut gdw, mut gdb) = (up(dev, &sx), up(dev, &sw), up(dev, &sb));
        cuda::conv::conv2d_backward(dev, &g, &gx, &gw, &up(dev, &dy), Some(&mut gdx), Some(&mut gdw), Some(&mut gdb))
            .unwrap();
        assert_reduced(&format!("conv dx {g:?}"), &down(dev, &gdx), &dx);
        assert_reduced(&format!("conv dw {g:?}"), &down(dev, &gdw), &dw);
        assert_reduced(&format!("conv dbias {g:?}"), &down(dev, &gdb), &db);
    }
}

#[test]
fn batch_norm_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(12);
    for (batch, channels, spatial) in [(8, 16, 64), (3, 4, 3001), (2, 3, 1)] {
        let x = rng.vec(batch * channels * spatial, -3.0, 3.0);
        let (w, b) = (rng.vec(channels, 0.5, 1.5), rng.vec(channels, -1.0, 1.0));
        let (rm0, rv0) = (rng.vec(channels, -0.5, 0.5), rng.vec(channels, 0.5, 2.0));
        let (gx, gw, gb) = (up(dev, &x), up(dev, &w), up(dev, &b));
        for affine in [true, false] {
            let (wo, bo) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            let (gwo, gbo) = if affine { (Some(&gw), Some(&gb)) } else { (None, None) };
            let (mut rm, mut rv) = (rm0.clone(), rv0.clone());
            let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; channels], vec![0.0; channels]);
            cpu::batch_norm::batch_norm_train_forward(
                &x, batch, channels, spatial, wo, bo, 1e-5, 0.1, &mut rm, &mut rv, &mut y, &mut mean, &mut rstd,
            );
            let (mut grm, mut grv) = (up(dev, &rm0), up(dev, &rv0));
            let (mut gy, mut gmean, mut grstd) =
                (dev.alloc(x.len()).unwrap(), dev.alloc(channels).unwrap(), dev.alloc(channels).unwrap());
            cuda::batch_norm::batch_norm_train_forward(
                dev, &gx, batch, channels, spatial, gwo, gbo, 1e-5, 0.1, &mut grm, &mut grv, &mut gy, &mut gmean,
                &mut grstd,
            )
            .unwrap();
            assert_reduced("bn y", &down(dev, &gy), &y);
            assert_reduced("bn mean", &down(dev, &gmean), &mean);
            assert_reduced("bn rstd", &down(dev, &grstd), &rstd);
            assert_reduced("bn running mean", &down(dev, &grm), &rm);
            assert_reduced("bn running var", &down(dev, &grv), &rv);

            let mut y_eval = vec![0.0; x.len()];
            cpu::batch_norm::batch_norm_eval_forward(&x, batch, channels, spatial, wo, bo, 1e-5, &rm, &rv, &mut y_eval);
            cuda::batch_norm::batch_norm_eval_forward(
                dev, &gx, batch, channels, spatial, gwo, gbo, 1e-5, &grm, &grv, &mut gy,
            )
            .unwrap();
            assert_reduced("bn eval y", &down(dev, &gy), &y_eval);

            let dy = rng.vec(x.len(), -1.0, 1.0);
            let (sx, sc) = (stale(x.len()), stale(channels));
            let (mut dx, mut dw, mut db) = (sx.clone(), sc.clone(), sc.clone());
            cpu::batch_norm::batch_norm_train_backward(
                &x,
                batch,
                channels,
                spatial,
                wo,
                &mean,
                &rstd,
                &dy,
                &mut dx,
                Some(&mut dw),
                Some(&mut db),
            );
            let (mut gdx, mut gdw, mut gdb) = (up(dev, &sx), up(dev, &sc), up(dev, &sc));
            let (gm, gr) = (up(dev, &mean), up(dev, &rstd));
            cuda::batch_norm::batch_norm_train_backward(
                dev,
                &gx,
                batch,
                channels,
                spatial,
                gwo,
                &gm,
                &gr,
                &up(dev, &dy),
                &mut gdx,
                Some(&mut gdw),
                Some(&mut gdb),
            )
            .unwrap();
            // dx = k·dy + slope·x + offset (k = rstd·w) nearly cancels where a channel holds
            // few values (two values normalise to ±1 whatever x is, so dx is 0 up to eps): its
            // rounding is relative to the terms, and the GPU fuses them into FMAs. An H100 gave
            // an error of 1.2e-7 on a dx of 2.8e-5 with terms near 0.9.
            let gain = |c: usize| rstd[c] * wo.map_or(1.0, |w| w[c]);
            let terms = (0..channels).map(gain).fold(0.0f32, f32::max) * dy.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_close_to("bn dx", &down(dev, &gdx), &dx, 1e-4, 2e-6 * terms);
            assert_reduced("bn dw", &down(dev, &gdw), &dw);
            assert_reduced("bn db", &down(dev, &gdb), &db);
        }
    }
}

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
                .map(|((param, grad), (m, v))| cuda::optim::AdamTensor { param, grad, m, v })
                .collect();
            let update = if decoupled { cuda::optim::adamw_step } else { cuda::optim::adam_step };
            update(dev, &mut tensors, &h).unwrap();
        }
        for (i, n) in lens.iter().enumerate() {
            let what = format!("adam(decoupled {decoupled}) tensor {i} of {n}");
            assert_elementwise(&format!("{what}: p"), &down(dev, &gp[i]), &p[i]);
            assert_elementwise(&format!("{what}: m"), &down(dev, &gm[i]), &m[i]);
            assert_elementwise(&format!("{what}: v"), &down(dev, &gv[i]), &v[i]);
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

#[test]
fn cublas_matmul_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(14);
    let (m, n, k) = (67, 129, 300);
    let a = rng.vec(m * k, -1.0, 1.0);
    let b_t = rng.vec(n * k, -1.0, 1.0); // stored [n, k]: the right operand read transposed
    let start = rng.vec(3 + m * n, -1.0, 1.0);
    let mut want = start.clone();
    let lhs = cpu::matmul::MatRef { data: &a, offset: 0, row_stride: k as isize, col_stride: 1 };
    let rhs = cpu::matmul::MatRef { data: &b_t, offset: 0, row_stride: 1, col_stride: k as isize };
    cpu::matmul::matmul(&mut want, 3, lhs, rhs, m, n, k, Store::Accumulate);
    let (ga, gb) = (up(dev, &a), up(dev, &b_t));
    let mut got = up(dev, &start);
    let glhs = cuda::blas::DeviceMat { buffer: &ga, offset: 0, row_stride: k, col_stride: 1 };
    let grhs = cuda::blas::DeviceMat { buffer: &gb, offset: 0, row_stride: 1, col_stride: k };
    cuda::blas::matmul(dev, &mut got, 3, glhs, grhs, m, n, k, Store::Accumulate).unwrap();
    assert_reduced("matmul", &down(dev, &got), &want);
}

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
    // The same gradients from the GPU, into stale buffers, with products of `precision`.
    let gpu_backward = |products: GateProducts| -> Vec<Vec<f32>> {
        let mut gdx = up(dev, &stale(rows * d_in));
        let mut gdw = up(dev, &stale(d_out * d_in));
        let mut gdc: Vec<DeviceBuffer<f32>> =
            [rc * d_in, rc, d_out * rc, d_out].iter().map(|&l| up(dev, &stale(l))).collect();
        let mut gds: Vec<DeviceBuffer<f32>> = [rs * d_in, rs, rs, 1].iter().map(|&l| up(dev, &stale(l))).collect();
        let (mut gdac, mut gdas) = (up(dev, &[f32::NAN]), up(dev, &[f32::NAN]));
        {
            let [ca, cab, cb, cbb] = &mut gdc[..] else { unreachable!() };
            let [sa, sab, sb, sbb] = &mut gds[..] else { unreachable!() };
            let mut grads = DeviceFusedGateGrads {
                x: &mut gdx,
                weight: &mut gdw,
                channel: DeviceGateGrads { a_weight: ca, a_bias: cab, b_weight: cb, b_bias: cbb, alpha: &mut gdac },
                scalar: DeviceGateGrads { a_weight: sa, a_bias: sab, b_weight: sb, b_bias: sbb, alpha: &mut gdas },
            };
            let gx = up(dev, &case.x);
            let gdout = up(dev, &dout);
            cuda::fused_gate::fused_gate_backward(dev, &dims, &gx, &gp, &gzu, &gdout, products, &mut grads).unwrap();
        }
        let mut got = vec![down(dev, &gdx), down(dev, &gdw)];
        got.extend(gdc.iter().chain(&gds).chain([&gdac, &gdas]).map(|g| down(dev, g)));
        got
    };
    let names = ["dx", "dW", "channel dA", "channel da", "channel dB", "channel db"];
    let names = names.iter().chain(&["scalar dA", "scalar da", "scalar dB", "scalar db", "channel dα", "scalar dα"]);
    // bf16 operands: about 8 significant bits each, so a bound relative to the largest entry.
    let bf16 = GateProducts::Bf16 { x: &gx16 };
    for (products, bound) in [(GateProducts::F32, rel), (bf16, 3e-2)] {
        let got = gpu_backward(products);
        for ((name, got), want) in names.clone().zip(&got).zip(&want) {
            assert_close(&format!("{name} {what} ({products:?})"), got, want, 0.0, bound);
        }
    }
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
    cuda::swiglu::swiglu_forward(dev, &gg, &gu, &mut gy).unwrap();
    cuda::swiglu::swiglu_backward(dev, &gg, &gu, &gdout, &mut gdgate, &mut gdup).unwrap();
    assert_elementwise("swiglu forward", &down(dev, &gy), &y);
    // Both sides overwrite their stale gradient buffers.
    assert_elementwise("swiglu dgate", &down(dev, &gdgate), &dgate);
    assert_elementwise("swiglu dup", &down(dev, &gdup), &dup);
    let mut short = dev.alloc(n - 1).unwrap();
    assert!(matches!(cuda::swiglu::swiglu_forward(dev, &gg, &gu, &mut short), Err(CudaError::Shape { .. })));
}

#[test]
fn max_pool_and_global_avg_pool_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(19);
    // (N·C, H, W, kernel, stride, padding): the ResNet stem's 3×3/2 padded, overlapping and
    // disjoint windows, a window as large as the padded input.
    for (planes, height, width, kernel, stride, padding) in
        [(6, 13, 11, 3, 2, 1), (4, 8, 8, 2, 2, 0), (3, 9, 7, 3, 1, 1), (2, 5, 6, 7, 1, 3), (5, 1, 9, 1, 3, 0)]
    {
        let g = cuda::pool::MaxPool2d { planes, height, width, kernel, stride, padding };
        let (out_h, out_w) = g.output_size();
        // Values on a coarse grid, so that windows hold ties (the first maximum wins).
        let x: Vec<f32> = (0..planes * height * width).map(|_| rng.below(7) as f32 - 3.0).collect();
        let (mut y, mut argmax) = (vec![0.0; planes * out_h * out_w], vec![0usize; planes * out_h * out_w]);
        cpu::pool::max_pool2d_forward(&g, &x, &mut y, &mut argmax);
        let (gx, mut gy, mut gargmax) = (up(dev, &x), dev.alloc(y.len()).unwrap(), dev.alloc::<u32>(y.len()).unwrap());
        cuda::pool::max_pool2d_forward(dev, &g, &gx, &mut gy, &mut gargmax).unwrap();
        let what = format!("max_pool2d {g:?}");
        assert_eq!(down(dev, &gy), y, "{what}: y");
        let argmax_gpu: Vec<usize> = dev.download(&gargmax).unwrap().into_iter().map(|a| a as usize).collect();
        assert_eq!(argmax_gpu, argmax, "{what}: argmax");
        let (dy, dx0) = (rng.vec(y.len(), -1.0, 1.0), stale(x.len()));
        let mut dx = dx0.clone();
        cpu::pool::max_pool2d_backward(&g, &argmax, &dy, &mut dx);
        let mut gdx = up(dev, &dx0);
        cuda::pool::max_pool2d_backward(dev, &g, &gargmax, &up(dev, &dy), &mut gdx).unwrap();
        assert_elementwise(&format!("{what}: dx"), &down(dev, &gdx), &dx);
    }
    for (planes, spatial) in [(12, 49), (3, 1), (2, 3001)] {
        let x = rng.vec(planes * spatial, -2.0, 2.0);
        let mut y = vec![0.0; planes];
        cpu::pool::global_avg_pool_forward(&x, planes, 1, spatial, &mut y);
        let mut gy = dev.alloc(planes).unwrap();
        cuda::pool::global_avg_pool_forward(dev, &up(dev, &x), planes, spatial, &mut gy).unwrap();
        assert_elementwise("global_avg_pool", &down(dev, &gy), &y);
        let (dy, dx0) = (rng.vec(planes, -1.0, 1.0), stale(x.len()));
        let mut dx = dx0.clone();
        cpu::pool::global_avg_pool_backward(&dy, planes, 1, spatial, &mut dx);
        let mut gdx = up(dev, &dx0);
        cuda::pool::global_avg_pool_backward(dev, &up(dev, &dy), planes, spatial, &mut gdx).unwrap();
        assert_elementwise("global_avg_pool dx", &down(dev, &gdx), &dx);
    }
    let bad = cuda::pool::MaxPool2d { planes: 1, height: 4, width: 4, kernel: 2, stride: 2, padding: 2 };
    let (gx, mut gy, mut ga) = (up(dev, &[0.0; 16]), dev.alloc(9).unwrap(), dev.alloc::<u32>(9).unwrap());
    assert!(matches!(cuda::pool::max_pool2d_forward(dev, &bad, &gx, &mut gy, &mut ga), Err(CudaError::Shape { .. })));
}
