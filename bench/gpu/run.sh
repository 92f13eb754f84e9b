#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after bench/gpu/bundle.sh built
# .gpu/bundle.tar.xz here and the device tool carried `.gpu` there. Every step's output goes
# to logs/<step>.log, packed at the end into $OUT/logs.tgz (the device tool returns at most 8
# files), with each step's tail on stdout; a failing step does not stop the others. Each
# step runs under `timeout` (STEP_TIMEOUT seconds, default 240) and the logs are packed
# after every step, so a hung kernel costs one step, not the device call's whole output.
# DEADLINE (seconds, default none) caps the whole script: each step's timeout shrinks to
# what is left of it, and a step with under 10 s left is skipped, saying so.
#
#     bash bench/gpu/run.sh [steps...]     # steps: tests bench timer graph nccl compare train (default: all)
#     DEADLINE=300 TRAIN_STEPS=100 COMPARE_ARGS="--repeats 1" bash bench/gpu/run.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
LOGS=/tmp/gpu/logs
mkdir -p "$OUT" "$LOGS" && tar -C /tmp/gpu -xJf .gpu/bundle.tar.xz
BIN=/tmp/gpu/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOGS/gpu.txt"
# cudarc opens libnvrtc.so.13 and libcublas.so.13 by name: where the loader's cache lacks
# one, put the first directory holding it (the toolkit's lib64, PyTorch's wheels) on the path.
for lib in libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
    ldconfig -p | grep -q "$lib" && continue
    dir=$(find /usr/local /opt /usr/lib -name "$lib*" -print -quit 2>/dev/null)
    [ -n "$dir" ] && export LD_LIBRARY_PATH="$(dirname "$dir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee -a "$LOGS/gpu.txt"
step() {
    local name=$1
    shift
    local limit=${STEP_TIMEOUT:-240}
    if [ -n "${DEADLINE:-}" ]; then
        local left=$((DEADLINE - SECONDS))
        if [ "$left" -lt 10 ]; then
            echo "=== $name: skipped, ${left} s left of DEADLINE=$DEADLINE"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "=== $name (limit $limit s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s"
    tail -n 25 "$LOGS/$name.log"
    tar -C /tmp/gpu -czf "$OUT/logs.tgz" logs
}
steps=${*:-tests bench timer graph nccl compare train}
for s in $steps; do
    case $s in
    tests)
        # cuda_* binaries hold only GPU tests; in the nn and trainer ones, select them by name.
        for t in "$BIN"/test-cuda_*; do
            step "$(basename "$t")" "$t" --test-threads 1 --nocapture
        done
        for t in "$BIN"/test-kernels "$BIN"/test-nn "$BIN"/test-trainer "$BIN"/test-decode_cache; do
            [ -x "$t" ] && step "$(basename "$t")" "$t" cuda --test-threads 1 --nocapture
        done
        ;;
    bench) step cuda-bench "$BIN/cuda-bench" ;;
    # Real NCCL: world size 1 against one process (bit for bit), 2 ranks on the GPU where NCCL allows it.
    nccl) step nccl bash bench/gpu/nccl_check.sh "$BIN" ;;
    timer)
        # One step's time per kernel family (CUDA events around every launch) and the step's
        # device counters, for both variants at the measured setting (vocab 256, 32 x 256);
        # where the bundle holds a baseline build (bundle.sh's BASELINE), the same for it.
        for variant in pre-ln transponder; do
            for build in "" -baseline; do
                [ -x "$BIN/train-bench$build" ] || continue
                [ -n "$build" ] && echo "baseline commit $(cat "$BIN/baseline-commit")"
                step "timer-$variant$build" "$BIN/train-bench$build" --model llama-60m --variant "$variant" \
                    --batch 32 --seq 256 --steps 3 --warmup 2 --device cuda --bf16 --kernel-timer
            done
        done
        ;;
    graph)
        # The step replayed as a CUDA graph against the same steps queued eagerly, both variants,
        # at the anchor's shape (vocab 32,000, batch 64 x 256): compare queued_tokens_per_s and
        # the counters. Then 20 training steps eagerly and with --cuda-graph: the logged losses
        # must be the same, bit for bit (graph-losses.log says).
        for variant in pre-ln transponder; do
            for mode in eager graph; do
                flag=""
                [ "$mode" = graph ] && flag="--cuda-graph"
                step "graph-$variant-$mode" "$BIN/train-bench" --model llama-60m --variant "$variant" --vocab 32000 \
                    --batch 64 --seq 256 --steps 10 --warmup 2 --device cuda --bf16 $flag
            done
        done
        for mode in eager graph; do
            flag=""
            [ "$mode" = graph ] && flag="--cuda-graph"
            step "train-60m-$mode" "$BIN/transponder" train --device cuda --bf16 $flag --model llama-60m \
                --variant transponder --tokenizer gpt2 --batch-size 64 --seq-len 256 --lr 1e-3 --steps 20 \
                --log-every 1 --eval-every 0 --save-every 0 --out-dir "/tmp/gpu/run-60m-$mode"
        done
        step graph-losses python3 -c '
import json, sys
rows = [[json.loads(l)["loss"] for l in open(f"/tmp/gpu/run-60m-{m}/metrics.jsonl")] for m in ("eager", "graph")]
print("eager", rows[0]); print("graph", rows[1]); print("same bits:", rows[0] == rows[1]); sys.exit(rows[0] != rows[1])'
        ;;
    # The issue-28 anchor (vocab 32,000, batch 64 x 256), ours beside PyTorch eager, compile and
    # compile + CUDA graphs, one process each (compiling takes most of the time: its own limit,
    # COMPARE_TIMEOUT, default 480 s). COMPARE_ARGS: other gpu_compare.py flags, e.g.
    # "--repeats 2" or "--vocab 256 --batch 32" (the setting of the 2026-11-26 numbers).
    compare)
        STEP_TIMEOUT=${COMPARE_TIMEOUT:-480} step gpu-compare python3 bench/gpu_compare.py \
            --transponder-bin "$BIN/train-bench" --anchor --repeats 1 ${COMPARE_ARGS:-}
        ;;
    train)
        # llama-60m + Transponder on tinyshakespeare with GPT-2 tokens, 64 x 256 tokens a step.
        step train-60m "$BIN/transponder" train --device cuda --bf16 --model llama-60m --variant transponder \
            --tokenizer gpt2 --batch-size 64 --seq-len 256 --lr 1e-3 --steps "${TRAIN_STEPS:-300}" --out-dir /tmp/gpu/run-60m
        cp /tmp/gpu/run-60m/metrics.jsonl "$LOGS/train-60m-metrics.jsonl"
        ;;
    *) echo "unknown step $s" ;;
    esac
done
tar -C /tmp/gpu -czf "$OUT/logs.tgz" logs
