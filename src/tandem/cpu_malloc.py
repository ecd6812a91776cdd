"""Keep glibc's malloc from giving a training step's memory back to the system every step.

A CPU training step frees and allocates again the same megabytes of activations and
gradients. By default glibc serves blocks over its mmap threshold with fresh ``mmap`` and
returns free memory at the top of the heap to the system past its trim threshold, both
thresholds moving as the program runs, so a step can fault its memory in again page by page.
:func:`tune` fixes the mmap threshold at glibc's largest (32 MiB on 64-bit) and the trim
threshold at 2 GiB, as a caching allocator would: the process keeps its peak memory between
steps; BENCHMARKS.md section 11 measures what it saves. ``TANDEM_MALLOC=default`` keeps glibc's own
behaviour (the caller says so: ``tune(left_alone=True)``); where the C library is not glibc
nothing changes.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
_done: bool | None = None


def tune(left_alone: bool = False) -> bool:
    """Set both thresholds once per process (none when ``left_alone``); True when glibc took
    them."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if left_alone:
        return False
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the C library's among them
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only: musl has no mallopt thresholds
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
