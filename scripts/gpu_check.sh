#!/usr/bin/env bash
# One command for a GPU machine (issue 30): every CUDA-marked test, then resnet50 at 224 px,
# batch 256, through `tandem bench`, then the train loop fed from JPEGs it writes (issue 34);
# one summary line per step (PASS/FAIL/SKIP, img/s) in
# OUT/summary.txt, each bench's JSON next to it. About 8 minutes on one H100, compiles included.
#
#   scripts/gpu_check.sh [OUT]            (default OUT: runs/gpu_check)
#   scripts/gpu_check.sh --dry-run [OUT]  (or CPU=1): the same steps, tiny, on the CPU
#   (SKIP_TESTS=1 leaves out the tests' step)
#
# Needs only a CUDA torch (python3; pytest for the tests); torchvision, simplejpeg or Pillow
# if present. Uses the repo's .venv if there is one, else python3 with PYTHONPATH=src; installs
# nothing.
set -u
cd "$(dirname "$0")/.."
DRY=${CPU:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT dry_run=$DRY"
  $PY -c "import torch; print('# torch', torch.__version__, 'device',
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
} > "$SUMMARY"

if [ "$DRY" = 1 ]; then  # the same steps, tiny, on the CPU (no autocast: bf16 needs AVX512-BF16)
  ARCH=(-a cifar_resnet20 --image-size 32 -b 4 --steps 1 --warmup 1)
  ONE=cpu; TWO=cpu:2; AMP16=(); AMP_BF=()
else
  ARCH=(-a resnet50 --image-size 224 -b 256 --steps 30 --warmup 5)
  ONE=cuda:0; TWO=cuda:0,0
  AMP16=(--amp --amp-dtype fp16 --channels-last); AMP_BF=(--amp --amp-dtype bf16 --channels-last)
fi

# name, then the command; a line per step in the summary
step_tests() {
  local log="$OUT/cuda_tests.log"
  if [ "${SKIP_TESTS:-0}" = 1 ]; then
    echo "SKIP cuda_tests: SKIP_TESTS=1" >> "$SUMMARY"; return
  fi
  if ! $PY -c "import pytest" 2>/dev/null; then
    echo "SKIP cuda_tests: pytest is not installed" >> "$SUMMARY"; return
  fi
  local args=(-m cuda tests -q -p no:cacheprovider)
  [ "$DRY" = 1 ] && args+=(--collect-only)
  $PY -m pytest "${args[@]}" > "$log" 2>&1
  local rc=$? tail; tail=$(grep -E "passed|failed|error|skipped|selected|collected" "$log" | tail -1)
  if [ $rc = 0 ]; then echo "PASS cuda_tests: $tail" >> "$SUMMARY"
  else echo "FAIL cuda_tests (rc $rc): $tail (see cuda_tests.log)" >> "$SUMMARY"; fi
}

bench() {  # bench NAME ARGS...: one tandem bench, its JSON, a summary line per contestant
  local name=$1; shift
  $PY -m tandem bench "${ARCH[@]}" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  $PY - "$OUT/$name.json" "$name" "$rc" >> "$SUMMARY" <<'PYEOF'
import json, sys
path, name, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"FAIL {name}: no report (rc {rc}; see {name}.log): {exc}")
    raise SystemExit
for r in report.get("results", []):
    ips = (r.get("images_per_sec") or {}).get("median")
    word = "PASS" if r.get("status") == "ok" else "FAIL"
    figure = f"{ips:.1f} img/s" if ips else r.get("reason", r.get("status"))
    print(f"{word} {name} {r['name']}: {figure}")
PYEOF
}

# Issue 34 ("Feed the GPU"): `tandem bench --data DIR -a ARCH` on JPEGs written here
# (benchmarks/make_jpegs.py, 500x375): loader, step and the train loop fed by the loader
# (fed), a line each, then fed / min(loader, step) against the issue's 0.95x (no target dry).
step_fed() {
  local name=fed_from_files jpegs="$OUT/jpegs" sizes fed
  if [ "$DRY" = 1 ]; then
    sizes=(--classes 2 --per-class 6)
    fed=(-a cifar_resnet20 --image-size 16 -b 4 -j 1 --steps 1 --warmup 0 --threads 1)
  else
    local cores; cores=$(nproc); local workers=$(( cores > 3 ? cores - 2 : 1 ))
    sizes=(--classes 8 --per-class 250)
    fed=(-a resnet50 --image-size 224 -b 256 -j "$workers" --steps 3 --warmup 1 "${AMP16[@]}")
  fi
  [ -d "$jpegs" ] || $PY benchmarks/make_jpegs.py "$jpegs" "${sizes[@]}" > "$OUT/$name.log" 2>&1
  $PY -m tandem bench --data "$jpegs" "${fed[@]}" --devices "$ONE" --json "$OUT/$name.json" \
    >> "$OUT/$name.log" 2>&1
  local rc=$?
  $PY - "$OUT/$name.json" "$name" "$rc" "$DRY" >> "$SUMMARY" <<'PYEOF'
import json, sys
path, name, rc, dry = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"FAIL {name}: no report (rc {rc}; see {name}.log): {exc}")
    raise SystemExit
rates = {r["name"]: r["images_per_sec"]["median"] for r in report["results"]}
for n, ips in rates.items():
    print(f"PASS {name} {n}: {ips:.1f} img/s")
ratio, target = report["ratio"], 0.95
word = "PASS" if dry or ratio >= target else "FAIL"
print(f"{word} {name} fed / min(loader, step): {ratio:.2f}x (fed {rates['fed']:.1f} img/s, "
      f"the {report['limit']} is the limit; "
      + ("dry run: no target)" if dry else f"target {target}x)"))
PYEOF
}

step_tests
bench fp16 --devices "$ONE" --strategies single --baselines bare --loop "${AMP16[@]}"
bench bf16 --devices "$ONE" --strategies single --baselines bare --loop "${AMP_BF[@]}"
if [ "$DRY" = 1 ]; then
  echo "SKIP compile: --compile is not dry-run on the CPU (minutes of C++ compilation)" >> "$SUMMARY"
else
  bench compile --devices "$ONE" --strategies single --baselines bare --compile "${AMP16[@]}"
fi
bench dp --devices "$TWO" --strategies single,dp --baselines bare "${AMP16[@]}"
step_fed

cat "$SUMMARY"
! grep -q "^FAIL" "$SUMMARY"
