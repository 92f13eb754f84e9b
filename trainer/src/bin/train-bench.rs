//! `train-bench`: training and forward-only throughput of a LLaMA preset on random byte
//! tokens, the number `bench/compare.py` sets beside PyTorch's (`bench/torch_llama.py`).
//!
//! Protocol (identical in both engines): build the model (vocab 256, or `--vocab V`), AdamW (PyTorch
//! defaults, decay 0.01, no clipping), `--warmup` untimed steps, then `--steps` timed steps
//! of `forward → loss → backward → optimizer step → zero_grad`, each timed on its own;
//! tokens/s = B·T / median step time. Forward-only runs the same forward and loss under
//! `no_grad`. Peak memory is the process's VmHWM (peak resident set) from /proc.
//!
//! The last line of output is one JSON object (machine-readable), with the median forward /
//! backward / optimizer split of a step and the CPU time per step (all threads; robust to
//! other jobs on the machine, unlike wall time) and the heap allocations per timed step
//! (count and MiB, from a counting global allocator). `--profile` prints wall time per op
//! to stderr.
//!
//! `--device cuda[:N]` (a build with `--features cuda`) runs the model and AdamW on a GPU:
//! the step waits for the GPU after the backward pass and after the optimizer (so each part
//! is timed whole; reading the loss already waits after the forward), and the JSON adds the
//! GPU allocator's reserved MiB. `--bf16` feeds bf16 inputs to the GPU's matrix products
//! (f32 master weights), the setting `bench/gpu_compare.py` compares with PyTorch autocast.
//!
//! On a GPU (or the emulated device) one more, untimed, steady-state step runs after the
//! timed ones without the bench's own waits (forward, backward, AdamW; the loss stays on the
//! device), and the JSON's `"counters"` holds what the device was
//! asked to do in it: launches (by kernel in `launches_by_kernel`), cuBLAS calls and FLOPs
//! by precision (`f32_simt_gemm_flops`: products off the tensor cores), host
//! synchronisations, pageable and pinned copies, driver allocations, bytes touched (by
//! kernel in `bytes_by_kernel`; `kernels::cuda::counters`). Then `--steps` more steps run back to back with one wait at
//! the end (`"queued_tokens_per_s"`, `"queued_step_ms"`): the host prepares a step while the
//! device runs the one before, as in `transponder train`, which reads each loss one step
//! late. `--cuda-graph` makes those untimed steps replays of the training step captured as a
//! CUDA graph (`trainer::train::graph`, as `transponder train --cuda-graph` runs it: its
//! step guard, without clipping, adds the gradient norm's partial sums, one launch per 512
//! gradients, and the verdict to the eager step's launches; the counters then show the
//! device work of one replay and `graph_launches: 1`). `--kernel-timer` runs one more step
//! under the per-kernel timer (a CUDA event pair around every launch) and adds its time per kernel family
//! (`"kernel_ms"`), printing the slowest kernels to stderr.
//!
//! ```text
//! cargo run --release -p trainer --bin train-bench -- --model llama-tiny --variant pre-ln \
//!     --batch 16 --seq 256 --steps 10 [--forward-only] [--threads 2] [--device cuda --bf16] \
//!     [--kernel-timer]
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autograd::{no_grad, Var};
use models::llama::{Llama, LlamaConfig};
use nn::optim::{Adam, AdamConfig, Optimizer};
use nn::Module;
use tensor::{Device, Rng, Tokens};
use trainer::data::sampler::TokenBatch;
use trainer::device::{device_name, ensure_available, parse_device, synchronize, MatmulPrecision};
use trainer::gpu_counters::{time_kernels, CounterSnapshot};
#[cfg(feature = "cuda")]
use trainer::train::graph::{GraphStep, StepShape};

struct Args {
    model: String,
    variant: String,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    threads: usize,
    forward_only: bool,
    seed: u64,
    profile: bool,
    device: Device,
    bf16: bool,
    kernel_timer: bool,
    cuda_graph: bool,
    vocab: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        model: "llama-tiny".into(),
        variant: "pre-ln".into(),
        batch: 16,
        seq: 256,
        steps: 10,
        warmup: 2,
        threads: 2,
        forward_only: false,
        seed: 0,
        profile: false,
        device: Device::Cpu,
        bf16: false,
        kernel_timer: false,
        cuda_graph: false,
        vocab: 256,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--variant" => args.variant = value()?,
            "--batch" => args.batch = value()?.parse()?,
            "--seq" => args.seq = value()?.parse()?,
            "--steps" => args.steps = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--threads" => args.threads = value()?.parse()?,
            "--seed" => args.seed = value()?.parse()?,
            "--vocab" => args.vocab = value()?.parse()?,
            "--device" => args.device = parse_device(&value()?).map_err(anyhow::Error::msg)?,
            "--forward-only" => args.forward_only = true,
            "--profile" => args.profile = true,
            "--bf16" => args.bf16 = true,
            "--kernel-timer" => args.kernel_timer = true,
            "--cuda-graph" => args.cuda_graph = true,
            "-h" | "--help" => {
                println!(
                    "train-bench --model NAME --variant NAME --batch B --seq T --steps N [--warmup N] \
                     [--threads N] [--seed S] [--vocab V] [--forward-only] [--profile] [--device cpu|cuda|cuda:N] [--bf16] \
                     [--kernel-timer] [--cuda-graph]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}` (try --help)"),
        }
    }
    if args.steps == 0 || args.batch == 0 || args.seq == 0 || args.vocab == 0 {
        bail!("--steps, --batch, --seq and --vocab must be positive");
    }
    if args.kernel_timer && args.device == Device::Cpu {
        bail!("--kernel-timer times GPU kernels: it needs --device cuda");
    }
    if args.cuda_graph && (args.device == Device::Cpu || args.forward_only || args.kernel_timer) {
        bail!("--cuda-graph replays training steps on a GPU: it needs --device cuda, without --forward-only or --kernel-timer");
    }
    Ok(args)
}

/// The system allocator, counting calls and bytes so the bench can report how much a
/// timed step still allocates (tensor buffers come from `tensor::pool` after the first
/// step; what remains is kernel scratch space and small bookkeeping).
struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// counters are plain atomics with no effect on the memory handed out.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

fn count(bytes: usize) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    ALLOCATED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// `(allocations, bytes)` so far.
fn allocation_counts() -> (u64, u64) {
    (ALLOCATIONS.load(Ordering::Relaxed), ALLOCATED_BYTES.load(Ordering::Relaxed))
}

/// A kB field (`VmHWM`, `VmRSS`) of /proc/self/status, in MiB.
fn proc_status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| {
            line.strip_prefix(field)?.trim_start_matches(':').trim().strip_suffix("kB")?.trim().parse().ok()
        })
        .map_or(f64::NAN, |kb: f64| kb / 1024.0)
}

/// CPU time (seconds) all threads of this process have run so far, from the scheduler's
/// per-thread counters. On a machine shared with other jobs it measures the work done,
/// while wall time also counts the time spent waiting for a core.
fn process_cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return f64::NAN };
    let run_ns = |entry: std::fs::DirEntry| -> Option<f64> {
        let stat = std::fs::read_to_string(entry.path().join("schedstat")).ok()?;
        stat.split_whitespace().next()?.parse().ok()
    };
    tasks.filter_map(|e| e.ok().and_then(run_ns)).sum::<f64>() * 1e-9
}

fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// The most MiB the GPU's caching allocator held from the driver at once (in use plus
/// cached; `--cuda-graph` releases the cache once, before its steps in the graph's pool) and
/// the most it had in use at once; `None` on the CPU.
#[cfg(feature = "cuda")]
fn gpu_memory_mib(device: Device) -> Result<Option<(f64, f64)>> {
    let Device::Cuda(ordinal) = device else { return Ok(None) };
    let stats = tensor::cuda::device(ordinal)?.allocator_stats();
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    Ok(Some((mib(stats.peak_reserved_bytes), mib(stats.peak_in_use_bytes))))
}

/// Without the `cuda` feature no model runs on a GPU.
#[cfg(not(feature = "cuda"))]
fn gpu_memory_mib(_device: Device) -> Result<Option<(f64, f64)>> {
    Ok(None)
}

/// Per-op wall time per step (ms), slowest first, from the autograd profiler.
fn print_profile(ops: &[(&'static str, f64, f64, usize)], steps: usize) {
    let per_step = |s: f64| s * 1e3 / steps as f64;
    let total: f64 = ops.iter().map(|o| o.1 + o.2).sum();
    eprintln!("{:<28} {:>9} {:>9} {:>7} {:>6}", "op (ms per step)", "forward", "backward", "calls", "share");
    for &(op, fwd, bwd, calls) in ops {
        let share = 100.0 * (fwd + bwd) / total;
        eprintln!("{op:<28} {:>9.2} {:>9.2} {:>7} {share:>5.1}%", per_step(fwd), per_step(bwd), calls / steps);
    }
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let threads = args.threads;
    trainer::threads::on_worker_pool(Some(threads), || run(args))?
}

fn run(args: Args) -> Result<()> {
    ensure_available(args.device)?;
    let _precision = MatmulPrecision::set(args.device, args.bf16)?;
    let rss_start = proc_status_mib("VmRSS");

    let mut config = LlamaConfig::preset(&args.model)?;
    config.vocab_size = args.vocab;
    config.seq_len = args.seq;
    config.variant = args.variant.clone();
    config.validate()?;
    let model = Llama::new(&config, args.seed)?;
    model.to_device(args.device)?;
    let mut optimizer = Adam::new(model.named_parameters(), AdamConfig::default());

    let tokens = args.batch * args.seq;
    let mut rng = Rng::new(args.seed + 1);
    let mut host_batch = || -> TokenBatch {
        let ids: Vec<u32> = (0..tokens + 1).map(|_| rng.below(args.vocab as u64) as u32).collect();
        let (inputs, targets) = (ids[..tokens].to_vec(), ids[1..].to_vec());
        TokenBatch { inputs, targets, batch_size: args.batch, seq_len: args.seq }
    };
    // A batch's inputs and targets on the model's device, uploaded once each (as the trainer does).
    let on_device = |batch: &TokenBatch| -> Result<(Tokens, Tokens)> {
        Ok((Tokens::new(&batch.inputs, args.device)?, Tokens::labels(&batch.targets, args.device)?))
    };

    let mut cpu_start = process_cpu_seconds();
    let mut allocations_start = allocation_counts();
    let (mut step_s, mut fwd_s, mut bwd_s, mut opt_s, mut loss) = (vec![], vec![], vec![], vec![], f32::NAN);
    for i in 0..args.warmup + args.steps {
        let (ids, targets) = on_device(&host_batch())?;
        if i == args.warmup {
            cpu_start = process_cpu_seconds();
            allocations_start = allocation_counts();
        }
        if args.profile && i == args.warmup {
            Var::profile_start();
        }
        Var::profile_mark();
        let t0 = Instant::now();
        let (t1, t2);
        if args.forward_only {
            loss = no_grad(|| model.loss(&ids, &targets, args.batch, args.seq))?.value().to_host()?.item()?;
            (t1, t2) = (Instant::now(), Instant::now());
        } else {
            let l = model.loss(&ids, &targets, args.batch, args.seq)?;
            loss = l.value().to_host()?.item()?;
            t1 = Instant::now();
            l.backward()?;
            // Dropping the graph releases the saved activations and the views that share
            // the parameters' storage, so the optimizer updates them in place.
            drop(l);
            synchronize(args.device)?;
            t2 = Instant::now();
            optimizer.step(1e-3)?;
            optimizer.zero_grad();
            synchronize(args.device)?;
        }
        let t3 = Instant::now();
        if i >= args.warmup {
            step_s.push((t3 - t0).as_secs_f64());
            fwd_s.push((t1 - t0).as_secs_f64());
            bwd_s.push((t2 - t1).as_secs_f64());
            opt_s.push((t3 - t2).as_secs_f64());
        }
    }
    let cpu_per_step = (process_cpu_seconds() - cpu_start) / args.steps as f64;
    let allocations_end = allocation_counts();

    // One more steady-state step, counted on the device: as the trainer runs it, without
    // the waits the timing above adds. With --cuda-graph, a replay of the captured step
    // (`trainer::train::graph`): its guard (no clipping) is read after the next step is queued.
    #[cfg(feature = "cuda")]
    let (mut graph, mut unread): (Option<GraphStep>, Option<nn::optim::StepGuard>) = (None, None);
    // Returns whether the step ran as it will from now on (eagerly, or replayed).
    let mut untimed_step = || -> Result<bool> {
        let batch = host_batch();
        #[cfg(feature = "cuda")]
        if args.cuda_graph {
            let batches = std::slice::from_ref(&batch);
            let graph = match &mut graph {
                Some(graph) => graph,
                None => {
                    let shape =
                        StepShape { batch: args.batch, seq: args.seq, micro_batches: 1.0, max_norm: f32::INFINITY };
                    graph.insert(GraphStep::new(&model, args.device, shape, batches, None)?)
                }
            };
            let guard = graph.run(&model, &mut optimizer, batches, 1e-3)?;
            if let Some(previous) = unread.replace(guard) {
                loss = previous.read()?.loss;
            }
            return Ok(graph.graph().is_some());
        }
        let (ids, targets) = on_device(&batch)?;
        if args.forward_only {
            no_grad(|| model.loss(&ids, &targets, args.batch, args.seq))?;
        } else {
            let l = model.loss(&ids, &targets, args.batch, args.seq)?;
            l.backward()?;
            drop(l);
            optimizer.step(1e-3)?;
            optimizer.zero_grad();
        }
        Ok(true)
    };
    if args.cuda_graph {
        // The eager first step, the step in the graph's pool, the capture and its replay.
        while !untimed_step()? {}
    }
    let before = CounterSnapshot::take(args.device)?;
    untimed_step()?;
    let counters = CounterSnapshot::take(args.device)?.since_json(&before);
    synchronize(args.device)?;
    // The same steps queued back to back, one wait at the end: the throughput of a loop that
    // does not wait for the device inside a step (the trainer reads each loss one step late),
    // where the host prepares a step while the device runs the one before.
    let queued_start = Instant::now();
    for _ in 0..args.steps {
        untimed_step()?;
    }
    synchronize(args.device)?;
    let queued_step = queued_start.elapsed().as_secs_f64() / args.steps as f64;
    let kernel_ms = if args.kernel_timer {
        time_kernels(args.device, || untimed_step().map(drop))?
    } else {
        serde_json::Value::Null
    };
    #[cfg(feature = "cuda")]
    if let Some(last) = unread.take() {
        loss = last.read()?.loss;
    }
    let per_step = |end: u64, start: u64| (end - start) as f64 / args.steps as f64;
    if args.profile {
        print_profile(&Var::profile_stop(), args.steps);
    }
    let step = median(&step_s);
    let mode = if args.forward_only { "forward" } else { "train" };
    let peak = proc_status_mib("VmHWM");
    let gpu_memory = gpu_memory_mib(args.device)?;
    let line = serde_json::json!({
        "engine": "transponder",
        "model": args.model,
        "variant": args.variant,
        "mode": mode,
        "batch": args.batch,
        "vocab": args.vocab,
        "seq": args.seq,
        "threads": args.threads,
        "device": device_name(args.device),
        "bf16": args.bf16,
        "steps": args.steps,
        "parameters": model.num_parameters(),
        "tokens_per_s": tokens as f64 / step,
        "step_ms_median": step * 1e3,
        "step_ms_min": step_s.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        "queued_tokens_per_s": tokens as f64 / queued_step,
        "queued_step_ms": queued_step * 1e3,
        "forward_ms": median(&fwd_s) * 1e3,
        "backward_ms": median(&bwd_s) * 1e3,
        "optimizer_ms": median(&opt_s) * 1e3,
        "cpu_ms_per_step": cpu_per_step * 1e3,
        "allocations_per_step": per_step(allocations_end.0, allocations_start.0),
        "allocated_mib_per_step": per_step(allocations_end.1, allocations_start.1) / (1 << 20) as f64,
        "peak_rss_mib": peak,
        "peak_rss_over_start_mib": peak - rss_start,
        "gpu_reserved_mib": gpu_memory.map(|(reserved, _)| reserved),
        "gpu_peak_in_use_mib": gpu_memory.map(|(_, peak)| peak),
        "final_loss": loss,
        "counters": counters,
        "kernel_ms": kernel_ms,
    });
    println!("{line}");
    Ok(())
}
