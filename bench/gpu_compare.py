#!/usr/bin/env python3
"""Transponder vs PyTorch on one CUDA GPU: training (and optionally forward-only) tokens/s,
their ratio, model FLOP utilisation (MFU) and GPU memory, for llama-60m pre-ln (the plain
LLaMA) and transponder by default.

The GPU twin of `bench/compare.py`. Each measurement is a fresh process, the two engines
alternating: our prebuilt `train-bench` with `--device cuda --bf16`, and this script itself
in `--torch-worker` mode, which trains the same model (`bench/torch_llama.py`'s PyTorch
twin of our presets and variants) in PyTorch eager with bf16 autocast on the GPU. Needs
only python3 and torch with CUDA; no Rust (build the binaries elsewhere with
`cargo build --release --features cuda` and pass the path).

Protocol (identical in both engines, as `compare.py`): random byte tokens, vocab 256,
AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, decay 0.01 on matrices only), `--warmup`
untimed steps, then `--steps` timed steps of forward -> loss -> backward -> optimizer step
-> zero_grad; reading the loss waits for the forward, and each step waits for the GPU after
the backward and after the optimizer, so every step is timed whole; tokens/s = B*T / median
step. Mixed precision: bf16 inputs to the matrix products, f32 master weights, f32
optimizer state (PyTorch: `torch.autocast("cuda", torch.bfloat16)`; ours: `--bf16`).
`--fp32` runs both in plain f32 instead (no TF32 on either side).

MFU (model FLOPs utilisation, PaLM appendix B):

    training FLOPs per token  = 6*N + 12*L*d*T      forward-only: 2*N + 4*L*d*T
    MFU = FLOPs per token * tokens/s / peak

N = parameters that multiply activations: every parameter except the token-embedding table
(a lookup); the LM head counts. The attention term counts QK^T and AV over the full window
T (d = model width, L = layers), as PaLM does, although a causal kernel does about half.
Peak = 989 TFLOP/s, the H100 SXM's dense bf16 tensor-core rate (`--peak-tflops` for other
GPUs; the same peak is used for --fp32 runs, so their MFU reads against bf16).
Both engines' MFU use the PyTorch twin's N, so the two columns compare the same work.

    python3 bench/gpu_compare.py --transponder-bin target/release/transponder
    python3 bench/gpu_compare.py --transponder-bin /opt/bin/train-bench --models llama-60m \\
        --variants pre-ln,transponder --batch 32 --seq 256 --steps 20 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
H100_BF16_DENSE_TFLOPS = 989.0
VOCAB = 256


def bench_binary(path):
    """`train-bench` itself, or the `train-bench` beside a `transponder` binary."""
    path = os.path.abspath(path)
    if os.path.basename(path) != "train-bench":
        path = os.path.join(os.path.dirname(path), "train-bench")
    if not os.access(path, os.X_OK):
        raise SystemExit(
            f"{path} is missing or not executable; build it with "
            "`cargo build --release --features cuda` (it sits beside target/release/transponder)"
        )
    return path


def run_json(cmd):
    """Runs one benchmark process; its last output line is a JSON object."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def common_flags(model, variant, mode, args):
    flags = ["--model", model, "--variant", variant, "--batch", str(args.batch), "--seq", str(args.seq)]
    flags += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    return flags + (["--forward-only"] if mode == "forward" else [])


def flops_per_token(n_matmul, layers, width, seq, mode):
    """Model FLOPs per token (see the module docstring)."""
    if mode == "forward":
        return 2 * n_matmul + 4 * layers * width * seq
    return 6 * n_matmul + 12 * layers * width * seq


# ---------------------------------------------------------------------------------------
# The PyTorch side: one process per measurement.
# ---------------------------------------------------------------------------------------


def torch_worker(argv):
    """Trains (or runs forward-only) the PyTorch twin on the GPU and prints one JSON line."""
    p = argparse.ArgumentParser(prog="gpu_compare.py --torch-worker")
    p.add_argument("--model", default="llama-60m")
    p.add_argument("--variant", default="pre-ln")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--adamw", default="foreach", choices=["foreach", "fused"])
    args = p.parse_args(argv)

    import torch

    sys.path.insert(0, HERE)
    from torch_llama import PRESETS, Llama

    if not torch.cuda.is_available():
        raise SystemExit("PyTorch sees no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    model = Llama(args.model, args.variant, VOCAB, args.seq).to(device)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if args.adamw == "fused":
        opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-3, foreach=True)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=not args.fp32)

    gen = torch.Generator().manual_seed(args.seed + 1)
    sync = torch.cuda.synchronize

    step_s, fwd_s, bwd_s, opt_s, loss_value = [], [], [], [], float("nan")
    for i in range(args.warmup + args.steps):
        data = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
        ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        sync()
        t0 = time.perf_counter()
        ids, targets = ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if args.forward_only:
            with torch.no_grad(), autocast():
                loss_value = model(ids, targets).item()
            t1 = t2 = time.perf_counter()
        else:
            with autocast():
                loss = model(ids, targets)
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
        if i >= args.warmup:
            step_s.append(t3 - t0)
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
            opt_s.append(t3 - t2)

    d, _ffn, layers, _heads = PRESETS[args.model]
    parameters = sum(q.numel() for q in model.parameters())
    step = statistics.median(step_s)
    print(
        json.dumps(
            {
                "engine": "pytorch",
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0),
                "model": args.model,
                "variant": args.variant,
                "mode": "forward" if args.forward_only else "train",
                "batch": args.batch,
                "seq": args.seq,
                "bf16": not args.fp32,
                "steps": args.steps,
                "parameters": parameters,
                "matmul_parameters": parameters - model.embed_tokens.weight.numel(),
                "layers": layers,
                "d_model": d,
                "tokens_per_s": args.batch * args.seq / step,
                "step_ms_median": step * 1e3,
                "step_ms_min": min(step_s) * 1e3,
                "forward_ms": statistics.median(fwd_s) * 1e3,
                "backward_ms": statistics.median(bwd_s) * 1e3,
                "optimizer_ms": statistics.median(opt_s) * 1e3,
                "gpu_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
                "final_loss": loss_value,
            }
        )
    )


# ---------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--transponder-bin",
        default=os.path.join(ROOT, "target", "release", "transponder"),
        help="our prebuilt binary (`transponder` or `train-bench`; the train-bench beside it is run)",
    )
    p.add_argument("--models", default="llama-60m")
    p.add_argument("--variants", default="pre-ln,transponder")
    p.add_argument("--modes", default="train", help="train and/or forward, comma-separated")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per process (kernel compiles, caches)")
    p.add_argument("--repeats", type=int, default=2, help="processes per engine and row (alternating)")
    p.add_argument("--threads", type=int, default=8, help="host threads of our engine (rayon)")
    p.add_argument("--fp32", action="store_true", help="plain f32 on both sides instead of bf16 matrix inputs")
    p.add_argument("--adamw", default="foreach", choices=["foreach", "fused"], help="PyTorch's AdamW implementation")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="GPU peak for MFU")
    p.add_argument("--json", help="also write every process's result here (one JSON object per line)")
    args = p.parse_args()

    ours_bin = bench_binary(args.transponder_bin)
    peak = args.peak_tflops * 1e12
    precision = "f32" if args.fp32 else "bf16 matmul inputs, f32 master weights"
    print(
        f"batch {args.batch} x seq {args.seq}, {args.steps} timed steps after {args.warmup} warm-up, "
        f"median of {args.repeats} processes per engine; {precision}; MFU against {args.peak_tflops:g} TFLOP/s\n"
    )
    print(
        "| model | variant | mode | ours tok/s | PyTorch tok/s | ratio | ours MFU | PyTorch MFU "
        "| ours GPU MiB | PyTorch GPU MiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    log = open(args.json, "w") if args.json else None
    gpu = None
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            for mode in args.modes.split(","):
                flags = common_flags(model, variant, mode, args)
                ours_flags = flags + ["--device", "cuda", "--threads", str(args.threads)]
                ours_flags += [] if args.fp32 else ["--bf16"]
                torch_flags = flags + ["--adamw", args.adamw] + (["--fp32"] if args.fp32 else [])
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(run_json([ours_bin] + ours_flags))
                    theirs.append(run_json([sys.executable, os.path.abspath(__file__), "--torch-worker"] + torch_flags))
                if log:
                    for row in ours + theirs:
                        log.write(json.dumps(row) + "\n")
                gpu = gpu or theirs[0]["gpu"]
                ref = theirs[0]
                per_token = flops_per_token(ref["matmul_parameters"], ref["layers"], ref["d_model"], args.seq, mode)
                if ours[0]["parameters"] != ref["parameters"]:
                    print(
                        f"note: {model} {variant} has {ours[0]['parameters']:,} parameters here and "
                        f"{ref['parameters']:,} in PyTorch; MFU uses PyTorch's count",
                        file=sys.stderr,
                    )
                ours_tps = statistics.median(r["tokens_per_s"] for r in ours)
                theirs_tps = statistics.median(r["tokens_per_s"] for r in theirs)
                ours_mib = max(r.get("gpu_reserved_mib") or float("nan") for r in ours)
                theirs_mib = max(r["gpu_reserved_mib"] for r in theirs)
                print(
                    f"| {model} | {variant} | {mode} | {ours_tps:,.0f} | {theirs_tps:,.0f} | "
                    f"{ours_tps / theirs_tps:.2f} | {100 * per_token * ours_tps / peak:.1f}% | "
                    f"{100 * per_token * theirs_tps / peak:.1f}% | {ours_mib:,.0f} | {theirs_mib:,.0f} |",
                    flush=True,
                )
    if gpu:
        print(f"\nGPU: {gpu}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(sys.argv[2:])
    else:
        main()
