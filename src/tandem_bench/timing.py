"""Summary statistics, noise judgements and memory readings for the benchmark harness (its
clock and quartiles are the step timer's, :mod:`tandem.strategies.step_timer`).

Accelerators run asynchronously, so every clock reading follows :func:`synchronize`. Peak
memory comes from the device allocator; the CPU reports none (``None``, not a guess).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import torch
from tandem.parallel.work_clock import backend_module as _backend
from tandem.parallel.work_clock import synchronize
from tandem.strategies.step_timer import clock, quartiles


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
    """Median, quartiles (inclusive), min, max and mean; an empty sample is a ``ValueError``."""
    q1, median, q3 = quartiles(samples)
    values = [float(s) for s in samples]
    return Stats(median=median, q1=q1, q3=q3, iqr=q3 - q1, min=min(values), max=max(values),
                 mean=statistics.fmean(values), n=len(values))


#: a sample whose IQR is over this fraction of its median is noise: its ratios say nothing
NOISE_IQR = 0.5


def is_noise(stats: dict) -> bool:
    """True when ``stats`` (a :meth:`Stats.as_dict`) spread more than :data:`NOISE_IQR` of its
    median between quartiles: a machine busy with other work, not a property of the code."""
    return stats["iqr"] > NOISE_IQR * stats["median"]


def noise_lines(named: list[tuple[str, dict]], advice: str = "rerun on an idle machine"
                ) -> list[str]:
    """The line under a table naming its rows marked ``!`` (``(name, stats)`` pairs whose
    spread :func:`is_noise` calls noise), or none."""
    noisy = [name for name, stats in named if is_noise(stats)]
    if not noisy:
        return []
    return [f"! noise: {', '.join(noisy)} spread more than {NOISE_IQR:.0%} of the median "
            f"between quartiles (IQR); {advice}"]


IMPOSSIBLE = "?"  # marks a ratio that cannot be true (a whole faster than its own part)


def impossible(whole_over_part: float) -> bool:
    """True when a whole (a loop that runs a step, and more) came out faster than its own
    part: ``whole_over_part`` is the whole's time over the part's, and it cannot be below 1."""
    return whole_over_part < 1


def impossible_lines(claims: list[str]) -> list[str]:
    """The line under a table naming its ratios marked ``?`` (each claim: what came out
    faster than what it contains), or none."""
    if not claims:
        return []
    return [f"{IMPOSSIBLE} cannot be true: {'; '.join(claims)}: a loop runs its step and more, "
            f"so such a ratio is noise; rerun on an idle machine or with more rounds"]


def memory_supported(device: torch.device, backend_for=None) -> bool:
    """True when ``device`` reports allocator statistics (CUDA, and backends with its API)."""
    backend = (backend_for or _backend)(device)
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

    :meth:`prime` runs the contestant's first step and records what it keeps resident;
    :meth:`start`/:meth:`stop` add each step's working memory (peak minus allocated before).
    The result is what it would peak at alone. ``backend_for`` is injectable for tests.
    """

    def __init__(self, devices: Sequence[torch.device], backend_for=None):
        self.devices = list(devices)
        self._backend_for = backend_for or _backend
        self._measured = [d for i, d in enumerate(self.devices)
                          if d not in self.devices[:i] and memory_supported(d, self._backend_for)]
        self._before: dict[torch.device, int] = {}
        self._resident: dict[torch.device, int] = {}
        self.peak: dict[torch.device, int] = {}

    @property
    def active(self) -> bool:
        """True when at least one device reports memory (else every method is a no-op)."""
        return bool(self._measured)

    def _allocated(self) -> dict[torch.device, int]:
        return {d: self._backend_for(d).memory_allocated(d) for d in self._measured}

    def prime(self, first_step, own_tensors: Iterable[torch.Tensor]):
        """Run ``first_step()`` (the contestant's first ever step); return what it returns."""
        held = resident_bytes(own_tensors)
        before = self._allocated()
        result = first_step()
        synchronize(self._measured)
        after = self._allocated()
        for device in self._measured:
            self._resident[device] = held.get(device, 0) + after[device] - before[device]
        return result

    def start(self) -> None:
        """Call just before a timed step (outside the timed region)."""
        self._before = self._allocated()
        for device in self._measured:
            self._backend_for(device).reset_peak_memory_stats(device)

    def stop(self) -> None:
        """Call just after a timed step has been synchronized."""
        for device, before in self._before.items():
            step = self._backend_for(device).max_memory_allocated(device) - before
            total = step + self._resident.get(device, 0)
            self.peak[device] = max(self.peak.get(device, 0), total)
        self._before = {}

    def per_device(self) -> list[int | None]:
        """Peak bytes aligned with ``devices``; ``None`` where the device reports nothing."""
        return [self.peak.get(d) if d in self._measured else None for d in self.devices]
