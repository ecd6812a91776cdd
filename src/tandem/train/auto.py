"""``--strategy auto`` in a run: what the plan stands in with, and the race before the build.

A race runs once per run, at a fresh start (:func:`settle`): its choice becomes the run's
``--strategy`` and its table goes into ``config.json`` (``resolved.auto``), so ``--resume`` goes
on with the choice; a resume with ``--strategy auto`` says so and never races (:func:`resumed`).
Under torchrun ``auto`` is the one-process-per-device strategy, said in one line. The race
itself is :mod:`tandem.strategies.auto`'s.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Callable

import torch

from tandem.config import ParallelConfig, TrainConfig
from tandem.distributed.env import cpu_bf16_override, in_torchrun, is_main_process
from tandem.errors import UsageError, first_line
from tandem.parallel.devices import parse_device_spec
from tandem.parallel.split import parse_split
from tandem.precision import amp_precision
from tandem.strategies import Strategy, strategy_class
from tandem.strategies import auto

from .resume import _device_spec, resumed_config

__all__ = ["AUTO", "resumed", "stand_in", "settle", "recorded"]

AUTO = auto.AUTO


def resumed(cfg: TrainConfig, given: frozenset[str]):
    """:func:`~.resume.resumed_config`, with ``auto`` settled where no race is due: under
    torchrun it is the multi-process strategy; a resumed run keeps the strategy it has."""
    if cfg.parallel.strategy != auto.AUTO:
        return resumed_config(cfg, given)
    if in_torchrun():
        name = auto.launched()
        if is_main_process():
            print(f"--strategy auto: under tandem launch the strategy is {name}, one process "
                  f"per device (no race across processes)", flush=True)
        return resumed_config(replace(cfg, parallel=replace(cfg.parallel, strategy=name)),
                              given)
    if not cfg.run.resume:
        return resumed_config(cfg, given)
    cfg, ckpt, notes = resumed_config(cfg, given - {"strategy"})  # the run's own strategy
    if cfg.parallel.strategy != auto.AUTO:  # else a file from elsewhere: it races
        raced = "chosen by its race" if _record(ckpt) else "as it started"
        notes = [*notes, f"--strategy auto: the run already has --strategy "
                         f"{cfg.parallel.strategy} ({raced}); it goes on with it, no race"]
    return cfg, ckpt, notes


def stand_in(parallel: ParallelConfig, build: Callable[[ParallelConfig], Strategy]) -> Strategy:
    """The plan's strategy until the race: the simplest candidate that ``build`` (the plan's
    checks) accepts; refused, with the first refusal, when none does."""
    refusals = []
    for name in auto.simplest_first():
        try:
            with warnings.catch_warnings():  # single on several devices: the race decides
                warnings.simplefilter("ignore")
                return build(replace(parallel, strategy=name))
        except UsageError as exc:
            refusals.append(first_line(exc))
    raise UsageError(f"--strategy auto: no strategy can run this here: {refusals[0]}")


def _record(ckpt: dict | None) -> dict | None:
    config = (ckpt or {}).get("config") or {}
    return (config.get("resolved") or {}).get("auto")


def recorded(config_dict: dict, plan) -> dict:
    """``config_dict`` with the race's record (this run's, or the resumed run's)."""
    record = getattr(plan, "race", None) or _record(plan.checkpoint)
    if record is not None:
        config_dict["resolved"]["auto"] = record
    return config_dict


def _batch(train_set, info, classes: int, size: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random global batch of the data's shape (no data is read)."""
    shape = getattr(train_set, "shape", None) or (info.in_channels, info.image_size,
                                                   info.image_size)
    target = tuple(getattr(train_set, "target_shape", ()) or ())
    generator = torch.Generator().manual_seed(0)
    return (torch.randn((size, *shape), generator=generator).to(dtype),
            torch.randint(0, classes, (size, *target), generator=generator))


def settle(plan, clock=None):
    """``plan`` with ``auto`` raced and replaced by the choice, built with the plan's checks;
    any other plan as it is. Prints the race's block; leaves every RNG as it was."""
    if plan.cfg.parallel.strategy != auto.AUTO:
        return plan
    from .plan import _strategy

    def build(parallel: ParallelConfig) -> Strategy:
        return _strategy(parallel, plan.cfg.model, plan.supplied.model)

    with auto.rng_kept():
        return _settled(plan, build, clock)


def _settled(plan, build: Callable[[ParallelConfig], Strategy], clock):
    cfg = plan.cfg
    from tandem.bench.contestants import strategy_contestant
    from tandem.data import batches_per_epoch

    from .run import _data, build_model

    p = cfg.parallel
    devices = parse_device_spec(p.devices, "--devices")
    train_set, _, info = _data(plan, splits=("train",), decoded=False)  # shapes: no decode
    classes = cfg.data.num_classes or info.num_classes
    dtype = getattr(torch, p.dtype)
    model = (copy.deepcopy(plan.supplied.model) if plan.supplied.model is not None else
             build_model(cfg.model, replace(info, num_classes=classes), cfg.run.seed)).to(dtype)
    images, targets = _batch(train_set, info, classes, cfg.optim.batch_size, dtype)
    split = None if p.split is None else parse_split(p.split)

    def check(name: str) -> str | None:  # the run's own refusals (--compile, --split)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build(replace(p, strategy=name))
        except UsageError as exc:
            return first_line(exc)
        return None

    names, not_raced = auto.candidates(devices, model, cfg.model.hybrid_head, check)
    if not names:
        raise UsageError("--strategy auto: no strategy can run this here: " + "; ".join(
            f"{n}: {why}" for n, why in not_raced.items()))

    def contestant(name: str):
        few = devices[:strategy_class(name).max_devices or len(devices)]
        return strategy_contestant(
            name, copy.deepcopy(model), few, (images, targets),
            amp=amp_precision(devices[0].type, p.amp, p.amp_dtype, cpu_bf16=cpu_bf16_override()),
            lr=cfg.optim.lr,
            channels_last=p.channels_last, sync_bn=p.sync_bn, buffers=p.buffers, split=split)

    if len(names) == 1:  # nothing to race
        result = auto.RaceResult([], 0, 0.0)
    else:
        result = auto.race(names, contestant, batch_size=cfg.optim.batch_size,
                           rounds=p.auto_steps, clock=clock,
                           epoch_batches=batches_per_epoch(train_set, cfg.optim.batch_size))
    planned = auto.planned_bytes(model, devices, cfg.optim.batch_size, tuple(images.shape[1:]),
                                 cfg.model.hybrid_head, split)
    result.choice, result.reason = (auto.choose(result.rows, planned) if result.rows else
                                    (names[0], f"{names[0]}: the only candidate"))
    result.not_raced = not_raced
    print(auto.format_block(result, planned, f"{', '.join(names)} on {p.devices}, global batch "
                                             f"{cfg.optim.batch_size}, "), flush=True)
    few = devices[:strategy_class(result.choice).max_devices or len(devices)]
    parallel = replace(p, strategy=result.choice,  # single: the one device it drives
                       devices=p.devices if few == devices else _device_spec(few))
    strategy = build(parallel)
    from .plan import backward_recorded

    return replace(plan, cfg=backward_recorded(replace(cfg, parallel=parallel), strategy),
                   strategy=strategy, race=result.record())
