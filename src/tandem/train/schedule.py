"""The learning-rate schedule: one ``LambdaLR`` stepped once per optimizer step.

``cosine``, ``step`` (counted in steps, so a mid-epoch resume lands on the same value) or
``constant``, times an optional linear warm-up. ``--max-steps`` never changes it.
Checkpoints keep its state under ``tandem_scheduler``; ``scheduler`` holds
:func:`epoch_state`, what the imagenet example's per-epoch StepLR can load.
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
    # A plain function (not a lambda object) keeps the scheduler's state_dict free of
    # callables, so it loads with weights_only=True.
    def factor(step: int) -> float:
        return lr_factor(step, cfg, steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def example_lr(base_lr: float, epoch: int) -> float:
    """The lr the imagenet example's StepLR gives epoch ``epoch`` (0-based) of a run whose
    base lr is ``base_lr``: ``base_lr * 0.1 ** (epoch // 30)``."""
    return base_lr * EXAMPLE_GAMMA ** (epoch // EXAMPLE_STEP)


def _base_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]


def epoch_state(optimizer: torch.optim.Optimizer, epoch: int) -> dict:
    """A scheduler state counted in epochs, for programs that step once per epoch.

    The imagenet example loads ``checkpoint['scheduler']`` into its ``StepLR`` whatever wrote
    it; this state sets only the fields every scheduler has, so its StepLR stands at
    ``epoch`` with its own step size and gamma, at :func:`example_lr`.
    """
    bases = _base_lrs(optimizer)
    return {"last_epoch": epoch, "_step_count": epoch + 1, "base_lrs": bases,
            "_last_lr": [example_lr(base, epoch) for base in bases]}


def example_optimizer_state(optimizer: torch.optim.Optimizer, epoch: int,
                            state: dict | None = None) -> dict:
    """``state`` (``optimizer.state_dict()``, or the plain layout of it a strategy saves) with
    each group's ``lr`` at :func:`example_lr` for ``epoch``.

    The example continues with the optimizer's lr (its StepLR changes it only every 30
    epochs), so tandem's own lr there (0 at the end of a cosine schedule) would freeze it.
    tandem resumes its own lr from ``tandem_scheduler`` (see ``resume.restore``).
    """
    state = optimizer.state_dict() if state is None else state
    state = dict(state, param_groups=[dict(g) for g in state["param_groups"]])  # untouched
    for group, base in zip(state["param_groups"], _base_lrs(optimizer)):
        group["lr"] = example_lr(base, epoch)
    return state
