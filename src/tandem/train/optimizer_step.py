"""One optimizer step through the grad scaler, then one schedule step.

Apart from the loop because it is one rule, tested on its own (``tests/test_loop_precision``):
the schedule counts steps *attempted*, so the steps fp16's scaler skips never shift it.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["optimizer_step"]


# torch's LRScheduler says this when the optimizer has not stepped before the schedule's first
# step: here that is GradScaler skipping a step it found inf gradients in, which is expected
_SKIPPED_FIRST = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    """One optimizer step through ``scaler``, then one schedule step.

    The schedule counts optimizer steps *attempted*: a step fp16's GradScaler skips (inf
    gradients, while it finds its scale) still advances it, as in the imagenet example, so
    the learning rate of step ``t`` is ``lr_factor(t)`` whatever the scaler did and a resume
    lands on it. torch's warning about that skipped first step is therefore not shown.
    """
    scaler.step(optimizer)
    scaler.update()
    if scheduler is None:
        return
    if not scaler.is_enabled():
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SKIPPED_FIRST, category=UserWarning)
        scheduler.step()
