"""Clocks, summary statistics and memory readings for the benchmark harness.

Accelerators run asynchronously: a step "returns" long before its kernels finish. Every
reading of the clock is therefore preceded by :func:`synchronize` on the devices the step
used, so a step's time covers its kernels and not only their launch.

Peak memory is read from the device's own allocator statistics (CUDA and device types that
expose the same ``max_memory_allocated`` API). The CPU reports nothing, and its entries are
``None`` ("n/a" in the table) rather than a guess.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import torch

__all__ = [
    "synchronize",
    "clock",
    "Stats",
    "summarize",
    "memory_supported",
    "MemoryProbe",
    "resident_bytes",
]


def _backend(device: torch.device):
    """The ``torch.<type>`` module for an accelerator (``torch.cuda``, ``torch.xpu``), if any."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type, None)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every queued kernel on ``devices`` has finished (no-op for the CPU)."""
    seen = set()
    for device in devices:
        if device in seen:
            continue
        seen.add(device)
        backend = _backend(device)
        sync = getattr(backend, "synchronize", None)
        if sync is None:
            continue
        try:
            sync(device)
        except TypeError:  # some backends (mps) take no device argument
            sync()


def clock() -> float:
    """A monotonic wall clock in seconds (what a user waiting for a step experiences)."""
    return time.perf_counter()


@dataclass(frozen=True)
class Stats:
    """Median and spread of a sample of step times, in seconds."""

    median: float
    q1: float
    q3: float
    iqr: float
    min: float
    max: float
    mean: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples: Sequence[float]) -> Stats:
    """Median, quartiles (inclusive method), min, max and mean of ``samples``.

    Raises ``ValueError`` for an empty sample. One sample gives zero spread.
    """
    if not samples:
        raise ValueError("no timed steps to summarize")
    values = sorted(float(s) for s in samples)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Stats(
        median=statistics.median(values), q1=q1, q3=q3, iqr=q3 - q1,
        min=values[0], max=values[-1], mean=statistics.fmean(values), n=len(values),
    )


def memory_supported(device: torch.device) -> bool:
    """True when ``device`` reports allocator statistics (CUDA, and backends with its API)."""
    backend = _backend(device)
    return all(
        callable(getattr(backend, name, None))
        for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
    )


def resident_bytes(tensors: Iterable[torch.Tensor]) -> dict[torch.device, int]:
    """Bytes held by ``tensors`` per device, counting each shared storage once."""
    seen: set[tuple[torch.device, int]] = set()
    totals: dict[torch.device, int] = {}
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        totals[tensor.device] = totals.get(tensor.device, 0) + storage.nbytes()
    return totals


class MemoryProbe:
    """Peak memory of one contestant's steps on each device, net of the other contestants.

    Several contestants share each device during an interleaved run, so the allocator's raw
    peak includes the other contestants' models. The probe therefore records, per step,
    ``peak during the step - allocated before it`` (the step's working memory: activations,
    replicas, gathered outputs, fresh gradients) and adds the bytes this contestant itself held
    before the step (its parameters, gradients, buffers, optimizer state and input batch).
    The result is what the contestant would peak at if it ran alone, up to allocator rounding.
    """

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)
        self._unique = [d for i, d in enumerate(self.devices) if d not in self.devices[:i]]
        self._before: dict[torch.device, int] = {}
        self._own: dict[torch.device, int] = {}
        self.peak: dict[torch.device, int] = {}

    def start(self, own_tensors: Iterable[torch.Tensor]) -> None:
        """Call just before a step (outside the timed region)."""
        own = resident_bytes(own_tensors)
        for device in self._unique:
            if not memory_supported(device):
                continue
            backend = _backend(device)
            self._own[device] = own.get(device, 0)
            self._before[device] = backend.memory_allocated(device)
            backend.reset_peak_memory_stats(device)

    def stop(self) -> None:
        """Call just after a step has been synchronized."""
        for device, before in self._before.items():
            backend = _backend(device)
            step_peak = backend.max_memory_allocated(device) - before + self._own[device]
            self.peak[device] = max(self.peak.get(device, 0), step_peak)
        self._before.clear()

    def per_device(self) -> list[int | None]:
        """Peak bytes aligned with ``devices``; ``None`` where the device reports nothing."""
        return [self.peak.get(d) if memory_supported(d) else None for d in self.devices]
