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


def _probe(before: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)],
                         env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


# one training step, on 8 synthetic 8x8 images
TRAIN = ("from tandem.cli.main import main; main(['train', '-a', 'cifar_resnet20', '--data', "
         "'synthetic', '--synthetic-size', '8', '--image-size', '8', '--num-classes', '2', "
         "'-b', '8', '--epochs', '1', '--no-progress', '--out', {out!r}])")


@glibc
def test_a_training_run_tunes_the_allocator_and_nothing_else_does(tmp_path):
    assert _probe(TRAIN.format(out=str(tmp_path / "run"))) == "tuned"
    # a command that trains nothing leaves glibc as it is
    assert _probe("from tandem.cli.main import main; main(['models'])") == "default"
    assert _probe("pass") == "default"  # importing tandem alone changes nothing


@glibc
def test_tandem_malloc_default_keeps_glibc_s_behaviour(tmp_path):
    before = TRAIN.format(out=str(tmp_path / "run"))
    assert _probe(before, TANDEM_MALLOC="default") == "default"


@glibc
def test_glibc_takes_both_thresholds():
    from tandem import cpu_malloc

    cpu_malloc._done = None
    try:
        assert cpu_malloc.tune() is True
        assert cpu_malloc.tune() is True  # once per process, then the kept answer
    finally:
        cpu_malloc._done = None
