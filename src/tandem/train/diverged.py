"""Stopping a run whose loss or weights stopped being finite (``--lr 1000``, an overflow).

The loop looks only where it reads the device anyway (``--print-freq`` lines, progress-bar
refreshes, saves, the end of an epoch), so training pays no host sync per step for it. What is
kept is the last checkpoint written with finite weights; :func:`message` says which, and how
to go on with a lower learning rate.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch
from torch import nn

from tandem.config import MAY_CHANGE, OptimConfig
from tandem.distributed.resume_command import resume_command_here
from tandem.errors import TrainingDiverged

from .rundir import RunDir

__all__ = ["check", "weights_finite", "message", "lr_may_change", "kept_step"]


def check(trainer, meter, *, weights: bool = False, what: str = "train loss") -> None:
    """Raise :class:`TrainingDiverged` on every process when ``meter``'s loss (a
    :class:`~tandem.train.metrics.Meter`), or with ``weights`` the model's weights, are not
    finite on any process. Reads the meter (once) and, with ``weights``, the model."""
    s = trainer.strategy
    bad = meter is not None and not meter.finite
    if weights and not bad:
        bad, what = not weights_finite(trainer.model, s.device), "the weights"
    if not s.any_process(bad):
        return
    pos, cfg = trainer.position, trainer.cfg
    text = message(what, pos.epoch + 1, pos.step, cfg.optim.lr, cfg.run.out,
                   kept_step(trainer), resume_command_here(cfg.run.out, s.multiprocess)
                   ) if s.is_main else ""
    raise TrainingDiverged(text, quiet=not s.is_main)


def kept_step(trainer) -> int | None:
    """The step of the checkpoint in --out: the last this run saved, else the one it resumed
    from (the only checkpoint.pt a run directory can hold at its start); ``None``: none."""
    if trainer.saved_step is not None:
        return trainer.saved_step
    exists = os.path.exists(trainer.run_dir.latest)
    return trainer.started_at.step if exists else None


def weights_finite(model: nn.Module, device: torch.device) -> bool:
    """True when every floating-point parameter and buffer of ``model`` is finite (one sync)."""
    flags = [torch.isfinite(t).all().to(device)
             for t in itertools.chain(model.parameters(), model.buffers())
             if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def lr_may_change() -> bool:
    """Whether ``--resume RUN --lr X`` is accepted (``on_resume`` of the ``lr`` field)."""
    lr = next(f for f in dataclasses.fields(OptimConfig) if f.name == "lr")
    return lr.metadata.get("on_resume") == MAY_CHANGE


def message(what: str, epoch: int, step: int, lr: float, out: str, kept_step: int | None,
            resume_command: str) -> str:
    """One line: what became non-finite and where, what was kept, how to go on.

    ``kept_step``: the step of the checkpoint in ``out`` (``None``: there is none).
    """
    lower = f"{lr / 10:g}"
    head = f"{what} became non-finite by epoch {epoch}, step {step} (--lr {lr:g}); stopped"
    if kept_step is None:
        return (f"{head} before any checkpoint was saved; start the run again with a lower "
                f"--lr (e.g. --lr {lower}) and --overwrite")
    run = RunDir(out)
    ckpt = run.latest
    kept = f"{head}, keeping {ckpt} from step {kept_step} (finite weights)"
    if lr_may_change():
        return f"{kept}; go on from it with a lower --lr: {resume_command} --lr {lower}"
    return (f"{kept}; --resume keeps a run's --lr, so to go on from those weights with a lower "
            f"one start a new run with --pretrained {ckpt} --lr {lower} --out NEW_DIR and the "
            f"run's other flags (in {run.file(run.CONFIG)})")
