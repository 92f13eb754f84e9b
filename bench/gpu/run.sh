#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, after bench/gpu/bundle.sh built
# .gpu/bundle.tar.xz here and the device tool carried `.gpu` there. Every step's output goes
# to logs/<step>.log, packed at the end into $OUT/logs.tgz (the device tool returns at most 8
# files), with each step's tail on stdout; a failing step does not stop the others. Each
# step runs under `timeout` (STEP_TIMEOUT seconds, default 240) and the logs are packed
# after every step, so a hung kernel costs one step, not the device call's whole output.
#
#     bash bench/gpu/run.sh [steps...]     # steps: tests bench compare train (default: all)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
LOGS=/tmp/gpu/logs
mkdir -p "$OUT" "$LOGS" && tar -C /tmp/gpu -xJf .gpu/bundle.tar.xz
BIN=/tmp/gpu/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$LOGS/gpu.txt"
step() {
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    timeout "${STEP_TIMEOUT:-240}" "$@" >"$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s"
    tail -n 25 "$LOGS/$name.log"
    tar -C /tmp/gpu -czf "$OUT/logs.tgz" logs
}
steps=${*:-tests bench compare train}
for s in $steps; do
    case $s in
    tests)
        # cuda_* binaries hold only GPU tests; in the nn and trainer ones, select them by name.
        for t in "$BIN"/test-cuda_*; do
            step "$(basename "$t")" "$t" --test-threads 1 --nocapture
        done
        for t in "$BIN"/test-nn "$BIN"/test-trainer; do
            [ -x "$t" ] && step "$(basename "$t")" "$t" cuda --test-threads 1 --nocapture
        done
        ;;
    bench) step cuda-bench "$BIN/cuda-bench" ;;
    compare) step gpu-compare python3 bench/gpu_compare.py --transponder-bin "$BIN/train-bench" ;;
    train)
        # llama-60m + Transponder on tinyshakespeare with GPT-2 tokens, 64 x 256 tokens a step.
        step train-60m "$BIN/transponder" train --device cuda --bf16 --model llama-60m --variant transponder \
            --tokenizer gpt2 --batch-size 64 --seq-len 256 --lr 1e-3 --steps 300 --out-dir /tmp/gpu/run-60m
        cp /tmp/gpu/run-60m/metrics.jsonl "$LOGS/train-60m-metrics.jsonl"
        ;;
    *) echo "unknown step $s" ;;
    esac
done
tar -C /tmp/gpu -czf "$OUT/logs.tgz" logs
