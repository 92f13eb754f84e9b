#!/usr/bin/env bash
# The CoMT Fashion-MNIST grids (RESULTS.md: ResNet-18 and ResNet-50 × none / pixel /
# sliding-window × 3 seeds) on one GPU, from the bundle that bench/gpu/bundle.sh packs: one
# `transponder compare` process per (grid, seed), all at once, since these small ResNets
# leave most of the GPU idle. Needs data/external/fashion-mnist/ beside the repository
# (carry it) and takes the same arguments as bench/real-data-grids.sh's image grids.
# Finished runs' small files (no checkpoints) are packed into $OUT/comt-grid.tgz when the
# workers end or GRID_TIMEOUT (seconds, default 900) runs out; rerunning resumes. On an H100
# with the six processes side by side, a ResNet-18 run took 99-150 s and a ResNet-50 run
# 155-270 s (one ResNet-18 run alone: 21 s), so the whole grid needs about 10 minutes;
# results/compare-h100/ holds such a grid (`out_dir` in config.json and result.json rewritten).
# A fresh machine resumes an earlier call's grid: unpack its comt-grid.tgz into .gpu/ (so
# .gpu/comt/ holds the finished runs) and carry .gpu; those runs are skipped.
#
#     bash bench/gpu/comt_grid.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/gpu && tar -C /tmp/gpu -xJf .gpu/bundle.tar.xz
bin=/tmp/gpu/bin/transponder
if [ -d .gpu/comt ] && [ ! -d /tmp/comt ]; then cp -r .gpu/comt /tmp/comt; fi
grid_args=(--data-dir data/external/fashion-mnist --train-images 10000 --epochs 3 --device cuda --out-dir /tmp/comt)
for grid in fashion-resnet50 fashion-resnet18; do
    for seed in 1337 1338 1339; do
        RAYON_NUM_THREADS=2 timeout "${GRID_TIMEOUT:-900}" "$bin" compare --grid "$grid" --seed "$seed" --seeds 1 \
            "${grid_args[@]}" >"/tmp/comt-$grid-$seed.log" 2>&1 &
    done
done
wait
grep -h "done, accuracy" /tmp/comt-*.log
tar -C /tmp -czf "$OUT/comt-grid.tgz" --exclude='*.safetensors' comt $(cd /tmp && ls comt-*.log)
