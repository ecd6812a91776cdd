"""Keep glibc's malloc from giving a training step's memory back to the system every step.

glibc's moving mmap and trim thresholds make a CPU step fault the megabytes it frees and
takes again in page by page. :func:`tune` fixes the mmap threshold at 32 MiB and the trim
threshold at 2 GiB: the process keeps its peak memory. ``TANDEM_MALLOC=default`` keeps
glibc's own (the caller passes ``left_alone``); without glibc nothing changes.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
_done: bool | None = None


def tune(left_alone: bool = False) -> bool:
    """Set both thresholds once per process (none when ``left_alone``); True if glibc took them."""
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
