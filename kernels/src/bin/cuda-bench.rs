//! GPU timings of the fused gated projection (Transponder eq. 8-10) against the unfused
//! path (cuBLAS bf16 GEMM into `ZU`, then the gate kernel) and the bare cuBLAS GEMM, at the
//! llama-60m / llama-130m projection shapes; then flash attention against the naive
//! kernel that materialises the score matrix.
//!
//! Run: `cargo run --release -p kernels --features cuda --bin cuda-bench [-- --tokens N]`
//! (default N = 512·256 = 131 072 tokens). Each figure is the best of several timed runs
//! after a warm-up; the fused output is checked against the unfused one first.

use std::time::Instant;

use half::bf16;
use kernels::cpu::attention::AttentionDims;
use kernels::cuda::attention::{causal_attention_forward, causal_attention_naive};
use kernels::cuda::fused_gate::{
    fused_gate_forward, fused_gate_forward_unfused, pack_weight, DeviceFusedGateParams, DeviceGateParams,
    FusedGateDims, Unary,
};
use kernels::cuda::{CudaDevice, DeviceBuffer, Result};

/// Timed repetitions per measurement; the best is reported.
const REPEATS: usize = 5;
/// Calls per timed repetition.
const CALLS: usize = 10;

/// Deterministic pseudo-random values in [-bound, bound).
fn values(len: usize, seed: u64, bound: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
        })
        .collect()
}

/// Best seconds per call of `f` (synchronised), after one warm-up call.
fn best_seconds(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..REPEATS {
        let start = Instant::now();
        for _ in 0..CALLS {
            f()?;
        }
        dev.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64() / CALLS as f64);
    }
    Ok(best)
}

fn tokens_from_args() -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--tokens")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("--tokens takes a number"))
        .unwrap_or(512 * 256)
}

/// The parameters of one projection on the device.
struct Projection {
    w: DeviceBuffer<f32>,
    channel: [DeviceBuffer<f32>; 5],
    scalar: [DeviceBuffer<f32>; 5],
}

impl Projection {
    fn new(dev: &CudaDevice, dims: &FusedGateDims) -> Result<Projection> {
        let FusedGateDims { d_in, d_out, rank_channel: rc, rank_scalar: rs, .. } = *dims;
        let bound = 1.0 / (d_in as f32).sqrt();
        let up = |len: usize, seed: u64, bound: f32| dev.upload(&values(len, seed, bound));
        Ok(Projection {
            w: up(d_out * d_in, 1, bound)?,
            channel: [
                up(rc * d_in, 2, bound)?,
                up(rc, 3, 0.5)?,
                up(d_out * rc, 4, 1.0)?,
                up(d_out, 5, 0.5)?,
                dev.upload(&[1.0f32])?,
            ],
            scalar: [
                up(rs * d_in, 6, bound)?,
                up(rs, 7, 0.5)?,
                up(rs, 8, 1.0)?,
                up(1, 9, 0.5)?,
                dev.upload(&[1.0f32])?,
            ],
        })
    }

    fn params(&self) -> DeviceFusedGateParams<'_> {
        let gate = gate_params;
        DeviceFusedGateParams {
            weight: &self.w,
            channel: gate(&self.channel),
            scalar: gate(&self.scalar),
            phi: Unary::Sigmoid,
        }
    }
}

/// One modulator's parameters `[A, a, B, b, α]`.
fn gate_params(p: &[DeviceBuffer<f32>; 5]) -> DeviceGateParams<'_> {
    DeviceGateParams { a_weight: &p[0], a_bias: &p[1], b_weight: &p[2], b_bias: &p[3], alpha: &p[4] }
}

fn bench_projection(dev: &CudaDevice, tokens: usize, d_in: usize, d_out: usize) -> Result<()> {
    let dims = FusedGateDims { rows: tokens, d_in, d_out, rank_channel: 8, rank_scalar: 8 };
    let projection = Projection::new(dev, &dims)?;
    let p = projection.params();
    let packed = pack_weight(dev, &dims, &p)?;
    let x: Vec<bf16> = values(tokens * d_in, 10, 2.0).into_iter().map(bf16::from_f32).collect();
    let x = dev.upload(&x)?;
    let mut zu = dev.alloc::<f32>(tokens * dims.width())?;
    let mut out = dev.alloc::<f32>(tokens * d_out)?;
    let mut out_ref = dev.alloc::<f32>(tokens * d_out)?;

    fused_gate_forward_unfused(dev, &dims, &x, &packed, &p, &mut zu, &mut out_ref)?;
    fused_gate_forward(dev, &dims, &x, &packed, &p, None, &mut out)?;
    let (fused, unfused) = (dev.download(&out)?, dev.download(&out_ref)?);
    let scale = unfused.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let worst = fused.iter().zip(&unfused).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale;

    let unfused_s =
        best_seconds(dev, || fused_gate_forward_unfused(dev, &dims, &x, &packed, &p, &mut zu, &mut out_ref))?;
    let fused_save_s = best_seconds(dev, || fused_gate_forward(dev, &dims, &x, &packed, &p, Some(&mut zu), &mut out))?;
    let fused_s = best_seconds(dev, || fused_gate_forward(dev, &dims, &x, &packed, &p, None, &mut out))?;
    let flops = 2.0 * tokens as f64 * dims.width() as f64 * d_in as f64;
    let tflops = |s: f64| flops / s / 1e12;
    println!(
        "{d_in:>5}→{d_out:<5} {tokens:>7} tokens | unfused {:>7.3} ms ({:>5.1} TFLOP/s) | fused+save {:>7.3} ms ({:>5.1}) \
         | fused {:>7.3} ms ({:>5.1}) | speedup {:.2}× | max rel diff {worst:.1e}",
        unfused_s * 1e3,
        tflops(unfused_s),
        fused_save_s * 1e3,
        tflops(fused_save_s),
        fused_s * 1e3,
        tflops(fused_s),
        unfused_s / fused_s,
    );
    Ok(())
}

fn bench_attention(dev: &CudaDevice, batch: usize, seq: usize, heads: usize, head_dim: usize) -> Result<()> {
    let len = batch * seq * heads * head_dim;
    let (q, k, v) =
        (dev.upload(&values(len, 11, 1.0))?, dev.upload(&values(len, 12, 1.0))?, dev.upload(&values(len, 13, 1.0))?);
    let mut out = dev.alloc::<f32>(len)?;
    let mut naive_out = dev.alloc::<f32>(len)?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let dims = AttentionDims { batch, q_seq: seq, kv_seq: seq, heads, head_dim, scale };
    let mut lse = dev.alloc::<f32>(dims.lse_len())?;
    let flash_s = best_seconds(dev, || causal_attention_forward(dev, &q, &k, &v, &dims, &mut out, &mut lse))?;
    let naive_s = best_seconds(dev, || causal_attention_naive(dev, &q, &k, &v, &dims, &mut naive_out))?;
    let (a, b) = (dev.download(&out)?, dev.download(&naive_out)?);
    let worst = a.iter().zip(&b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    println!(
        "attention B={batch} T={seq} H={heads} D={head_dim} | flash {:>8.3} ms | naive {:>8.3} ms | speedup {:.1}× | max diff {worst:.1e}",
        flash_s * 1e3,
        naive_s * 1e3,
        naive_s / flash_s,
    );
    Ok(())
}

fn main() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!("cuda-bench: {e}");
            std::process::exit(1);
        }
    };
    let tokens = tokens_from_args();
    println!("{dev:?}");
    let run = || -> Result<()> {
        dev.compile_all()?;
        for (d_in, d_out) in [(512, 512), (512, 1376), (768, 768), (768, 2048)] {
            bench_projection(&dev, tokens, d_in, d_out)?;
        }
        bench_attention(&dev, 64, 256, 8, 64)?;
        bench_attention(&dev, 32, 256, 12, 64)?;
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("cuda-bench: {e}");
        std::process::exit(1);
    }
}
