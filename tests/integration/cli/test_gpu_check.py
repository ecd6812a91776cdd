"""scripts/gpu_check.sh's dry run (its GPU steps, tiny, on the CPU) writes the summary with a
line per step and a JSON per bench: what a GPU machine runs is exercised here first."""

import json
import os
import subprocess

import pytest
from conftest import ROOT

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
                 "PASS bf16 single/loop:", "PASS dp dp:", "SKIP compile:",
                 "PASS fed_cpu_decode loader:", "PASS fed_cpu_decode step:",
                 "PASS fed_cpu_decode fed:", "PASS fed_cpu_decode fed / min(loader, step):",
                 "PASS fed_gpu_decode fed / step:", "PASS fed_gpu_decode_bf16 fed / step:",
                 "# done in"):
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert all(" img/s" in line for line in lines if line.startswith("PASS"))
    assert not any(line.startswith("FAIL") for line in lines), lines
    fed_row = next(line for line in lines if line.startswith("PASS fed_cpu_decode fed:"))
    assert "start-up s" in fed_row and "data wait" in fed_row, fed_row
    # bf16 autocast ran (emulated on a CPU without it) and was reported so
    assert json.loads((tmp_path / "bf16.json").read_text())["config"]["amp_dtype"] == "bf16"


def test_a_failing_step_is_named_with_its_log_and_the_script_fails(tmp_path):
    """A bench that dies leaves a FAIL line with its log's last lines, on stdout too (what
    comes back from a GPU machine may be stdout alone); a previous run's JSON is not read."""
    repo = tmp_path / "repo"  # the same script, its fp16 bench given a bad flag, in a tree
    (repo / "scripts").mkdir(parents=True)  # whose code is this one's
    for name in ("src", "benchmarks", ".venv"):
        if (ROOT / name).exists():
            (repo / name).symlink_to(ROOT / name)
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    bad = 'bench fp16 60 20 --no-such-flag --devices "$ONE"'
    (repo / "scripts" / "gpu_check.sh").write_text(
        script.replace('bench fp16 60 20 --devices "$ONE"', bad))
    out = tmp_path / "out"
    out.mkdir()
    (out / "fp16.json").write_text('{"results": [{"name": "stale"}]}')
    env = dict(os.environ, OMP_NUM_THREADS="1", ONLY="fp16")
    result = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "--dry-run",
                             str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "FAIL fp16: no report (rc 2; see fp16.log)" in result.stdout, result.stdout
    assert "--no-such-flag" in result.stdout  # the log's last lines follow
    summary = (out / "summary.txt").read_text()
    assert "stale" not in summary and "SKIP fed_cpu_decode: not in ONLY=fp16" in summary


def test_a_spent_budget_skips_the_steps_that_no_longer_fit(tmp_path):
    """BUDGET_S bounds the whole check: with none left, every step is a SKIP line (nothing
    runs) and the script still writes its summary and succeeds."""
    lines = _dry_run(tmp_path, 120, BUDGET_S="0")
    for name in ("fed_cpu_decode", "fed_gpu_decode", "fp16", "dp"):
        assert f"SKIP {name}: under 20 s of the budget (0s) are left" in lines, (name, lines)
    assert not list(tmp_path.glob("*.json"))
