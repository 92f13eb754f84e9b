#!/usr/bin/env bash
# RESULTS.md's real-data grids, run seed by seed so that the first pairs finish early, then
# summarised. Every step is a `transponder compare` invocation, which skips finished runs
# and resumes interrupted ones from their checkpoint: rerun the same command to continue.
#
#   bench/real-data-grids.sh language   # headline: pre-ln vs transponder (5 seeds), post-ln and sdpa-gate (3)
#   bench/real-data-grids.sh image      # CoMT on Fashion-MNIST: ResNet-18 and ResNet-50 × none/pixel/sliding-window (3)
#
# Needs data/fetch.sh's output in data/external/ (english-byte/, fashion-mnist/) and a
# release build (or TRANSPONDER=path/to/transponder). Results: results/compare/<grid>/, the
# committed grids, whose finished runs are skipped.
# On a shared machine: RAYON_NUM_THREADS=1 nice -n 19 bench/real-data-grids.sh language.
set -euo pipefail

bin=${TRANSPONDER:-target/release/transponder}
out=results/compare

# 1,000 AdamW steps of 16 × 256 byte tokens (4.1M tokens, 20× the tinyshakespeare tables),
# validation on the whole held-out 1% of every text (70 batches) every 250 steps.
language_args=(
    --train-data data/external/english-byte/train.bin --val-data data/external/english-byte/val.bin
    --steps 1000 --batch-size 16 --seq-len 256 --warmup 100 --eval-every 250 --eval-batches 70
    --save-every 100 --out-dir "$out"
)
# 3 epochs over the first 10,000 Fashion-MNIST training images, top-1 on all 10,000 test images.
image_args=(--data-dir data/external/fashion-mnist --train-images 10000 --epochs 3 --out-dir "$out")

language() {
    for seed in 1337 1338 1339 1340 1341; do
        "$bin" compare --grid headline --rows transponder --seed "$seed" --seeds 1 "${language_args[@]}"
    done
    for seed in 1337 1338 1339; do
        "$bin" compare --grid headline --rows post-ln,sdpa-gate --seed "$seed" --seeds 1 "${language_args[@]}"
    done
    "$bin" compare --grid headline --rows transponder --seeds 5 "${language_args[@]}"
    cp "$out/headline/table.md" "$out/headline/table-pre-ln-transponder-5-seeds.md"
    "$bin" compare --grid headline --seeds 3 "${language_args[@]}"
    cp "$out/headline/table.md" "$out/headline/table-4-rows-3-seeds.md"
}

image() {
    for seed in 1337 1338 1339; do
        for grid in fashion-resnet18 fashion-resnet50; do
            "$bin" compare --grid "$grid" --seed "$seed" --seeds 1 "${image_args[@]}"
        done
    done
    for grid in fashion-resnet18 fashion-resnet50; do
        "$bin" compare --grid "$grid" --seeds 3 "${image_args[@]}"
    done
}

case "${1:-}" in
    language) language ;;
    image) image ;;
    *) echo "usage: $0 language|image" >&2; exit 2 ;;
esac
