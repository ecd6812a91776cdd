#!/usr/bin/env bash
# BENCHMARKS.md table 8 (the ImageFolder input pipeline), from nothing: it writes its JPEGs,
# prints the date, CPU model and load, then races the pipelines and times the decoders.
#
#   benchmarks/bench_loader.sh [OUTDIR]      # default OUTDIR: runs/bench; PYTHON=.venv/bin/python
#
# 1. `tandem bench --data` at 224 px with -j 0, 1, 2, and at 112 px with -j 0 (where most
#    crops are decoded at reduced DCT scale): loader (simplejpeg), loader-pillow and the
#    torchvision-style reference, interleaved pass by pass; STEPS timed passes each (default 11).
# 2. benchmarks/jpeg_decoders.py at 224 and 112 px: each decode and resample way alone.
# Each writes its JSON into OUTDIR. On a shared machine, read the paired ratios, not img/s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/bench}
STEPS=${STEPS:-11}
mkdir -p "$OUT"
date -u
lscpu | grep -E "^(Model name|CPU\(s\)):" || true
uptime
test -d "$OUT/jpegs" || "$PY" benchmarks/make_jpegs.py "$OUT/jpegs" --classes 4 --per-class 64
set -x
for j in 0 1 2; do
    "$PY" -m tandem bench --data "$OUT/jpegs" --image-size 224 -j "$j" --steps "$STEPS" \
        --json "$OUT/loader_j$j.json"
done
"$PY" -m tandem bench --data "$OUT/jpegs" --image-size 112 -j 0 --steps "$STEPS" \
    --json "$OUT/loader_112_j0.json"
"$PY" benchmarks/jpeg_decoders.py "$OUT/jpegs" --image-size 224 --rounds 7 \
    --json "$OUT/decoders_224.json"
"$PY" benchmarks/jpeg_decoders.py "$OUT/jpegs" --image-size 112 --rounds 7 \
    --json "$OUT/decoders_112.json"
uptime
