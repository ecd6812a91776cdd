"""A training run keeps glibc's malloc from returning a step's memory every step; commands
that train nothing leave it alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
from tandem import cpu_malloc
{before}
print("tuned" if cpu_malloc._done else "default")
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


def _probe(before: str, **env) -> list[str]:
    """The lines a fresh interpreter prints running ``before``, then ``cpu_malloc``'s state."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)],
                         env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().splitlines()


# one training step, on 8 synthetic 8x8 images (TRAIN_ARGS in this process, as run_in_process)
TRAIN_ARGS = ["train", "-a", "cifar_resnet20", "--data", "synthetic", "--synthetic-size", "8",
              "--image-size", "8", "--num-classes", "2", "-b", "8", "--epochs", "1",
              "--no-progress"]


def _train_in_process(out, monkeypatch) -> bool | None:
    """``cpu_malloc._done`` after one training run through cli.main in this process, the
    module's once-per-process answer cleared first (as in a fresh process)."""
    from conftest import run_in_process
    from tandem import cpu_malloc

    monkeypatch.setattr(cpu_malloc, "_done", None)  # restored after the test
    result = run_in_process(*TRAIN_ARGS, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return cpu_malloc._done


@glibc
def test_a_training_run_tunes_the_allocator_and_nothing_else_does(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_MALLOC", raising=False)
    assert _train_in_process(tmp_path / "run", monkeypatch) is True
    # importing tandem alone, and a command that trains nothing, leave glibc as it is (a
    # fresh process: nothing else has tuned it)
    lines = _probe("print('imported:', 'tuned' if cpu_malloc._done else 'default'); "
                   "from tandem.cli.main import main; main(['models'])")
    assert lines[0] == "imported: default" and lines[-1] == "default", lines


@glibc
def test_tandem_malloc_default_keeps_glibc_s_behaviour(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_MALLOC", "default")
    assert _train_in_process(tmp_path / "run", monkeypatch) is False


@glibc
def test_glibc_takes_both_thresholds():
    from tandem import cpu_malloc

    cpu_malloc._done = None
    try:
        assert cpu_malloc.tune() is True
        assert cpu_malloc.tune() is True  # once per process, then the kept answer
    finally:
        cpu_malloc._done = None
