#!/usr/bin/env python3
"""Transponder vs PyTorch on the CPU: training and forward-only tokens/s, and peak memory.

Runs `train-bench` (this engine) and `torch_llama.py` (the same models in PyTorch eager)
for each model x variant x mode, alternating the two engines, each as a fresh process with
the same thread count, and prints the median tokens/s of each, their ratio (ours / PyTorch)
and each process's peak resident memory (VmHWM). Both sides use the same protocol: random
byte tokens, vocab 256, AdamW, warm-up steps untimed, the median of the timed steps.

Creates a virtual environment with CPU PyTorch in bench/.venv when it is missing (pip; set
PIP_INDEX_URL / PIP_EXTRA_INDEX_URL to choose where wheels come from), and builds
train-bench in release mode.

    python3 bench/compare.py                                   # the default grid, 2 threads
    python3 bench/compare.py --models llama-tiny --variants pre-ln --threads 2 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "bench", ".venv")
PYTHON = os.path.join(VENV, "bin", "python")
OURS = os.path.join(ROOT, "target", "release", "train-bench")
TORCH_SCRIPT = os.path.join(ROOT, "bench", "torch_llama.py")


def ensure_torch():
    """A virtual environment with torch, made on first use."""
    if os.path.exists(PYTHON):
        probe = subprocess.run([PYTHON, "-c", "import torch"], capture_output=True)
        if probe.returncode == 0:
            return
    if not os.path.exists(PYTHON):
        print(f"creating {VENV}", file=sys.stderr)
        venv.create(VENV, with_pip=True)
    print("installing torch into the virtual environment (pip)", file=sys.stderr)
    subprocess.run([PYTHON, "-m", "pip", "install", "--quiet", "torch", "numpy"], check=True)


def build_ours():
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "-p", "trainer", "--bin", "train-bench"], cwd=ROOT, check=True
    )


def run_json(cmd, threads):
    """Runs one benchmark process; its last output line is a JSON object."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_args(model, variant, mode, args):
    flags = ["--model", model, "--variant", variant, "--batch", str(args.batch), "--seq", str(args.seq)]
    flags += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    return flags + (["--forward-only"] if mode == "forward" else [])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-tiny,llama-small")
    p.add_argument("--variants", default="pre-ln,transponder")
    p.add_argument("--modes", default="train,forward")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="processes per engine and row (alternating)")
    p.add_argument("--json", help="also write every process's result here (one JSON object per line)")
    args = p.parse_args()

    ensure_torch()
    build_ours()
    torch_version = subprocess.run(
        [PYTHON, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    print(f"threads {args.threads}, batch {args.batch} x seq {args.seq}, {args.steps} timed steps after "
          f"{args.warmup} warm-up, median of {args.repeats} processes per engine; torch {torch_version}\n")
    header = ("| model | variant | mode | ours tok/s | PyTorch tok/s | ratio | ours peak MiB | PyTorch peak MiB |")
    print(header)
    print("|---|---|---|---:|---:|---:|---:|---:|")
    log = open(args.json, "w") if args.json else None
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            for mode in args.modes.split(","):
                flags = bench_args(model, variant, mode, args)
                ours, theirs = [], []
                for _ in range(args.repeats):
                    ours.append(run_json([OURS] + flags, args.threads))
                    theirs.append(run_json([PYTHON, TORCH_SCRIPT] + flags, args.threads))
                if log:
                    for row in ours + theirs:
                        log.write(json.dumps(row) + "\n")
                ours_tps = statistics.median(r["tokens_per_s"] for r in ours)
                theirs_tps = statistics.median(r["tokens_per_s"] for r in theirs)
                ours_mib = max(r["peak_rss_mib"] for r in ours)
                theirs_mib = max(r["peak_rss_mib"] for r in theirs)
                print(f"| {model} | {variant} | {mode} | {ours_tps:,.0f} | {theirs_tps:,.0f} | "
                      f"{ours_tps / theirs_tps:.2f} | {ours_mib:,.0f} | {theirs_mib:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
