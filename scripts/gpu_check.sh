#!/usr/bin/env bash
# One command for a GPU machine (issues 30 and 34): every CUDA-marked test, the train loop fed
# from JPEGs it writes (CPU decode, and --decode gpu in fp16 and bf16), then resnet50 at 224 px,
# batch 256, through `tandem bench`. One summary line per step (PASS/FAIL/SKIP, img/s) in
# OUT/summary.txt and on stdout, written as each step ends (a run cut short still says what it
# saw), the failing tests named, with each bench's JSON and log next to it. The JPEGs go to
# JPEGS (default runs/gpu_check_jpegs_8x1920, outside OUT; a dry run: OUT/jpegs), kept for a rerun.
# At most 8 minutes on one H100, compiles included: BUDGET_S (default 480) bounds the whole:
# each step runs under a timeout, and a step that no longer fits is a SKIP line. The steps run
# in the order of what matters most (the compile, slowest, comes last).
#
#   scripts/gpu_check.sh [OUT]            (default OUT: runs/gpu_check)
#   scripts/gpu_check.sh --dry-run [OUT]  (or CPU=1): the same steps, tiny, on the CPU
#   (SKIP_TESTS=1 leaves out the tests' step; ONLY=fp16,fed_gpu_decode runs just those steps,
#   e.g. to rerun what failed)
#
# Needs only a CUDA torch (python3; pytest for the tests, pytest-xdist used if present);
# torchvision, simplejpeg or Pillow if present. Uses the repo's .venv if there is one, else
# python3 with PYTHONPATH=src; installs nothing.
set -u
cd "$(dirname "$0")/.."
DRY=${CPU:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-runs/gpu_check}
BUDGET=${BUDGET_S:-480}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # absolute: tests run tandem elsewhere
SUMMARY="$OUT/summary.txt"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
say() { echo "$*" | tee -a "$SUMMARY"; }  # a summary line, on stdout as well
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT dry_run=$DRY budget ${BUDGET}s"
  $PY -c "import torch; print('# torch', torch.__version__, 'device',
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
  $PY -c "import torchvision; print('# torchvision', torchvision.__version__)" 2>/dev/null \
    || echo "# torchvision: not installed (--decode gpu steps will say so)"
  $PY -c "import simplejpeg; print('# simplejpeg', simplejpeg.__version__)" 2>/dev/null \
    || echo "# simplejpeg: not installed (the CPU decode is Pillow's)"
} | tee "$SUMMARY"
if [ "$DRY" = 0 ] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  say "FAIL cuda: torch.cuda.is_available() is False here (use --dry-run on a CPU machine)"
  exit 1
fi

if [ "$DRY" = 1 ]; then  # the same steps, tiny, on the CPU (no autocast: bf16 needs AVX512-BF16)
  ARCH=(-a cifar_resnet20 --image-size 32 -b 4 --steps 1 --warmup 1)
  # no fp16 on the CPU; bf16 emulated where the CPU lacks it (slow, but the same code path)
  ONE=cpu; TWO=cpu:2; AMP16=(); AMP_BF=(--amp --amp-dtype bf16 --channels-last)
  export TANDEM_CPU_BF16=1
else
  ARCH=(-a resnet50 --image-size 224 -b 256 --steps 30 --warmup 5)
  ONE=cuda:0; TWO=cuda:0,0
  AMP16=(--amp --amp-dtype fp16 --channels-last); AMP_BF=(--amp --amp-dtype bf16 --channels-last)
fi

# allowed NAME CAP [LEAST]: the seconds step NAME may take (CAP, or what is left of the
# budget); prints nothing and writes a SKIP line when under LEAST (default 20) s are left.
allowed() {
  local left=$(( BUDGET - SECONDS )) least=${3:-20}
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$1,"* ]]; then
    say "SKIP $1: not in ONLY=$ONLY" >&2; return 1
  fi
  if [ "$left" -lt "$least" ]; then
    say "SKIP $1: under $least s of the budget (${BUDGET}s) are left" >&2; return 1
  fi
  echo $(( left < $2 ? left : $2 ))
}

step_tests() {
  local log="$OUT/cuda_tests.log" t
  if [ "${SKIP_TESTS:-0}" = 1 ]; then
    say "SKIP cuda_tests: SKIP_TESTS=1"; return
  fi
  if ! $PY -c "import pytest" 2>/dev/null; then
    say "SKIP cuda_tests: pytest is not installed"; return
  fi
  t=$(allowed cuda_tests 240) || return
  rm -rf "$OUT/measured"  # a rerun's figures only
  # a test module that cannot import here (a missing optional package) costs only itself
  # -v: a line per test as it ends, so a run cut by the timeout still says what it saw
  # torchvision: the tests against the real torchvision, which the GPU machine has
  local args=(-m "cuda or torchvision" tests -v -p no:cacheprovider -rfEw
              --continue-on-collection-errors)
  [ "$DRY" = 1 ] && args+=(--collect-only)
  $PY -c "import xdist" 2>/dev/null && [ "$DRY" = 0 ] && args+=(-n 4)
  TANDEM_MEASURE_DIR="$OUT/measured" timeout -k 10 "$t" $PY -m pytest "${args[@]}" > "$log" 2>&1
  local rc=$? tail seen
  local counts="[0-9]+ (passed|failed|errors?|skipped|deselected)|tests? collected"
  tail=$(grep -E "$counts" "$log" | tail -1 | sed -E "s/^=+ //; s/ =+$//")
  seen="$(grep -c " PASSED" "$log") passed, $(grep -c -E " (FAILED|ERROR)" "$log") failed so far"
  if [ $rc = 0 ]; then say "PASS cuda_tests: $tail"
  elif [ $rc = 124 ]; then say "FAIL cuda_tests: timed out after ${t}s, $seen (see cuda_tests.log)"
  else say "FAIL cuda_tests (rc $rc): $tail (see cuda_tests.log)"; fi
  # each failing test by name, with the start of its reason (pytest's short summary)
  grep -E "^(FAILED|ERROR) " "$log" | head -20 | cut -c1-300 | while IFS= read -r line; do
    say "  $line"; done
  # what the tests measured (tests/conftest.py write_measured), a line each
  for f in "$OUT"/measured/*.json; do
    [ -e "$f" ] && say "MEASURED $(basename "$f" .json): $(tr -d ' \n' < "$f")"
  done
}

# report NAME RC SECONDS [KEY TARGET]: NAME.json's summary lines, a line per contestant (FAIL
# where its status is not ok), then with KEY its report[KEY] ratio against TARGET (no target
# in a dry run); a missing report is one FAIL line saying why, with its log's last lines
report() {
  $PY - "$OUT/$1.json" "$OUT/$1.log" "$@" "$DRY" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
path, log, name, rc, t, *ratio, dry = sys.argv[1:]
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    why = f"timed out after {t}s" if rc == "124" else f"rc {rc}"
    print(f"FAIL {name}: no report ({why}; see {name}.log): {exc}")
    try:
        tail = [line.rstrip()[:300] for line in open(log, errors="replace")][-3:]
    except OSError:
        tail = []
    for line in tail:
        print(f"  {line}")
    raise SystemExit
for r in report.get("results", []):
    ips = (r.get("images_per_sec") or {}).get("median")
    word = "PASS" if r.get("status", "ok") == "ok" and ips else "FAIL"
    figure = f"{ips:.1f} img/s" if ips else r.get("reason", r.get("status", "no rate"))
    extra = "".join(f", {label} {r[key]:{form}}" for key, label, form in (
        ("startup_seconds", "start-up s", ".2f"), ("data_share", "data wait", ".0%"))
        if r.get(key) is not None)
    print(f"{word} {name} {r['name']}: {figure}{extra}")
if ratio:
    key, target, dry = ratio[0], float(ratio[1]), dry == "1"
    rates = {r["name"]: (r.get("images_per_sec") or {}).get("median") for r in report["results"]}
    what = "fed / min(loader, step)" if key == "ratio" else "fed / step"
    value = report.get(key)
    if value is None or rates.get("fed") is None:
        print(f"FAIL {name} {what}: no ratio (a contestant has no rated pass; see {name}.log)")
        raise SystemExit
    word = "PASS" if dry or value >= target else "FAIL"
    print(f"{word} {name} {what}: {value:.2f}x (fed {rates['fed']:.1f} img/s, decode on "
          f"the {report['config']['decode']}, the {report['limit']} is the limit; "
          + ("dry run: no target)" if dry else f"target {target}x)"))
PYEOF
}

bench() {  # bench NAME CAP LEAST ARGS...: one tandem bench, its JSON, a line per contestant
  local name=$1 cap=$2 least=$3 t; shift 3
  t=$(allowed "$name" "$cap" "$least") || return
  rm -f "$OUT/$name.json"  # never a previous run's
  timeout -k 10 "$t" $PY -m tandem bench "${ARCH[@]}" "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  report "$name" $? "$t"
}

# Issue 34 ("Feed the GPU"): `tandem bench --data DIR -a ARCH` on JPEGs written here
# (benchmarks/make_jpegs.py, 500x375): loader, step and the train loop fed by the loader
# (fed), a line each, then fed's ratio against its target (none in a dry run):
#   fed_NAME DECODE RATIO TARGET AMP...: RATIO is ratio (fed / min(loader, step)) or
#   fed_vs_step.
fed() {
  local name=fed_$1 decode=$2 ratio=$3 target=$4 jpegs sizes args t; shift 4
  t=$(allowed "$name" 150) || return
  rm -f "$OUT/$name.json"  # never a previous run's
  if [ "$DRY" = 1 ]; then
    sizes=(--classes 2 --per-class 6); jpegs=${JPEGS:-$OUT/jpegs}
    args=(-a cifar_resnet20 --image-size 16 -b 4 -j 1 --steps 1 --warmup 0 --threads 1)
  else
    # the cores less 2 for the workers, 16 at most: 80% of 8 x 1920 to train is 48 batches
    # of 256, three waves of 16 workers' batches (the bench rates a pass after its first
    # wave and needs two at least)
    local cores; cores=$(nproc); local workers=$(( cores > 3 ? cores - 2 : 1 ))
    workers=$(( workers > 16 ? 16 : workers ))
    sizes=(--classes 8 --per-class 1920); jpegs=${JPEGS:-runs/gpu_check_jpegs_8x1920}
    args=(-a resnet50 --image-size 224 -b 256 -j "$workers" --steps 3 --warmup 1)
  fi
  : > "$OUT/$name.log"
  # written aside and then renamed, under the step's timeout: a cut run leaves no half tree;
  # the bench then has what is left of the step's time (the budget's, too)
  if [ ! -d "$jpegs" ]; then
    local began=$SECONDS
    rm -rf "$jpegs.part" && timeout -k 10 "$t" $PY benchmarks/make_jpegs.py "$jpegs.part" \
      "${sizes[@]}" >> "$OUT/$name.log" 2>&1 && mv "$jpegs.part" "$jpegs"
    t=$(( t - (SECONDS - began) ))
    [ "$t" -lt 10 ] && t=10
  fi
  timeout -k 10 "$t" $PY -m tandem bench --data "$jpegs" "${args[@]}" "$@" --decode "$decode" \
    --devices "$ONE" --json "$OUT/$name.json" >> "$OUT/$name.log" 2>&1
  report "$name" $? "$t" "$ratio" "$target"
}

step_tests
# the CPU decoders against the step (issue 34 item 3), then nvJPEG (item 4), fp16 and bf16;
# in a dry run --decode gpu cannot run: auto (the CPU) stands in, and bf16 is fp16 there
fed cpu_decode cpu ratio 0.95 "${AMP16[@]}"
if [ "$DRY" = 1 ]; then
  fed gpu_decode auto fed_vs_step 0.9
  fed gpu_decode_bf16 auto fed_vs_step 0.9 "${AMP_BF[@]}"
else
  fed gpu_decode gpu fed_vs_step 0.9 "${AMP16[@]}"
  fed gpu_decode_bf16 gpu fed_vs_step 0.9 "${AMP_BF[@]}"
fi
bench fp16 60 20 --devices "$ONE" --strategies single --baselines bare --loop "${AMP16[@]}"
bench bf16 60 20 --devices "$ONE" --strategies single --baselines bare --loop "${AMP_BF[@]}"
bench dp 90 20 --devices "$TWO" --strategies single,dp --baselines bare "${AMP16[@]}"
if [ "$DRY" = 1 ]; then
  say "SKIP compile: --compile is not dry-run on the CPU (minutes of C++ compilation)"
else  # two compiles of about 53 s each on an H100: not started without the time for them
  bench compile 200 150 --devices "$ONE" --strategies single --baselines bare --compile \
    "${AMP16[@]}"
fi
say "# done in ${SECONDS}s"
! grep -q "^FAIL" "$SUMMARY"
