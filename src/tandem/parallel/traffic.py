"""Counting the bytes the engine moves between replicas.

Transfers are reported with :func:`record` and summed, by kind and destination replica, by an
open :class:`TrafficMeter`. Counts are *logical*: replicas ``i != j`` on one physical device
still count, so CPU runs report what real devices would move. Free when no meter is open.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["record", "TrafficMeter", "metering"]

_lock = threading.Lock()
_meters: list["TrafficMeter"] = []


def metering() -> bool:
    """True while at least one :class:`TrafficMeter` is open (lets callers skip byte maths)."""
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
