#!/usr/bin/env bash
# The CPU tables behind BENCHMARKS.md. Every figure there comes from one of these commands;
# each writes its full JSON (config, machine, date, every field) next to the printed table.
#
#   benchmarks/bench_cpu.sh [OUTDIR]        # default OUTDIR: runs/bench
#
# Tables:
#   1. engine overhead and strategies: bare torch step vs tandem single, dp, balanced on
#      2 CPU replica threads (cifar_resnet20, global batch 64);
#   2. 1 vs 2 processes: ddp with --devices cpu (1 process) and cpu:2 (2 processes, torchrun);
#   3. hybrid vs dp on alexnet (2 CPU replicas; reduced image size and steps to keep a CPU
#      run in minutes; the --explain plan shows the bytes either way);
#   4. the balanced criterion's bytes to device 0 vs DataParallel's gather (a count, not a
#      timing): 21 classes at 64x64, batch 8, over 2 and 4 replicas;
#   5. eager and torch.compile side by side (issue 12): bare, single, dp, balanced, ddp and
#      torch's DDP, each with its "+compile" twin (cifar_resnet20, global batch 128), and
#      the torch.profiler breakdown of an eager and a compiled step;
#   7. the ImageFolder input pipeline against a torchvision-style reference, -j 0, 1 and 2,
#      on 256 generated 500x375 JPEGs (benchmarks/make_jpegs.py; nothing downloaded), and
#      the JPEG decoders alone: benchmarks/bench_loader.sh;
#   9. mixed-speed devices (issue 22): replica/rank 1 handicapped 2x, dp (2 replica threads)
#      and ddp (2 processes x 1 thread), each with an equal split, --split auto and the ideal
#      split, interleaved round by round.
# CPU timings depend on the machine's load: run on a quiet machine, and compare ratios within
# one table (its contestants are interleaved), not absolute numbers across tables.
#
# --threads 1 gives every replica (thread or torchrun process) one intra-op thread, so a CPU
# replica stands for one core, as a GPU replica stands for one GPU. It also keeps OpenMP's
# barrier stalls off a shared machine: with 2 threads per op under load we saw step times
# vary 5x. Set THREADS=N to give each replica N threads instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/bench}
THREADS=${THREADS:-1}
mkdir -p "$OUT"
tandem() { "$PY" -m tandem "$@"; }
set -x
tandem bench --arch cifar_resnet20 --strategies single,dp,balanced --devices cpu:2 \
    --batch-size 64 --steps 20 --warmup 3 --threads "$THREADS" --json "$OUT/cpu_strategies.json"
tandem bench --arch cifar_resnet20 --strategies single,ddp --devices cpu --baselines bare \
    --batch-size 64 --steps 20 --warmup 3 --threads "$THREADS" --json "$OUT/cpu_ddp_1proc.json"
tandem bench --arch cifar_resnet20 --strategies single,ddp --devices cpu:2 --baselines bare \
    --batch-size 64 --steps 20 --warmup 3 --threads "$THREADS" --json "$OUT/cpu_ddp_2proc.json"
tandem bench --arch alexnet --strategies single,dp,hybrid --devices cpu:2 --baselines bare \
    --image-size 128 --batch-size 32 --steps 10 --warmup 2 --threads "$THREADS" --explain \
    --json "$OUT/cpu_alexnet_hybrid.json"
tandem bench --arch cifar_resnet20 --strategies dp,ddp --devices cpu:2 --handicap 1:2 \
    --baselines none --batch-size 64 --steps 30 --warmup 5 --threads "$THREADS" --explain \
    --json "$OUT/cpu_split_handicap.json"
"$PY" benchmarks/criterion_bytes.py --replicas 2 4 --json "$OUT/criterion_bytes.json"
tandem bench --arch cifar_resnet20 --strategies single,dp,balanced,ddp --devices cpu:2 \
    --batch-size 128 --steps 10 --warmup 2 --threads "$THREADS" --compile --dist-timeout 1800 \
    --json "$OUT/cpu_compile.json"
"$PY" benchmarks/profile_compile.py --batch-size 128 --threads "$THREADS" --steps 3 \
    > "$OUT/profile_compile.txt"
PYTHON="$PY" benchmarks/bench_loader.sh "$OUT"  # table 8: its own script, runnable alone
tandem bench --arch cifar_resnet20 --strategies single,dp --devices cpu:2 --batch-size 64 \
    --steps 30 --warmup 5 --loop --baselines none --json "$OUT/cpu_loop.json"  # table 11
