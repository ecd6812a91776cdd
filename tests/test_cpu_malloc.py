"""The tandem command keeps glibc's malloc from returning a step's memory every step."""

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


@glibc
def test_the_command_tunes_the_allocator_once():
    assert _probe("from tandem.cli.main import main; main(['models'])") == "tuned"
    assert _probe("pass") == "default"  # importing tandem alone changes nothing


@glibc
def test_tandem_malloc_default_keeps_glibc_s_behaviour():
    before = "from tandem.cli.main import main; main(['models'])"
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
