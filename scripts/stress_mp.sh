#!/bin/bash
# Repeat every test that uses real torch.distributed process groups (marker `distributed`),
# ROUNDS times; odd rounds run beside two busy CPU loops. A flaky multi-process test is a
# defect: this is how we look for one. Usage: scripts/stress_mp.sh [ROUNDS] (default 10).
# Prints one line per round and the failing tests; logs go to $LOGS (default /tmp/stress_mp).
# WORKERS=2 runs each round in two pytest-xdist workers, as `make test` does (default 0: one).
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-10}
LOGS=${LOGS:-/tmp/stress_mp}
PY=${PY:-.venv/bin/python}
WORKERS=${WORKERS:-0}
mkdir -p "$LOGS"
failed=0
for i in $(seq 1 "$ROUNDS"); do
  busy=()
  if [ $((i % 2)) -eq 1 ]; then
    for _ in 1 2; do timeout 3600 "$PY" -c "while True: pass" & busy+=($!); done
  fi
  timeout 2400 "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" -m distributed \
    > "$LOGS/round$i.log" 2>&1
  rc=$?
  [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2>/dev/null
  [ $rc -ne 0 ] && failed=$((failed + 1))
  echo "round $i$([ ${#busy[@]} -gt 0 ] && echo ' (2 busy loops)'): rc=$rc $(tail -1 "$LOGS/round$i.log")"
  grep -E "^(FAILED|ERROR) " "$LOGS/round$i.log"
done
echo "$failed of $ROUNDS rounds failed"
[ $failed -eq 0 ]
