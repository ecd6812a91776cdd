"""How long a device took for the work queued on it: what ``--split auto`` measures.

On the CPU the host's clock measures the work. A CUDA call returns once its kernels are queued,
so there CUDA events on the device's current stream measure the device's own time, read only
when the split looks at it, at the optimizer step.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch


class Span:
    """The work queued on ``device`` between this object's creation and :meth:`stop`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._start, self._end = self._now(), None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self) -> "Span":
        self._end = self._now()
        return self

    def seconds(self) -> float:
        """The span's length (on CUDA this waits for the work up to its end)."""
        if self._end is None:
            raise RuntimeError("Span.seconds() before stop()")
        if not self.cuda:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0


def seconds_of(value) -> float:
    """A number of seconds, or a stopped :class:`Span`'s (anything with ``seconds()``)."""
    return float(value) if isinstance(value, (int, float)) else value.seconds()


def backend_module(device: torch.device):
    """The ``torch.<type>`` module for an accelerator (``torch.cuda``, ``torch.xpu``), if any."""
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for every queued kernel on ``devices`` (no-op for the CPU)."""
    for device in dict.fromkeys(devices):
        sync = getattr(backend_module(device), "synchronize", None)
        if sync is None:
            continue
        try:
            sync(device)
        except TypeError:  # some backends (mps) take no device argument
            sync()
