#!/usr/bin/env bash
# Real NCCL on the GPU machine (run by bench/gpu/run.sh's `nccl` step): which NCCL the image
# has, then data parallel at world size 1 through `transponder launch` against the same run as
# one plain process (a 1-rank all-reduce is a copy: the losses must agree bit for bit), and,
# where NCCL is 2.30 or newer, 2 ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE) against one
# process with --grad-accum 2. Prints what it could not run and why.
#
#     bash bench/gpu/nccl_check.sh /tmp/gpu/bin
set -uo pipefail
BIN=$1
WORK=/tmp/gpu/nccl
rm -rf "$WORK" && mkdir -p "$WORK"
python3 -m pip show nvidia-nccl-cu13 2>/dev/null | grep -E '^(Name|Version|Location):'
lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -z "$lib" ] || [ ! -f "$lib" ]; then
    lib=$(ldconfig -p | awk '/libnccl\.so/ {print $NF; exit}')
fi
if [ -z "$lib" ] || [ ! -f "$lib" ]; then
    echo "no libnccl found (pip nvidia-nccl-cu13 or the system's): the NCCL checks cannot run"
    exit 1
fi
echo "NCCL library: $lib"
export TRANSPONDER_NCCL_LIB=$lib
run="train --device cuda --variant pre-ln --d-model 64 --batch-size 4 --seq-len 64 --steps 20 --warmup 2 \
    --schedule constant --eval-every 0 --save-every 20 --log-every 1"
same_losses() {
    python3 - "$1" "$2" <<'PY'
import json, struct, sys
def rows(d):
    return [(r["step"], struct.pack("<f", r["loss"]), struct.pack("<f", r["grad_norm"]))
            for r in map(json.loads, open(d + "/metrics.jsonl"))]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
print(f"{len(a)} steps; bit-identical losses and gradient norms: {a == b}")
sys.exit(0 if a == b and a else 1)
PY
}
"$BIN/transponder" $run --out-dir "$WORK/single" | tail -n 2
"$BIN/transponder" launch --nproc-per-node 1 --master-port 29511 -- $run --out-dir "$WORK/w1" | tail -n 3
echo "world size 1 (real NCCL) vs one process:"
same_losses "$WORK/single" "$WORK/w1"
status=$?
wheel=$(python3 -c 'from importlib.metadata import version; print(version("nvidia-nccl-cu13"))' 2>/dev/null || echo unknown)
minor=$(python3 -c 'import sys; v = sys.argv[1].split("."); print(int(v[0]) * 100 + int(v[1]))' "$wheel" 2>/dev/null || echo 0)
if [ "$minor" -ge 230 ]; then
    "$BIN/transponder" $run --grad-accum 2 --out-dir "$WORK/accum2" | tail -n 1
    NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=4 "$BIN/transponder" launch --nproc-per-node 2 --master-port 29512 -- \
        $run --out-dir "$WORK/w2" | tail -n 3
    echo "2 ranks on one GPU (real NCCL) vs one process with --grad-accum 2:"
    same_losses "$WORK/accum2" "$WORK/w2" || status=1
else
    echo "2 ranks on one GPU: skipped, NCCL before 2.30 refuses two ranks on one device (found nvidia-nccl-cu13 $wheel)"
fi
exit $status
