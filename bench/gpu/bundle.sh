#!/usr/bin/env bash
# Builds, on a machine with Rust but no GPU, everything a GPU session runs: the CUDA
# agreement tests, cuda-bench, train-bench and the `transponder` binary, all with the
# `cuda` feature (cudarc loads the CUDA libraries at run time, so no toolkit is needed),
# stripped and packed into .gpu/bundle.tar.xz. The GPU machine has CUDA and PyTorch but no
# Rust: carry `.gpu` there and run `bash bench/gpu/run.sh` (see the README's CUDA section).
#
#     bench/gpu/bundle.sh            # then: echo /.gpu/ >> .git/info/exclude (once)
#     BASELINE=<git ref> bench/gpu/bundle.sh
#
# BASELINE also builds train-bench at that commit (a git worktree under target/, its own
# target directory) as bin/train-bench-baseline, and run.sh's timer step then times both in
# the same run: the before and after of kernels changed by sessions that had no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
FEATURES="kernels/cuda,kernels/nccl,tensor/cuda,autograd/cuda,nn/cuda,models/cuda,trainer/cuda,trainer/nccl,transponder-tests/cuda"
# A separate target directory: stripped, no debug info, and the main build cache untouched.
export CARGO_TARGET_DIR=target/gpu CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
rm -rf .gpu/bin && mkdir -p .gpu/bin
cargo build --release --workspace --features "$FEATURES" --bins
cp target/gpu/release/{transponder,train-bench,cuda-bench} .gpu/bin/
if [ -n "${BASELINE:-}" ]; then
    tree="$PWD/target/gpu-baseline"
    git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
    git worktree prune
    git worktree add --detach "$tree" "$BASELINE"
    (cd "$tree" && CARGO_TARGET_DIR="$PWD/../gpu-baseline-target" \
        cargo build --release --workspace --features "$FEATURES" --bin train-bench)
    cp target/gpu-baseline-target/release/train-bench .gpu/bin/train-bench-baseline
    git -C "$tree" rev-parse HEAD >.gpu/bin/baseline-commit
    git worktree remove --force "$tree"
fi
# Every test binary whose name says cuda (kernels' cuda_agreement, tests/cuda_*), plus the
# binaries that hold cuda-gated tests among others (the kernels, nn and trainer unit tests,
# models' decode_cache), which run.sh filters by name.
cargo test --release --workspace --features "$FEATURES" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    exe, target = msg.get("executable"), msg.get("target", {})
    name = target.get("name", "")
    if exe and msg.get("profile", {}).get("test") and ("cuda" in name or name in ("kernels", "nn", "trainer", "decode_cache")):
        shutil.copy(exe, ".gpu/bin/test-" + name)
        print("bundled", name)
'
tar -C .gpu -cJf .gpu/bundle.tar.xz bin
rm -rf .gpu/bin
ls -l .gpu/bundle.tar.xz
