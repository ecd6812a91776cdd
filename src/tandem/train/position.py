"""Where training stands (:class:`Position`) and what one epoch's steps share (:class:`EpochRun`).

Apart from the loop because a resume rebuilds the position from a checkpoint
(:mod:`.resume`) and the bench's loop twins drive an epoch step by step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .metrics import Meter
from .progress import Progress

__all__ = ["EpochRun", "Position"]


@dataclass
class Position:
    """Where training stands in the data order."""

    epoch: int = 0  # epoch under way (0-based)
    batch: int = 0  # global batches of that epoch already trained on
    step: int = 0  # optimizer steps since the start of training

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step}


@dataclass
class EpochRun:
    """What the steps of one epoch share: running sums, progress, the clock."""

    meter: Meter
    progress: Progress
    carried_seconds: float = 0.0  # a resumed epoch's time before this invocation
    start: float = field(default_factory=time.perf_counter)
    look: bool = False  # the meter was read since the last look at the loss
    stopped: bool = False  # --max-steps ended the epoch part-way
    loss: torch.Tensor | None = None  # the last batch's mean loss, on the device

    def seconds(self) -> float:
        return self.carried_seconds + time.perf_counter() - self.start
