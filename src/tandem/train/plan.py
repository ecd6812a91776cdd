"""A run's plan: everything it resolves, and every check it needs, before it touches anything.

:func:`plan_train` and :func:`plan_eval` read the flags (and the checkpoint a resume names),
pick the devices and the strategy, check what the strategy can do (``--amp``,
``--channels-last``, ``--compile``, the model) and what may happen to ``--out`` (a run there,
one writing there now, a read-only file). A refusal
comes before any process group is joined, any data read or anything compiled or written.
``tandem.fit`` hands over its model, data sets and criterion as :class:`Supplied`; the plan
and the build then take them instead of building what the config names. A
``package.module:function`` model is checked by its strategy once it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from tandem.config import ModelConfig, ParallelConfig, TrainConfig
from tandem.distributed.env import cpu_bf16_override, is_main_process, split_clock
from tandem.errors import UsageError
from tandem.data.device_decode import resolve_decode
from tandem.data.load import check_spec
from tandem.factory import is_reference
from tandem.models import create_model, model_info
from tandem.parallel.devices import parse_device_spec
from tandem.parallel.split import clock_from_spec, parse_split
from tandem.precision import amp_precision
from tandem.parallel import threaded_backward
from tandem.strategies import Strategy, create_strategy, strategy_class, strategy_names
from tandem.strategies.compile import check_compile

from . import auto, foreign, rundir, runlock, start
from .resume import check_launched, complete_line
from .rundir import RunDir

__all__ = ["RunPlan", "Supplied", "check_model", "plan_train", "plan_eval", "FRESH", "RESUMED",
           "FORKED", "EVALUATE", "backward_recorded"]

#: what a run does to its directory: starts it, continues it there, continues it in a new one,
#: or writes nothing (validation only)
FRESH, RESUMED, FORKED, EVALUATE = "fresh", "resumed", "forked", "evaluate"


@dataclass(frozen=True)
class Supplied:
    """What a caller hands over instead of the config's names (``tandem.fit``): a model,
    the data sets ``(train, val, info)`` and a criterion; ``None``: built as configured."""

    model: nn.Module | None = field(default=None, repr=False)
    data: tuple | None = field(default=None, repr=False)
    criterion: Callable | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved and checked. ``strategy`` is built but not launched (``with``); it
    holds the devices, world size, rank and this process's device."""

    cfg: TrainConfig
    strategy: Strategy
    mode: str  # FRESH, RESUMED, FORKED or EVALUATE
    run_dir: RunDir | None = None  # None: nothing is written
    source: RunDir | None = None  # the run a fork takes its history from
    checkpoint: dict | None = field(default=None, repr=False)  # what --resume names, read
    notes: tuple[str, ...] = ()  # what the resume took or changed, one line each
    given: frozenset[str] = frozenset()  # fields typed on the command line
    supplied: Supplied = field(default_factory=Supplied)
    race: dict | None = None  # --strategy auto's record (tandem.train.auto)
    opening: tuple[str, ...] = ()  # lines the command line says as the run starts (--dummy)

    @property
    def resume_path(self) -> str | None:
        return self.cfg.run.resume if self.checkpoint is not None else None


def plan_train(cfg: TrainConfig, given: frozenset[str] = frozenset(),
               supplied: Supplied = Supplied(), opening: tuple[str, ...] = ()) -> RunPlan | str:
    """The plan of ``tandem train`` (``supplied``: what ``tandem.fit`` was handed; ``opening``:
    :attr:`RunPlan.opening`); or, for a complete run, the one line to print instead."""
    cfg, ckpt, notes = auto.resumed(cfg, given)  # resumed_config; auto: the run's, or launch's
    newer = None
    if ckpt is not None:
        _check_handed(cfg, ckpt, supplied)
        newer = rundir.example_file_note(cfg.run.resume, cfg.data.data, cfg.run.evaluate)
        notes = [*notes, newer] if newer else notes
    if supplied.model is None and supplied.data is None:
        if ckpt is None:
            cfg = start.fresh_defaults(cfg, given)  # an ImageFolder's arch and image size
        elif foreign.is_foreign(ckpt) and not cfg.run.evaluate:  # -e: foreign.eval_settings
            cfg = start.sized(cfg, given)  # the file's arch at its native size
    if supplied.model is None:
        model_info(cfg.model.arch)  # a mistyped --arch (or a factory that fails to import)
    if supplied.data is None:
        check_spec(cfg.data.data)  # a mistyped --data, or a path that is not there
    if cfg.run.evaluate:  # notes: only what a file from elsewhere is evaluated as
        note = None
        if ckpt is not None and foreign.is_foreign(ckpt):  # as the example's own -e
            cfg, note = foreign.eval_settings(cfg, given, cfg.run.resume)
        return plan_eval(cfg, ckpt, [n for n in (newer, note) if n], supplied)
    if ckpt is not None:
        line = complete_line(cfg, ckpt, given, by_fit=supplied != Supplied())
        if line is not None:
            return line
        check_launched(cfg, ckpt, given)
    strategy = _strategy(cfg.parallel, cfg.model, supplied.model)
    cfg = backward_recorded(cfg, strategy)
    strategy.split.check_fits(cfg.optim.batch_size)
    resolve_decode(cfg.data.decode, strategy.device)  # --decode gpu without CUDA: one line
    run, source = RunDir(cfg.run.out), None
    continues = ckpt is not None and not foreign.is_foreign(ckpt)
    if continues:
        source = RunDir.of(cfg.run.resume)
    mode = FRESH if not continues else RESUMED if run.same(source) else FORKED
    if cfg.parallel.amp and cfg.parallel.amp_dtype is None and ckpt is None:
        # the config records what --amp resolved to here (bf16 on a CPU), not null
        dtype = amp_precision(strategy.device.type, True, cpu_bf16=cpu_bf16_override()).amp_dtype
        cfg = replace(cfg, parallel=replace(cfg.parallel, amp_dtype=dtype))
    if is_main_process():  # the run directory is the main process's alone (no shared disk)
        if mode != RESUMED:
            run.check_fresh(cfg.run.overwrite)
        run.check_writable()
        runlock.check_free(run)  # another run writes there: refused, --overwrite or not
    return RunPlan(cfg, strategy, mode, run, source, ckpt, tuple(notes), given, supplied,
                   opening=tuple(opening))


def plan_eval(cfg: TrainConfig, ckpt: dict | None, notes=(),
              supplied: Supplied = Supplied()) -> RunPlan:
    """The plan of a validation pass (``tandem eval``, ``train -e``): it writes nothing."""
    strategy = _strategy(cfg.parallel, cfg.model, supplied.model)
    resolve_decode(cfg.data.decode, strategy.device)  # --decode gpu without CUDA: one line
    return RunPlan(cfg, strategy, EVALUATE, checkpoint=ckpt, notes=tuple(notes),
                   supplied=supplied)


_HANDED = {"arch": ("model", "model", "-a package.module:function",
                    "a function that builds the same model"),
           "data": ("data sets", "train_data, val_data", "--data package.module:function",
                    "a function that returns the same data sets")}


def _check_handed(cfg: TrainConfig, ckpt: dict, supplied: Supplied) -> None:
    """A run of ``tandem.fit`` continues with what it was handed: handed again to
    ``tandem.fit(resume=...)``, or named on the command line. Refuse it without them; the
    ``tandem.fit`` call offered hands over all the run was handed (a flag typed here cannot
    go with it)."""
    missing = [name for name in rundir.handed_to_fit(cfg)
               if getattr(supplied, "model" if name == "arch" else "data") is None]
    if not missing:
        return
    handed = set(missing) | set(rundir.handed_to_fit(TrainConfig.from_dict(
        ckpt.get("config") or {})))
    target = rundir.target_of(cfg.run.resume)
    what = " and ".join(_HANDED[n][0] for n in missing)
    args = ", ".join(["model" if "arch" in handed else "None",
                      "train_data, val_data" if "data" in handed else "None"])
    flags = " ".join(_HANDED[n][2] for n in missing)
    meaning = " and ".join(_HANDED[n][3] for n in missing)
    raise UsageError(f"run '{target}' was trained by tandem.fit on the {what} handed to it, "
                     f"which tandem cannot load by name: continue it with tandem.fit({args}, "
                     f"resume='{target}'), or with `tandem train --resume {target} {flags}` "
                     f"({meaning})")


def check_model(strategy: Strategy, model: nn.Module) -> None:
    """Refuse a model ``strategy`` cannot train, in one line."""
    problem = strategy.check_model(model, strategy.hybrid_head)
    if problem:
        raise UsageError(f"--strategy {strategy.name} {problem}")


def _split(cfg: ParallelConfig) -> dict:
    """The strategy's ``split`` and ``max_share`` keywords (none when not asked for)."""
    if cfg.split is None and cfg.max_share is None:
        return {}
    return {"split": None if cfg.split is None else parse_split(cfg.split),
            "max_share": cfg.max_share, "split_clock": clock_from_spec(split_clock())}


def backward_recorded(cfg: TrainConfig, strategy: Strategy) -> TrainConfig:
    """``cfg`` with the backward path ``strategy`` took (``--backward-threads on|off``), so
    that config.json keeps it and a resume takes the same path. ``auto`` records its choice's,
    once raced (:mod:`.auto`)."""
    if cfg.parallel.backward_threads is not None or cfg.parallel.strategy == auto.AUTO:
        return cfg
    path = "on" if strategy.backward_threads else "off"
    return replace(cfg, parallel=replace(cfg.parallel, backward_threads=path))


def _backward_threads(cfg: ParallelConfig, devices: list[torch.device]) -> bool:
    """Whether the run's CPU replica threads run their backward in threads: as
    ``--backward-threads`` (or the config resumed) says, else decided now, once, by
    :func:`~tandem.parallel.threaded_backward.decide`. Only strategies that run replicas in
    threads have such a backward."""
    if not strategy_class(cfg.strategy).replica_threads:
        return False
    wanted = None if cfg.backward_threads is None else cfg.backward_threads == "on"
    return threaded_backward.decide(devices, wanted, split=cfg.split is not None)


def _strategy(cfg: ParallelConfig, model_cfg: ModelConfig,
              model: nn.Module | None = None) -> Strategy:
    """The strategy of ``cfg`` on its devices (built, not launched), once it is known to run
    ``model`` (else ``model_cfg.arch``) with the options asked for."""
    if cfg.strategy == auto.AUTO:  # until the race (tandem.train.auto)
        return auto.stand_in(cfg, lambda p: _strategy(p, model_cfg, model))
    devices = parse_device_spec(cfg.devices, "--devices")
    strategy = create_strategy(cfg.strategy, devices, sync_bn=cfg.sync_bn, buffers=cfg.buffers,
                               output_key=model_cfg.output_key,
                               hybrid_head=model_cfg.hybrid_head,
                               backward_threads=_backward_threads(cfg, devices), **_split(cfg))
    if (cfg.split or cfg.max_share) and not strategy.splits_batch:
        flag = "--split" if cfg.split else "--max-share"
        raise UsageError(f"{flag} needs a strategy that splits the batch "
                         f"({', '.join(strategy_names(splits_batch=True))}), not --strategy "
                         f"{cfg.strategy}")
    strategy.split.check_weights("--split")
    amp_precision(strategy.device.type, cfg.amp, cfg.amp_dtype,  # one line where it cannot run
                  cpu_bf16=cpu_bf16_override())
    if cfg.compile:
        check_compile(strategy, strategy.device.type)
    if model is None and not is_reference(model_cfg.arch):  # a factory's: once built (run)
        with torch.device("meta"):  # the model's structure, no memory and no weights
            model = create_model(model_cfg.arch)
    if model is not None:
        check_model(strategy, model)
    return strategy

