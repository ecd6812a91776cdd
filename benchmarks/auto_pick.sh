#!/usr/bin/env bash
# BENCHMARKS.md section 13: what `--strategy auto` picks on cpu:2 (one intra-op thread), how
# long its race takes, and the pick against every other strategy in one interleaved bench.
# Usage: benchmarks/auto_pick.sh [OUT_DIR]   (from the repository root, .venv built)
set -euo pipefail
out=${1:-runs/auto_pick}
mkdir -p "$out"
export OMP_NUM_THREADS=1
tandem=.venv/bin/tandem
# arch, image size, classes (the bench's defaults: 10 for cifar_*, else 1000), global batch
while read -r arch size classes batch; do
  "$tandem" train -a "$arch" --data synthetic --image-size "$size" --num-classes "$classes" \
    -b "$batch" --strategy auto --devices cpu:2 --epochs 1 --max-steps 1 --no-progress \
    --out "$out/$arch" --overwrite | tee "$out/$arch.train.txt"
  "$tandem" bench -a "$arch" --image-size "$size" --num-classes "$classes" -b "$batch" \
    --devices cpu:2 --threads 1 --strategies single,dp,balanced,hybrid --baselines none \
    --steps 5 --warmup 1 --explain | tee "$out/$arch.bench.txt"
done <<'LIST'
alexnet 128 1000 32
cifar_resnet20 32 10 64
resnet18 112 1000 32
LIST
