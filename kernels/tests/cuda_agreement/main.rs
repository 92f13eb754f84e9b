//! CPU-vs-CUDA agreement: every CUDA kernel against its CPU counterpart on random inputs,
//! plus the caching allocator's reuse, one module per op family. Run with
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

use gradcheck::Tolerance;
use half::bf16;
use kernels::cuda::{CudaDevice, CudaError, DeviceBuffer};

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
        match $crate::shared_device() {
            Some(dev) => dev,
            None => return,
        }
    };
}

mod attention;
mod conv;
mod device;
mod elementwise;
mod fused_gate;
mod gate_epilogues;
mod matmul;
mod norm;
mod optim;
mod reduce;
mod rotary_attention;
mod softmax;

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

/// Asserts `|got − want| ≤ abs + rel·|want|` element by element (the toolkit's
/// [`close`](gradcheck::close): NaN matches NaN), for results that cancel: their rounding is
/// relative to the terms summed, not to the result.
fn assert_close_to(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    gradcheck::assert_close(what, got, want, Tolerance { atol: f64::from(abs), rtol: f64::from(rel) });
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

/// `host` rounded to bf16 (nearest even), on `dev`.
fn up_bf16(dev: &CudaDevice, host: &[f32]) -> DeviceBuffer<bf16> {
    dev.upload(&host.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).expect("upload")
}

/// A bf16 buffer's values, widened to f32 on the host.
fn down_bf16(dev: &CudaDevice, buffer: &DeviceBuffer<bf16>) -> Vec<f32> {
    dev.download(buffer).expect("download").iter().map(|v| v.to_f32()).collect()
}

/// A launch given a bf16 twin wrote the same f32 output as without one (`first`), and the
/// twin holds that output rounded to nearest even.
fn assert_twin(
    dev: &CudaDevice,
    what: &str,
    values: &DeviceBuffer<f32>,
    first: &DeviceBuffer<f32>,
    twin: &DeviceBuffer<bf16>,
) {
    let values = down(dev, values);
    assert_eq!(values, down(dev, first), "{what}: the twin changed the f32 output");
    let rounded: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(dev.download(twin).unwrap(), rounded, "{what}: the twin is not the output rounded");
}
