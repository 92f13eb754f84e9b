#!/usr/bin/env python3
"""Two builds of `train-bench` against each other: the same training step, processes
alternating A B A B ..., each process's median step time (wall) and CPU time per step (all
threads; steadier than wall time on a shared machine) read from its JSON line, and the
ratios B/A of the medians per variant. For a change that should not cost speed (a refactor),
run A = the build before it, B = the build after; a ratio near 1.00 with overlapping ranges
says no regression. Works on the CPU and, with `--device cuda --bf16`, on a GPU.

    python3 bench/train_ab.py --a before/train-bench --b target/release/train-bench
    python3 bench/train_ab.py --a A --b B --variants pre-ln,transponder --rounds 5 -- --batch 16 --seq 256

Everything after `--` goes to every `train-bench` process (model, batch, device, ...).
"""

import argparse
import json
import statistics
import subprocess
import sys


def step_times(binary, variant, extra):
    """(median wall ms, CPU ms) per step of one `train-bench` process."""
    cmd = [binary, "--variant", variant, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["step_ms_median"], result["cpu_ms_per_step"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="train-bench of the baseline build")
    p.add_argument("--b", required=True, help="train-bench of the build under test")
    p.add_argument("--variants", default="pre-ln,transponder")
    p.add_argument("--rounds", type=int, default=5, help="processes per build and variant, alternating")
    p.add_argument("extra", nargs="*", help="train-bench flags (after --)")
    args = p.parse_args()
    extra = args.extra or ["--model", "llama-tiny", "--batch", "16", "--seq", "256", "--steps", "8", "--warmup", "2"]
    print(f"train-bench {' '.join(extra)}; {args.rounds} processes per build, alternating A, B")
    print("| variant | A wall ms/step (min-max) | B wall ms/step (min-max) | B/A wall | A CPU ms | B CPU ms | B/A CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant in args.variants.split(","):
        runs = {"a": [], "b": []}
        for _ in range(args.rounds):
            for build in ("a", "b"):
                runs[build].append(step_times(getattr(args, build), variant, extra))
        wall = {k: [w for w, _ in v] for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
        a, b = statistics.median(wall["a"]), statistics.median(wall["b"])
        span = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in wall.items()}
        print(
            f"| {variant} | {a:.1f} ({span['a']}) | {b:.1f} ({span['b']}) | {b / a:.3f} "
            f"| {cpu['a']:.1f} | {cpu['b']:.1f} | {cpu['b'] / cpu['a']:.3f} |"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
