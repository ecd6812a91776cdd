"""A meter of the bytes the engine moves between replicas (and ranks), as it moves them.

:func:`record` reports a transfer; each open :class:`TrafficMeter` sums them by kind and
destination. Counts are *logical*: replicas ``i != j`` on one physical device still count, so a
CPU run reports what real devices would move. Free when no meter is open. It measures; the
model of these bytes is :mod:`tandem.hybrid.cost`.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["TrafficMeter"]

_lock = threading.Lock()
_meters: list["TrafficMeter"] = []


def metering() -> bool:
    """True while a :class:`TrafficMeter` is open (callers may skip their byte maths)."""
    return bool(_meters)


def record(kind: str, nbytes: int, dst: int | None = None) -> None:
    """Report ``nbytes`` of ``kind`` traffic, arriving at replica ``dst`` (``None``: unknown)."""
    if not _meters:
        return
    with _lock:
        for meter in _meters:
            meter.by_kind[kind] += nbytes
            meter.by_dst[dst] += nbytes


class TrafficMeter:
    """Sum of recorded traffic while open: ``by_kind``, ``by_dst`` and ``total`` bytes."""

    def __init__(self):
        self.by_kind: dict[str, int] = defaultdict(int)
        self.by_dst: dict[int | None, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __enter__(self) -> "TrafficMeter":
        with _lock:
            _meters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _meters.remove(self)
