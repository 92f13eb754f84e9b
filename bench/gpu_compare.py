#!/usr/bin/env python3
"""Transponder vs PyTorch on one CUDA GPU: training (and optionally forward-only) tokens/s,
their ratio, model FLOP utilisation (MFU), GPU memory and our device counters, for llama-60m
pre-ln (the plain LLaMA) and transponder by default, against PyTorch eager, torch.compile
and torch.compile with CUDA graphs.

The GPU twin of `bench/compare.py`. Each measurement is a fresh process: our prebuilt
`train-bench` with `--device cuda --bf16`, and this script itself in `--torch-worker` mode,
which trains the same model (`bench/torch_llama.py`'s PyTorch twin of our presets and
variants) with bf16 autocast on the GPU in one PyTorch mode. Per repeat the processes run in
turn on the same card, ours first, then each PyTorch mode in `--torch-modes` order, so slow
drifts of the card (clocks, temperature) reach every engine alike. The table has one row per
engine and PyTorch mode: median tokens/s, ours / that row's (above 1: ours is faster), MFU and
GPU memory; a process that fails leaves its row "failed" (its error on stderr) and the script
exits 1 at the end. `--json` keeps every process's JSON line, in run order. Needs only
python3 and torch with CUDA (and Triton for the compiled modes); no Rust (build the binaries
elsewhere with `cargo build --release --features cuda` and pass the path).

PyTorch modes (`--torch-modes`, comma-separated, each its own row of the table):
  eager               the model as written.
  compile             torch.compile(model): TorchInductor, default mode.
  compile-cudagraphs  torch.compile(model, mode="reduce-overhead"): Inductor, forward and
                      backward replayed as CUDA graphs.
  max-autotune        torch.compile(model, mode="max-autotune"): Inductor with its GEMM and
                      kernel autotuning, and CUDA graphs.
Only the model (forward, loss and, through AOTAutograd, backward) is compiled; the optimizer
runs as in eager. Compilation (and autotuning, and the CUDA graph warm-up and recording)
happens in the first steps, so a compiled mode runs at least 5 untimed warm-up steps whatever
`--warmup` says; the JSON records the warm-up steps run, their total time (`warmup_s`: the
compile cost) and the slowest timed step (`step_ms_max`), and a timed step over 3x the median
is reported on stderr (a recompilation or another process inside the timed steps). The
compile time is not timed but is wall time: a compiled process takes longer than an eager one.

Setting: `--vocab` (default 256, byte tokens), `--batch` (32), `--seq` (256), the same for
both engines. `--anchor` is the issue's anchor setting instead, vocab 32,000, batch 64 x 256
(an explicit `--vocab`, `--batch` or `--seq` still wins).

Protocol (identical in both engines, as `compare.py`): random tokens below the vocab size,
AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, decay 0.01 on matrices only; PyTorch's is the
fused CUDA implementation, `fused=True`, in every mode, `--adamw foreach` for the multi-tensor
one), `--warmup` untimed steps, then `--steps` timed steps of forward -> loss -> backward ->
optimizer step -> zero_grad; reading the loss waits for the forward, and each step waits for
the GPU after the backward and after the optimizer, so every step is timed whole; tokens/s =
B*T / median step. Mixed precision: bf16 inputs to the matrix products, f32 master weights,
f32 optimizer state (PyTorch: `torch.autocast("cuda", torch.bfloat16)`; ours: `--bf16`).
`--fp32` runs both in plain f32 instead (no TF32 on either side).

Memory: ours is `gpu_reserved_mib` (the most our caching allocator held from the driver at
once); PyTorch's is `torch.cuda.max_memory_reserved` (the same measure; CUDA graph
pools included) and `torch.cuda.max_memory_allocated` (peak in live tensors), both over the
whole process, compilation included.

Counters: our JSON line's `counters` (one steady-state step, counted on the device:
launches, host synchronisations, pageable copies, driver allocations, FLOPs of f32 products
off the tensor cores) are printed in a second table, from the first process of each row.

MFU (model FLOPs utilisation, PaLM appendix B):

    training FLOPs per token  = 6*N + 12*L*d*T      forward-only: 2*N + 4*L*d*T
    MFU = FLOPs per token * tokens/s / peak

N = parameters that multiply activations: every parameter except the token-embedding table
(a lookup); the LM head counts (d * vocab: 16.4M of llama-60m's N at vocab 32,000). The
attention term counts QK^T and AV over the full window T (d = model width, L = layers), as
PaLM does, although a causal kernel does about half. Peak = 989 TFLOP/s, the H100 SXM's dense
bf16 tensor-core rate (`--peak-tflops` for other GPUs; the same peak is used for --fp32 runs,
so their MFU reads against bf16). Every row's MFU uses the PyTorch twin's N, so the rows
compare the same work.

    python3 bench/gpu_compare.py --transponder-bin target/release/transponder
    python3 bench/gpu_compare.py --transponder-bin /opt/bin/train-bench --anchor \\
        --torch-modes eager,compile,compile-cudagraphs,max-autotune --repeats 3
    python3 bench/gpu_compare.py --anchor --dry-run     # the commands, in order, run nothing
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
H100_BF16_DENSE_TFLOPS = 989.0
DEFAULT_SETTING = {"vocab": 256, "batch": 32, "seq": 256}
ANCHOR_SETTING = {"vocab": 32000, "batch": 64, "seq": 256}
# PyTorch mode -> torch.compile's mode (None: eager, not compiled).
TORCH_MODES = {
    "eager": None,
    "compile": "default",
    "compile-cudagraphs": "reduce-overhead",
    "max-autotune": "max-autotune",
}
COMPILED_MIN_WARMUP = 5
SLOW_STEP_FACTOR = 3.0
COUNTERS = ("launches", "syncs", "pageable_copies", "driver_allocations", "f32_simt_gemm_flops")


def bench_binary(path, must_exist=True):
    """`train-bench` itself, or the `train-bench` beside a `transponder` binary."""
    path = os.path.abspath(path)
    if os.path.basename(path) != "train-bench":
        path = os.path.join(os.path.dirname(path), "train-bench")
    if must_exist and not os.access(path, os.X_OK):
        raise SystemExit(
            f"{path} is missing or not executable; build it with "
            "`cargo build --release --features cuda` (it sits beside target/release/transponder)"
        )
    return path


def run_json(cmd):
    """Runs one benchmark process and returns its last output line, a JSON object; None when
    the process fails (its error on stderr), so a failing engine or mode costs its own row."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        # Rust errors open with their message, Python's close with it: keep both ends.
        err = done.stderr if len(done.stderr) <= 3000 else f"{done.stderr[:1500]}\n...\n{done.stderr[-1500:]}"
        print(f"{shlex.join(cmd)} failed ({done.returncode}):\n{err}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def common_flags(model, variant, mode, args):
    flags = ["--model", model, "--variant", variant, "--vocab", str(args.vocab)]
    flags += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    flags += ["--warmup", str(args.warmup)]
    return flags + (["--forward-only"] if mode == "forward" else [])


def flops_per_token(n_matmul, layers, width, seq, mode):
    """Model FLOPs per token (see the module docstring)."""
    if mode == "forward":
        return 2 * n_matmul + 4 * layers * width * seq
    return 6 * n_matmul + 12 * layers * width * seq


# ---------------------------------------------------------------------------------------
# The PyTorch side: one process per measurement.
# ---------------------------------------------------------------------------------------


def worker_args(argv):
    p = argparse.ArgumentParser(prog="gpu_compare.py --torch-worker")
    p.add_argument("--model", default="llama-60m")
    p.add_argument("--variant", default="pre-ln")
    p.add_argument("--vocab", type=int, default=DEFAULT_SETTING["vocab"])
    p.add_argument("--batch", type=int, default=DEFAULT_SETTING["batch"])
    p.add_argument("--seq", type=int, default=DEFAULT_SETTING["seq"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--adamw", default="fused", choices=["fused", "foreach"])
    p.add_argument("--torch-mode", default="eager", choices=list(TORCH_MODES))
    return p.parse_args(argv)


def adamw(torch, model, implementation):
    """AdamW as the engine's: lr 1e-3, decay 0.01 on matrices only."""
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, **{implementation: True})


def time_steps(torch, forward, opt, args, warmup, device):
    """Runs `warmup` untimed and `args.steps` timed steps; returns the warm-up steps' and the
    timed steps' (step, forward, backward, optimizer) seconds, and the last loss."""
    compiled = TORCH_MODES[args.torch_mode] is not None
    gen = torch.Generator().manual_seed(args.seed + 1)
    sync = torch.cuda.synchronize

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=not args.fp32)

    times, loss_value = [], float("nan")
    for _ in range(warmup + args.steps):
        data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        sync()
        if compiled:
            # A new step for CUDA graph trees, whose replays overwrite the previous step's
            # outputs (no effect without CUDA graphs).
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        ids, targets = ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if args.forward_only:
            with torch.no_grad(), autocast():
                loss_value = forward(ids, targets).item()
            t1 = t2 = time.perf_counter()
        else:
            with autocast():
                loss = forward(ids, targets)
            loss_value = loss.item()
            t1 = time.perf_counter()
            loss.backward()
            del loss
            sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
        t3 = time.perf_counter()
        times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))

    # The same steps queued back to back, one wait at the end (no .item()): the throughput of a
    # loop that does not wait for the GPU inside a step, as train-bench's "queued_tokens_per_s".
    batches = []
    for _ in range(args.steps):
        data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        batches.append((data[:, :-1].contiguous().pin_memory(), data[:, 1:].contiguous().pin_memory()))
    sync()
    t0 = time.perf_counter()
    for ids, targets in batches:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        ids, targets = ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if args.forward_only:
            with torch.no_grad(), autocast():
                forward(ids, targets)
        else:
            with autocast():
                loss = forward(ids, targets)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    sync()
    queued_step = (time.perf_counter() - t0) / args.steps
    return times[:warmup], times[warmup:], loss_value, queued_step


def torch_worker(argv):
    """Trains (or runs forward-only) the PyTorch twin on the GPU in one PyTorch mode and prints
    one JSON line."""
    args = worker_args(argv)

    import torch

    sys.path.insert(0, HERE)
    from torch_llama import PRESETS, Llama

    if not torch.cuda.is_available():
        raise SystemExit("PyTorch sees no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    model = Llama(args.model, args.variant, args.vocab, args.seq).to(device)
    opt = adamw(torch, model, args.adamw)
    compile_mode = TORCH_MODES[args.torch_mode]
    if compile_mode is None:
        forward, warmup = model, args.warmup
    else:
        forward, warmup = torch.compile(model, mode=compile_mode), max(args.warmup, COMPILED_MIN_WARMUP)
    warmup_times, times, loss_value, queued_step = time_steps(torch, forward, opt, args, warmup, device)

    step_s, fwd_s, bwd_s, opt_s = zip(*times)
    d, _ffn, layers, _heads = PRESETS[args.model]
    parameters = sum(q.numel() for q in model.parameters())
    step = statistics.median(step_s)
    print(
        json.dumps(
            {
                "engine": "pytorch",
                "torch_mode": args.torch_mode,
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0),
                "model": args.model,
                "variant": args.variant,
                "mode": "forward" if args.forward_only else "train",
                "vocab": args.vocab,
                "batch": args.batch,
                "seq": args.seq,
                "bf16": not args.fp32,
                "adamw": args.adamw,
                "warmup": warmup,
                "steps": args.steps,
                "parameters": parameters,
                "matmul_parameters": parameters - model.embed_tokens.weight.numel(),
                "layers": layers,
                "d_model": d,
                "tokens_per_s": args.batch * args.seq / step,
                "queued_tokens_per_s": args.batch * args.seq / queued_step,
                "step_ms_median": step * 1e3,
                "step_ms_min": min(step_s) * 1e3,
                "step_ms_max": max(step_s) * 1e3,
                "warmup_s": sum(t[0] for t in warmup_times),
                "forward_ms": statistics.median(fwd_s) * 1e3,
                "backward_ms": statistics.median(bwd_s) * 1e3,
                "optimizer_ms": statistics.median(opt_s) * 1e3,
                "gpu_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
                "gpu_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                "final_loss": loss_value,
            }
        )
    )


# ---------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--transponder-bin",
        default=os.path.join(ROOT, "target", "release", "transponder"),
        help="our prebuilt binary (`transponder` or `train-bench`; the train-bench beside it is run)",
    )
    p.add_argument("--models", default="llama-60m")
    p.add_argument("--variants", default="pre-ln,transponder")
    p.add_argument("--modes", default="train", help="train and/or forward, comma-separated")
    p.add_argument(
        "--torch-modes",
        default="eager,compile,compile-cudagraphs",
        help=f"PyTorch modes, comma-separated, in run order: {', '.join(TORCH_MODES)}",
    )
    p.add_argument("--anchor", action="store_true", help="the anchor setting: vocab 32,000, batch 64, seq 256")
    p.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULT_SETTING['vocab']})")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULT_SETTING['batch']})")
    p.add_argument("--seq", type=int, help=f"tokens per sequence (default {DEFAULT_SETTING['seq']})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per process")
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help=f"untimed steps per process (kernel compiles, caches; at least {COMPILED_MIN_WARMUP} in compiled modes)",
    )
    p.add_argument("--repeats", type=int, default=2, help="processes per engine, mode and row (in turn)")
    p.add_argument("--threads", type=int, default=8, help="host threads of our engine (rayon)")
    p.add_argument("--fp32", action="store_true", help="plain f32 on both sides instead of bf16 matrix inputs")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also run ours with --cuda-graph (train mode: the step replayed as a CUDA graph), one more row",
    )
    p.add_argument("--adamw", default="fused", choices=["fused", "foreach"], help="PyTorch's AdamW implementation")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="GPU peak for MFU")
    p.add_argument("--json", help="also write every process's result here (one JSON object per line, run order)")
    p.add_argument("--dry-run", action="store_true", help="print the commands in run order; run nothing")
    args = p.parse_args()
    setting = ANCHOR_SETTING if args.anchor else DEFAULT_SETTING
    for key, value in setting.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.torch_modes = args.torch_modes.split(",")
    unknown = [m for m in args.torch_modes if m not in TORCH_MODES]
    if unknown:
        p.error(f"unknown --torch-modes {','.join(unknown)}; choose from {', '.join(TORCH_MODES)}")
    return args


def header(args):
    anchor = all(getattr(args, key) == value for key, value in ANCHOR_SETTING.items())
    setting = "the anchor setting, " if anchor else ""
    precision = "f32" if args.fp32 else "bf16 matmul inputs, f32 master weights"
    return (
        f"{setting}vocab {args.vocab:,}, batch {args.batch} x seq {args.seq}; {args.steps} timed steps after "
        f"{args.warmup} warm-up (at least {COMPILED_MIN_WARMUP} in compiled PyTorch modes), median of "
        f"{args.repeats} processes per engine and mode, run in turn; {precision}; PyTorch {args.adamw} AdamW, "
        f"modes {', '.join(args.torch_modes)}; MFU against {args.peak_tflops:g} TFLOP/s\n"
    )


def commands(ours_bin, model, variant, mode, args):
    """The processes of one row group, in run order: (engine label, command)."""
    flags = common_flags(model, variant, mode, args)
    ours = [ours_bin] + flags + ["--device", "cuda", "--threads", str(args.threads)]
    ours += [] if args.fp32 else ["--bf16"]
    runs = [("transponder", ours)]
    if args.cuda_graph and mode == "train":
        runs.append(("transponder cuda-graph", ours + ["--cuda-graph"]))
    worker = [sys.executable, os.path.abspath(__file__), "--torch-worker"] + flags + ["--adamw", args.adamw]
    worker += ["--fp32"] if args.fp32 else []
    for torch_mode in args.torch_modes:
        runs.append((f"pytorch {torch_mode}", worker + ["--torch-mode", torch_mode]))
    return runs


def measure(runs, args, log):
    """Runs every process `args.repeats` times, in turn; returns each engine's results."""
    results = {label: [] for label, _ in runs}
    for _ in range(args.repeats):
        for label, cmd in runs:
            row = run_json(cmd)
            if row is None:
                continue
            results[label].append(row)
            if log:
                log.write(json.dumps(row) + "\n")
                log.flush()
            what = f"{label} {row['model']} {row['variant']} {row['mode']}"
            print(f"{what}: {row['tokens_per_s']:,.0f} tok/s", file=sys.stderr)
            if row.get("step_ms_max", 0) > SLOW_STEP_FACTOR * row["step_ms_median"]:
                print(
                    f"note: {what}: the slowest timed step took {row['step_ms_max']:.1f} ms, "
                    f"{row['step_ms_max'] / row['step_ms_median']:.1f}x the median (a recompilation?)",
                    file=sys.stderr,
                )
    return results


def fmt(value, spec, unit=""):
    return "—" if value is None else format(value, spec) + unit


def pytorch_results(results):
    return [r for label, rows in results.items() if label.startswith("pytorch") for r in rows]


def table_rows(model, variant, mode, results, args):
    """One table row per engine: tokens/s, ours / that engine, MFU, GPU memory."""
    ours, torch_rows, per_token = results["transponder"], pytorch_results(results), None
    if torch_rows:
        ref = torch_rows[0]
        per_token = flops_per_token(ref["matmul_parameters"], ref["layers"], ref["d_model"], args.seq, mode)
        if ours and ours[0]["parameters"] != ref["parameters"]:
            print(
                f"note: {model} {variant} has {ours[0]['parameters']:,} parameters here and "
                f"{ref['parameters']:,} in PyTorch; MFU uses PyTorch's count",
                file=sys.stderr,
            )
    def median_of(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    ours_tps, ours_queued = median_of(ours, "tokens_per_s"), median_of(ours, "queued_tokens_per_s")
    lines = []
    for label, rows in results.items():
        if not rows:
            lines.append(f"| {model} | {variant} | {mode} | {label} | failed | | | | | | |")
            continue
        tps, queued = median_of(rows, "tokens_per_s"), median_of(rows, "queued_tokens_per_s")
        # Ours against PyTorch's modes; our --cuda-graph row shows its own numbers only.
        theirs = label.startswith("pytorch")
        ratio = ours_tps / tps if ours_tps and theirs else None
        queued_ratio = ours_queued / queued if ours_queued and queued and theirs else None
        mfu = 100 * per_token * tps / (args.peak_tflops * 1e12) if per_token else None
        reserved = max((r.get("gpu_reserved_mib") or float("nan")) for r in rows)
        allocated = max(r["gpu_allocated_mib"] for r in rows) if "gpu_allocated_mib" in rows[0] else None
        lines.append(
            f"| {model} | {variant} | {mode} | {label} | {tps:,.0f} | {fmt(ratio, '.2f')} | "
            f"{fmt(queued, ',.0f')} | {fmt(queued_ratio, '.2f')} | "
            f"{fmt(mfu, '.1f', '%')} | {reserved:,.0f} | {fmt(allocated, ',.0f')} |"
        )
    return lines


def counter_row(model, variant, mode, ours):
    """Our first process's device counters of one steady-state step, or None."""
    counters = ours[0].get("counters") if ours else None
    if not counters:
        return None
    return f"| {model} | {variant} | {mode} | " + " | ".join(fmt(counters.get(c), ",") for c in COUNTERS) + " |"


def main():
    args = parse_args()
    ours_bin = bench_binary(args.transponder_bin, must_exist=not args.dry_run)
    print(header(args))
    groups = [
        (model, variant, mode)
        for model in args.models.split(",")
        for variant in args.variants.split(",")
        for mode in args.modes.split(",")
    ]
    if args.dry_run:
        for group in groups:
            runs = commands(ours_bin, *group, args)
            for repeat in range(args.repeats):
                for label, cmd in runs:
                    print(f"# {' '.join(group)}, {label}, process {repeat + 1} of {args.repeats}\n{shlex.join(cmd)}")
        return
    print(
        "| model | variant | mode | engine | tok/s | ours / engine | queued tok/s | ours / engine, queued "
        "| MFU | GPU MiB reserved | GPU MiB allocated |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    log = open(args.json, "w") if args.json else None
    gpu, counter_rows, failed = None, [], 0
    for group in groups:
        results = measure(commands(ours_bin, *group, args), args, log)
        failed += sum(args.repeats - len(rows) for rows in results.values())
        print("\n".join(table_rows(*group, results, args)), flush=True)
        torch_rows = pytorch_results(results)
        gpu = gpu or (torch_rows[0]["gpu"] if torch_rows else None)
        counter_rows.append(counter_row(*group, results["transponder"]))
    counter_rows = [row for row in counter_rows if row]
    if counter_rows:
        print("\nOur device counters, one steady-state step (first process of each row):\n")
        print("| model | variant | mode | " + " | ".join(COUNTERS) + " |")
        print("|---|---|---|" + "---:|" * len(COUNTERS))
        print("\n".join(counter_rows))
    if gpu:
        print(f"\nGPU: {gpu}")
    if failed:
        raise SystemExit(f"{failed} benchmark processes failed (their errors are above, on stderr)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(sys.argv[2:])
    else:
        main()
