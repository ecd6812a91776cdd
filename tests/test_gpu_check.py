"""scripts/gpu_check.sh's dry run (its GPU steps, tiny, on the CPU) writes the summary with a
line per step and a JSON per bench: what a GPU machine runs is exercised here first."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _dry_run(out, timeout: int, **env) -> list[str]:
    """The dry run's summary lines (the script must succeed)."""
    env = dict(os.environ, SKIP_TESTS="1", OMP_NUM_THREADS="1", **env)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                             str(out)], capture_output=True, text=True, env=env,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (out / "summary.txt").read_text().splitlines()


def test_the_dry_run_writes_a_summary_and_the_json(tmp_path):
    lines = _dry_run(tmp_path, 600)
    for name in ("fp16", "dp", "fed_cpu_decode", "fed_gpu_decode"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["results"], name
    for want in ("PASS fp16 bare:", "PASS fp16 single:", "PASS fp16 single/loop:",
                 "SKIP bf16:", "PASS dp dp:", "SKIP compile:",
                 "PASS fed_cpu_decode loader:", "PASS fed_cpu_decode step:",
                 "PASS fed_cpu_decode fed:", "PASS fed_cpu_decode fed / min(loader, step):",
                 "PASS fed_gpu_decode fed / step:", "SKIP fed_gpu_decode_bf16:", "# done in"):
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert all(" img/s" in line for line in lines if line.startswith("PASS"))
    assert not any(line.startswith("FAIL") for line in lines), lines


def test_a_spent_budget_skips_the_steps_that_no_longer_fit(tmp_path):
    """BUDGET_S bounds the whole check: with none left, every step is a SKIP line (nothing
    runs) and the script still writes its summary and succeeds."""
    lines = _dry_run(tmp_path, 120, BUDGET_S="0")
    for name in ("fed_cpu_decode", "fed_gpu_decode", "fp16", "dp"):
        assert f"SKIP {name}: under 20 s of the budget (0s) are left" in lines, (name, lines)
    assert not list(tmp_path.glob("*.json"))
