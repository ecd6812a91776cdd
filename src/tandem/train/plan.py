"""A run's plan: everything it resolves, and every check it needs, before it touches anything.

:func:`plan_train` and :func:`plan_eval` read the flags (and the checkpoint a resume names),
pick the devices and the strategy, check what the strategy can do (``--amp``,
``--channels-last``, ``--compile``, the model) and what may happen to ``--out``. A refusal
comes before any process group is joined, any data read or anything compiled or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.config import ModelConfig, ParallelConfig, TrainConfig
from tandem.errors import UsageError
from tandem.models import create_model, model_info
from tandem.parallel.devices import parse_device_spec
from tandem.strategies import Strategy, create_strategy
from tandem.strategies.compile import check_compile

from . import foreign
from .resume import check_launched, complete_line, resumed_config
from .rundir import RunDir

__all__ = ["RunPlan", "plan_train", "plan_eval", "FRESH", "RESUMED", "FORKED", "EVALUATE"]

#: what a run does to its directory: starts it, continues it there, continues it in a new one,
#: or writes nothing (validation only)
FRESH, RESUMED, FORKED, EVALUATE = "fresh", "resumed", "forked", "evaluate"


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved and checked. ``strategy`` is built but not launched (``with``)."""

    cfg: TrainConfig
    strategy: Strategy
    mode: str  # FRESH, RESUMED, FORKED or EVALUATE
    run_dir: RunDir | None = None  # None: nothing is written
    source: RunDir | None = None  # the run a fork takes its history from
    checkpoint: dict | None = field(default=None, repr=False)  # what --resume names, read
    notes: tuple[str, ...] = ()  # what the resume took or changed, one line each
    given: frozenset[str] = frozenset()  # fields typed on the command line

    @property
    def resume_path(self) -> str | None:
        return self.cfg.run.resume if self.checkpoint is not None else None

    @property
    def devices(self) -> list[torch.device]:
        return self.strategy.devices

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        return self.strategy.rank


def plan_train(cfg: TrainConfig, given: frozenset[str] = frozenset()) -> RunPlan | str:
    """The plan of ``tandem train``; or, for a complete run, the one line to print instead."""
    cfg, ckpt, notes = resumed_config(cfg, given)
    model_info(cfg.model.arch)  # a mistyped --arch, before anything else
    if cfg.run.evaluate:  # notes: only what a file from elsewhere is evaluated as
        note = None
        if ckpt is not None and foreign.is_foreign(ckpt):  # as the example's own -e
            cfg, note = foreign.eval_settings(cfg, given, cfg.run.resume)
        return plan_eval(cfg, ckpt, [note] if note else [])
    if ckpt is not None:
        line = complete_line(cfg, ckpt, given)
        if line is not None:
            return line
        check_launched(cfg, ckpt, given)
    strategy = _strategy(cfg.parallel, cfg.model)
    run, source = RunDir(cfg.run.out), None
    continues = ckpt is not None and not foreign.is_foreign(ckpt)
    if continues:
        source = RunDir.of(cfg.run.resume)
    mode = FRESH if not continues else RESUMED if run.same(source) else FORKED
    if mode != RESUMED:
        run.check_fresh(cfg.run.overwrite)
    return RunPlan(cfg, strategy, mode, run, source, ckpt, tuple(notes), given)


def plan_eval(cfg: TrainConfig, ckpt: dict | None, notes=()) -> RunPlan:
    """The plan of a validation pass (``tandem eval``, ``train -e``): it writes nothing."""
    return RunPlan(cfg, _strategy(cfg.parallel, cfg.model), EVALUATE, checkpoint=ckpt,
                   notes=tuple(notes))


def _strategy(cfg: ParallelConfig, model: ModelConfig) -> Strategy:
    """The strategy of ``cfg`` on its devices (built, not launched), once it is known to run
    ``model.arch`` with the options asked for."""
    strategy = create_strategy(cfg.strategy, parse_device_spec(cfg.devices, "--devices"),
                               sync_bn=cfg.sync_bn, buffers=cfg.buffers,
                               output_key=model.output_key, hybrid_head=model.hybrid_head)
    for flag, on in (("--amp", cfg.amp), ("--channels-last", cfg.channels_last)):
        if on and strategy.device.type != "cuda":
            raise UsageError(f"{flag} needs a CUDA device, but --devices {cfg.devices} gives "
                             f"{strategy.device}")
    if cfg.compile:
        check_compile(strategy, strategy.device.type)
    with torch.device("meta"):  # the model's structure, no memory and no weights
        problem = strategy.check_model(create_model(model.arch), model.hybrid_head)
    if problem:
        raise UsageError(f"--strategy {cfg.strategy} {problem}")
    return strategy

