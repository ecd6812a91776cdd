"""Assembling a run from a :class:`~tandem.config.TrainConfig`: ``train`` and ``evaluate``.

The order is fixed, for reproducibility: resume settings, strategy, data, then the model is
seeded and built **on the CPU** (initial weights never depend on devices), checkpoint weights
loaded into it, ``strategy.setup``, the optimizer on what setup returned, restored states,
and finally the run directory.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from tandem import checkpoint
from tandem.checkpoint import compat as checkpoint_compat
from tandem.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from tandem.data import batches_per_epoch, load_dataset
from tandem.distributed.env import LAUNCH_ID_VAR
from tandem.models import create_model, model_info
from tandem.parallel.devices import parse_device_spec
from tandem.pretrained import load_pretrained
from tandem.strategies import Strategy, create_strategy
from tandem.strategies.compile import check_compile, compile_model
from tandem.errors import UsageError

from . import compile as compiling
from . import foreign
from .interrupt import StopRequest
from .loop import Trainer
from .metrics import MetricsLog
from .resume import (check_launched, check_max_steps, complete_line, prepare_out, restore,
                     resumed_config, say_resuming)
from .schedule import make_scheduler

__all__ = ["train", "evaluate", "build_strategy", "build_data", "build_model", "make_criterion",
           "seed_everything"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_strategy(cfg: ParallelConfig) -> Strategy:
    """The strategy named in ``cfg`` on the parsed ``--devices``; checks CUDA-only options."""
    strategy = create_strategy(cfg.strategy, parse_device_spec(cfg.devices, "--devices"),
                               sync_bn=cfg.sync_bn, buffers=cfg.buffers)
    for flag, on in (("--amp", cfg.amp), ("--channels-last", cfg.channels_last)):
        if on and strategy.device.type != "cuda":
            strategy.close()
            raise UsageError(f"{flag} needs a CUDA device, but --devices {cfg.devices} gives "
                             f"{strategy.device}")
    if cfg.compile:
        try:
            check_compile(strategy, strategy.device.type)
        except ValueError:
            strategy.close()
            raise
    return strategy


def _setup(strategy: Strategy, model: nn.Module, cfg: ParallelConfig) -> nn.Module:
    """``strategy.setup(model)``, the model's call compiled first with ``--compile``."""
    problem = strategy.check_model(model)
    if problem:
        raise UsageError(f"--strategy {cfg.strategy} {problem}")
    if cfg.compile:
        model = compile_model(strategy, model, cfg.compile_mode)
    return strategy.setup(model)


def _warm_up(trainer: Trainer, train: bool) -> float | None:
    """With ``--compile``: compile now, before any clock runs; the seconds it took, else None."""
    return compiling.warm_up(trainer, train=train) if trainer.cfg.parallel.compile else None


def build_data(cfg: DataConfig, seed: int, splits: tuple[str, ...] = ("train", "val")):
    return load_dataset(cfg.data, augment=cfg.augment, seed=seed, image_size=cfg.image_size,
                        synthetic_size=cfg.synthetic_size, num_classes=cfg.num_classes,
                        splits=splits)


def build_model(cfg: ModelConfig, info, seed: int) -> nn.Module:
    """Seed, then create ``cfg.arch`` on the CPU for ``info``'s classes, channels and size."""
    minimum = model_info(cfg.arch).min_input_size  # unknown arch: ValueError listing them
    if info.image_size < minimum:
        raise UsageError(f"--arch {cfg.arch} needs images of at least {minimum}px, but "
                         f"{info.name} gives {info.image_size}px (set --image-size)")
    kwargs = {} if cfg.dropout is None else {"dropout": cfg.dropout}
    seed_everything(seed)
    return create_model(cfg.arch, num_classes=info.num_classes, in_channels=info.in_channels,
                        **kwargs)


def make_criterion(cfg: OptimConfig, strategy: Strategy) -> nn.Module:
    """Cross-entropy, the same in training, validation and ``tandem eval``."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing).to(strategy.device)


def _resolved(cfg: TrainConfig, strategy: Strategy, info) -> dict:
    """The run's settings plus what they resolved to (written to config.json and checkpoints)."""
    out = cfg.settings()
    out["resolved"] = {
        "devices": [str(d) for d in strategy.devices],
        "world_size": strategy.world_size,
        "dataset": {"name": info.name, "num_classes": info.num_classes,
                    "in_channels": info.in_channels, "image_size": info.image_size},
        "images_per_step": cfg.optim.batch_size * cfg.optim.accum_steps,
        "launch_id": os.environ.get(LAUNCH_ID_VAR),
    }
    return out


def _with_model_classes(cfg: TrainConfig, info, ckpt: dict | None) -> TrainConfig:
    """``cfg`` with ``data.num_classes`` set to the classes the model will output.

    ``--num-classes`` when given; else a checkpoint's classifier when it is larger than the
    data's classes (the imagenet example's files always have 1000); else the data's. The
    run's config records it, so its checkpoints rebuild the same model for eval and resume.
    """
    classes = cfg.data.num_classes
    if classes is None:
        layer = checkpoint_compat.final_layer(ckpt["state_dict"]) if ckpt is not None else None
        classes = layer[1] if layer and layer[1] > info.num_classes else info.num_classes
    return replace(cfg, data=replace(cfg.data, num_classes=classes))


def _prepared_model(cfg: TrainConfig, strategy: Strategy, ckpt: dict | None, info,
                    path: str | None) -> nn.Module:
    """The model of ``cfg`` (``cfg.data.num_classes`` outputs, see :func:`_with_model_classes`)
    with its weights (``ckpt`` read from ``path``, or --pretrained), set up by ``strategy``:
    the same for training and for validation."""
    model = build_model(cfg.model, replace(info, num_classes=cfg.data.num_classes),
                        cfg.run.seed)
    if ckpt is not None:
        checkpoint.load_model_state(model, ckpt, path)
    elif cfg.model.pretrained:
        line = load_pretrained(model, cfg.model.pretrained, cfg.model.arch)
        if strategy.is_main:
            print(line, flush=True)
    model = model.to(getattr(torch, cfg.parallel.dtype))
    if cfg.parallel.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return _setup(strategy, model, cfg.parallel)


def _build_trainer(cfg: TrainConfig, strategy: Strategy, ckpt: dict | None) -> Trainer:
    train_set, val_set, info = build_data(cfg.data, cfg.run.seed)
    cfg = _with_model_classes(cfg, info, ckpt)
    wrapped = _prepared_model(cfg, strategy, ckpt, info, cfg.run.resume)
    optim = cfg.optim
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=optim.lr, momentum=optim.momentum,
                                weight_decay=optim.weight_decay, nesterov=optim.nesterov)
    batches = batches_per_epoch(train_set, optim.batch_size)
    steps_per_epoch = -(-batches // optim.accum_steps)
    trainer = Trainer(
        cfg=cfg, strategy=strategy, model=wrapped,
        criterion=make_criterion(optim, strategy),
        optimizer=optimizer, scheduler=make_scheduler(optimizer, optim, steps_per_epoch),
        scaler=torch.amp.GradScaler(strategy.device.type, enabled=cfg.parallel.amp),
        train_set=train_set, val_set=val_set, batches_per_epoch=batches,
        config_dict=_resolved(cfg, strategy, info),
    )
    return trainer


def _check_out(out: str) -> None:
    """Refuse an ``--out`` that is a file before any work is done (nothing is written)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out '{out}' is an existing file, not a directory")


def train(cfg: TrainConfig, given: frozenset[str] = frozenset()) -> int:
    """``tandem train``: fit (or only validate). ``given``: fields typed on the command line."""
    cfg, ckpt, notes = resumed_config(cfg, given)
    model_info(cfg.model.arch)  # a bad --arch fails before any data is loaded
    if cfg.run.evaluate:
        note = None
        if ckpt is not None and foreign.is_foreign(ckpt):  # as the example's own -e
            cfg, note = foreign.eval_settings(cfg, given, cfg.run.resume)
        result = _validate(cfg, ckpt, cfg.run.resume)
        if result["is_main"]:
            if note:
                print(note)
            print(f"val loss {result['loss']:.4f} acc {result['acc1']:.2f}% acc5 "
                  f"{result['acc5']:.2f}% ({result['count']} images)")
        return 0
    if ckpt is not None:  # before anything is built or written
        line = complete_line(cfg, ckpt, given)
        if line is not None:
            if os.environ.get("RANK", "0") == "0":  # one line, from the first process
                print(line, flush=True)
            return 0
        check_launched(cfg, ckpt, given)
    _check_out(cfg.run.out)
    strategy = build_strategy(cfg.parallel)
    try:
        trainer = _build_trainer(cfg, strategy, ckpt)
        seconds = _warm_up(trainer, train=True)
        if seconds is not None and strategy.is_main:
            print(compiling.describe(seconds, cfg.parallel.compile_mode), flush=True)
        if ckpt is not None:
            notes += restore(trainer, ckpt, cfg.run.resume)
            check_max_steps(cfg, ckpt, trainer.position.step)  # a file from elsewhere's
            if foreign.is_foreign(ckpt):
                notes += foreign.assumed(trainer.cfg, given, trainer.config_dict)
        keep = prepare_out(cfg, ckpt, strategy, trainer.position.epoch)
        if strategy.is_main:
            if ckpt is not None:
                say_resuming(trainer, cfg.run.resume, notes)
            with open(os.path.join(cfg.run.out, "config.json"), "w", encoding="utf-8") as f:
                json.dump(trainer.config_dict, f, indent=2)
        log = (MetricsLog(os.path.join(cfg.run.out, "metrics.jsonl"), keep_epochs=keep)
               if strategy.is_main else None)
        with StopRequest(quiet=not strategy.is_main) as stop:
            trainer.fit(log, stop)
        strategy.barrier()
        return 0
    finally:
        strategy.close()


def evaluate(checkpoint_path: str, *, parallel: ParallelConfig, data: dict | None = None,
             batch_size: int | None = None, seed: int | None = None,
             label_smoothing: float | None = None, arch: str | None = None) -> dict:
    """Validate the checkpoint at ``checkpoint_path``; return its loss and accuracies.

    Architecture, data settings, loss and seed come from the checkpoint's config, each
    overridden by ``data`` / ``batch_size`` / ``label_smoothing`` / ``seed`` when given;
    ``arch`` is for a file that names none (a bare state dict) and must match one that does.
    A file without tandem's config is evaluated as the imagenet example does (plain
    cross-entropy at the arch's native size); ``note`` in the result then says so. Never
    augments.
    """
    ckpt = checkpoint.load(checkpoint_path)
    arch = foreign.checkpoint_arch(ckpt, arch, checkpoint_path)
    saved = TrainConfig.from_dict(ckpt.get("config") or {})
    optim = replace(saved.optim, **{k: v for k, v in (("batch_size", batch_size),
                                                       ("label_smoothing", label_smoothing))
                                    if v is not None})
    cfg = TrainConfig(model=replace(saved.model, arch=arch),
                      data=replace(saved.data, **(data or {})), optim=optim, parallel=parallel,
                      run=saved.run if seed is None else replace(saved.run, seed=seed))
    note = None
    if foreign.is_foreign(ckpt):
        given = set(data or {}) | ({"label_smoothing"} if label_smoothing is not None else set())
        cfg, note = foreign.eval_settings(cfg, frozenset(given), checkpoint_path)
    return dict(_validate(cfg, ckpt, checkpoint_path), note=note)


def _validate(cfg: TrainConfig, ckpt: dict | None, path: str | None) -> dict:
    """Validate ``cfg``'s model (with ``ckpt``'s weights from ``path``, if any): one pass over
    the validation set, the same for ``tandem eval`` and ``tandem train -e``."""
    strategy = build_strategy(cfg.parallel)
    try:
        _, val_set, info = build_data(cfg.data, cfg.run.seed, splits=("val",))
        cfg = _with_model_classes(cfg, info, ckpt)
        trainer = Trainer(cfg=cfg, strategy=strategy,
                          model=_prepared_model(cfg, strategy, ckpt, info, path),
                          criterion=make_criterion(cfg.optim, strategy), optimizer=None,
                          scheduler=None, scaler=None, train_set=None, val_set=val_set,
                          batches_per_epoch=0, config_dict={})
        seconds = _warm_up(trainer, train=False)
        val = trainer.validate()
        return {"arch": cfg.model.arch, "loss": val.loss, "acc": val.acc, "acc1": val.acc,
                "acc5": val.acc5, "count": val.count, "compile_seconds": seconds,
                "is_main": strategy.is_main}
    finally:
        strategy.close()
