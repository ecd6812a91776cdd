"""scripts/gpu_check.sh's dry run (its GPU steps, tiny, on the CPU) writes the summary with a
line per step and a JSON per bench: what a GPU machine runs is exercised here first."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_dry_run_writes_a_summary_and_the_json(tmp_path):
    env = dict(os.environ, SKIP_TESTS="1", OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                             str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    for name in ("fp16", "bf16", "dp", "fed_from_files"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["results"], name
    for want in ("PASS fp16 bare:", "PASS fp16 single:", "PASS fp16 single/loop:",
                 "PASS bf16 single/loop:", "PASS dp dp:", "SKIP compile:",
                 "PASS fed_from_files loader:", "PASS fed_from_files step:",
                 "PASS fed_from_files fed:", "PASS fed_from_files fed / min(loader, step):"):
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert all(" img/s" in line for line in lines if line.startswith("PASS"))
