"""Where training stands (:class:`Position`) and what one epoch's steps share (:class:`EpochRun`).

Apart from the loop because a resume rebuilds the position from a checkpoint
(:mod:`.resume`) and the bench's loop twins drive an epoch step by step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.checkpoint import capture_rng

from .metrics import Meter
from .progress import Progress

__all__ = ["EpochRun", "Position", "StepStart"]


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


@dataclass
class StepStart:
    """What a step changes before its optimizer step, as it was when the step began: the
    model's buffers (a forward updates BatchNorm's running statistics) and the RNG states. A
    step a lost peer cut short is undone with it, so the checkpoint then saved is exactly the
    last completed step (the weights and the optimizer change only at the optimizer step)."""

    buffers: list
    rng: dict

    @classmethod
    def capture(cls, model: torch.nn.Module, device) -> "StepStart":
        return cls([b.detach().clone() for b in model.buffers()], capture_rng(device))

    def restore_buffers(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for saved, buffer in zip(self.buffers, model.buffers()):
                buffer.copy_(saved)
