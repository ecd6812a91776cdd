"""The learning-rate schedule: one ``LambdaLR`` stepped per optimizer step (``cosine``,
``step`` or ``constant``, times a linear warm-up), kept under ``tandem_scheduler``; a
checkpoint's ``scheduler`` holds :func:`epoch_state`, for the imagenet example's StepLR.
"""

from __future__ import annotations

import math

import torch

from tandem.config import OptimConfig

# The imagenet example's schedule: StepLR(step_size=30, gamma=0.1), stepped once per epoch.
EXAMPLE_STEP, EXAMPLE_GAMMA = 30, 0.1


def lr_factor(step: int, cfg: OptimConfig, steps_per_epoch: int) -> float:
    """The multiplier of the base learning rate for optimizer step ``step`` (0-based)."""
    total = max(1, cfg.epochs * steps_per_epoch)
    if cfg.lr_schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    elif cfg.lr_schedule == "step":
        factor = cfg.lr_gamma ** (step // max(1, round(cfg.lr_step * steps_per_epoch)))
    else:
        factor = 1.0
    warmup = cfg.warmup_epochs * steps_per_epoch
    if warmup > 0 and step < warmup:
        factor *= (step + 1) / warmup
    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                   steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    # a plain function keeps the state_dict free of callables (it loads with weights_only)
    def factor(step: int) -> float:
        return lr_factor(step, cfg, steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def example_lr(base_lr: float, epoch: int) -> float:
    """The lr the imagenet example's StepLR gives epoch ``epoch`` (0-based) from ``base_lr``."""
    return base_lr * EXAMPLE_GAMMA ** (epoch // EXAMPLE_STEP)


def _base_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]


def epoch_state(optimizer: torch.optim.Optimizer, epoch: int) -> dict:
    """A scheduler state counted in epochs with only the fields every scheduler has, so the
    imagenet example's StepLR loads it and stands at ``epoch`` (:func:`example_lr`)."""
    bases = _base_lrs(optimizer)
    return {"last_epoch": epoch, "_step_count": epoch + 1, "base_lrs": bases,
            "_last_lr": [example_lr(base, epoch) for base in bases]}


def example_optimizer_state(optimizer: torch.optim.Optimizer, epoch: int,
                            state: dict | None = None) -> dict:
    """``state`` (default ``optimizer.state_dict()``) with each group's ``lr`` at
    :func:`example_lr` for ``epoch``: the example goes on with the optimizer's lr, which
    tandem's own (0 at a cosine's end) would freeze."""
    state = optimizer.state_dict() if state is None else state
    state = dict(state, param_groups=[dict(g) for g in state["param_groups"]])  # untouched
    for group, base in zip(state["param_groups"], _base_lrs(optimizer)):
        group["lr"] = example_lr(base, epoch)
    return state
