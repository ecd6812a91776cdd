"""Running sums for loss/accuracy, their reduction over processes, the JSONL log, peak memory.

Sums, not means, are kept, so one reduction gives the exact mean however unevenly samples
were shared out. Accuracies are percentages (0-100).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import torch

__all__ = ["Meter", "MetricsLog", "peak_memory_mb", "reset_peak_memory"]


class Meter:
    """Sum of per-sample loss, top-1 and top-5 hits and sample count on this process."""

    def __init__(self):
        self.loss_sum = 0.0
        self.correct = 0
        self.correct5 = 0
        self.count = 0

    def update(self, loss: torch.Tensor, correct: torch.Tensor, count: int,
               correct5: torch.Tensor | None = None) -> None:
        """Add a batch whose *mean* loss is ``loss`` over ``count`` samples (syncs once)."""
        if count == 0:  # an empty share of a short last batch: nothing to count
            return
        self.loss_sum += float(loss.detach().float()) * count
        self.correct += int(correct)
        self.correct5 += int(correct if correct5 is None else correct5)
        self.count += count

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def acc(self) -> float:
        return 100.0 * self.correct / self.count if self.count else float("nan")

    @property
    def acc5(self) -> float:
        return 100.0 * self.correct5 / self.count if self.count else float("nan")

    def reduced(self, strategy) -> "Meter":
        """A new meter holding the sums over every process (one ``all_reduce_sum``)."""
        totals = torch.tensor([self.loss_sum, self.correct, self.count, self.correct5],
                              dtype=torch.float64, device=strategy.device)
        totals = strategy.all_reduce_sum(totals).cpu()
        out = Meter()
        out.loss_sum, out.correct, out.count = float(totals[0]), int(totals[1]), int(totals[2])
        out.correct5 = int(totals[3])
        return out


def _cuda_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    seen = []
    for d in devices:
        if d.type == "cuda" and d not in seen:
            seen.append(d)
    return seen


def reset_peak_memory(devices: Iterable[torch.device]) -> None:
    for d in _cuda_devices(devices):
        torch.cuda.reset_peak_memory_stats(d)


def peak_memory_mb(devices: Iterable[torch.device]) -> dict[str, float] | None:
    """Peak allocated MiB per CUDA device since the last reset; ``None`` when no device
    reports memory (the CPU does not)."""
    cuda = _cuda_devices(devices)
    if not cuda:
        return None
    return {str(d): round(torch.cuda.max_memory_allocated(d) / 2**20, 1) for d in cuda}


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended and flushed per epoch.

    ``keep_epochs`` (a resumed run's completed epochs) drops rows past them; ``None`` starts empty.
    """

    def __init__(self, path: str, *, keep_epochs: int | None):
        self.path = path
        if keep_epochs is None:
            if os.path.exists(path):
                os.remove(path)
            return
        rows = [r for r in self.read() if r.get("epoch", 0) <= keep_epochs]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, path)

    def append(self, record: dict) -> None:
        """Add one row; a non-finite number is written as ``null``, never as NaN."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, sort_keys=False) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
