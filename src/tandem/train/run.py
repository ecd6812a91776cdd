"""Assembling a run from a :class:`~tandem.config.TrainConfig`: ``train`` and ``evaluate``.

``train`` reads top to bottom: the plan (every check, :mod:`.plan`), then the strategy is
launched and the run built: data, the model seeded and built **on the CPU** (initial weights
never depend on devices), set up by the strategy and given its weights by it, the optimizer
on what setup returned; then the checkpoint's states restored, the run directory made ready,
and the fit. ``tandem.fit`` runs the same path with the model, data sets and criterion it was
handed (:class:`~.plan.Supplied`) in place of those the config names.
"""

from __future__ import annotations

import contextlib
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
from tandem.data.load import GIVEN_DATA
from tandem.distributed.env import LAUNCH_ID_VAR, restart_count
from tandem.data.given import GivenDataset
from tandem.errors import UsageError, first_line
from tandem.factory import is_reference
from tandem.model_state import load_plain_state_dict
from tandem.models import create_model, model_info
from tandem.pretrained import load_pretrained
from tandem.precision import amp_precision
from tandem.strategies import Strategy
from tandem.strategies.compile import compiled

from . import compile as compiling
from . import auto, foreign, runlock
from .start import example_block, precision_line, size_line
from .interrupt import StopRequest
from .loop import Trainer
from .metrics import MetricsLog, eval_scores
from .plan import (EVALUATE, FORKED, FRESH, RESUMED, RunPlan, check_model, plan_eval,
                   plan_train)
from .resume import check_max_steps, restore
from .rundir import checkpoint_path as checkpoint_path_of
from .schedule import make_scheduler

__all__ = ["train", "execute", "evaluate", "build_data", "build_model", "make_criterion",
           "make_optimizer", "seed_everything"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _warm_up(trainer: Trainer, train: bool) -> float | None:
    """With ``--compile``: compile now, before any clock runs (saying how long it took on the
    main process); the seconds it took, else None."""
    if not trainer.cfg.parallel.compile:
        return None
    seconds = compiling.warm_up(trainer, train=train)
    if train and trainer.strategy.is_main:
        print(compiling.describe(seconds, trainer.cfg.parallel.compile_mode), flush=True)
    return seconds


def build_data(cfg: DataConfig, seed: int, splits: tuple[str, ...] = ("train", "val")):
    return load_dataset(cfg.data, augment=cfg.augment, seed=seed, image_size=cfg.image_size,
                        synthetic_size=cfg.synthetic_size, num_classes=cfg.num_classes,
                        splits=splits)


def _data(plan: RunPlan, splits: tuple[str, ...] = ("train", "val")):
    """``(train, val, info)``: the data sets handed over, else those the config names."""
    if plan.supplied.data is None:
        return build_data(plan.cfg.data, plan.cfg.run.seed, splits)
    train_set, val_set, info = plan.supplied.data
    return (train_set if "train" in splits else None), val_set, info


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


def make_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    """SGD as ``cfg`` sets it (learning rate, momentum, weight decay, Nesterov)."""
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)


def make_criterion(cfg: OptimConfig, strategy: Strategy, given=None) -> nn.Module:
    """Cross-entropy, the same in training, validation and ``tandem eval``; or the criterion
    handed to ``tandem.fit`` (``given``), moved to the strategy's device."""
    if given is not None:
        return given.to(strategy.device) if isinstance(given, nn.Module) else given
    return nn.CrossEntropyLoss(ignore_index=cfg.ignore_index,
                               label_smoothing=cfg.label_smoothing).to(strategy.device)


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


def _check_inputs(model: nn.Module, dataset, dtype: torch.dtype) -> None:
    """Refuse, in one line, a model that cannot take a user's data set's inputs (flat vectors
    into a conv net): one forward of a batch of one zero input, in eval mode (no state
    changes), that says which shape the model got."""
    if not isinstance(dataset, GivenDataset):
        return
    x = torch.zeros((1, *dataset.shape), dtype=dtype)
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            model(x)
    except (RuntimeError, ValueError) as exc:  # shape and size mismatches
        raise UsageError(f"the model cannot take {dataset.name}'s inputs: it got a batch of "
                         f"shape {tuple(x.shape)} (inputs of shape {dataset.shape}) and "
                         f"raised {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        model.train(was_training)


def _prepared_model(plan: RunPlan, cfg: TrainConfig, info, dataset=None) -> nn.Module:
    """The model of ``cfg`` (``cfg.data.num_classes`` outputs, see :func:`_with_model_classes`)
    set up by the plan's strategy, then given its weights by it (the checkpoint's, or
    ``--pretrained``): the same for training and for validation."""
    strategy, ckpt, given = plan.strategy, plan.checkpoint, plan.supplied.model
    if given is None:
        model = build_model(cfg.model, replace(info, num_classes=cfg.data.num_classes),
                            cfg.run.seed)
        if is_reference(cfg.model.arch):  # a factory's model, seen for the first time (the
            check_model(strategy, model)  # plan checked a zoo model on the meta device)
    else:  # the user's model, its weights as they are; the RNG where a built one starts
        seed_everything(cfg.run.seed)
        model = given
    model = model.to(getattr(torch, cfg.parallel.dtype))
    _check_inputs(model, dataset, getattr(torch, cfg.parallel.dtype))
    if cfg.parallel.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.parallel.compile:
        model = compiled(model, cfg.parallel.compile_mode)
    wrapped = strategy.setup(model)
    if ckpt is not None:
        checkpoint.load_weights(wrapped, ckpt["state_dict"], cfg.run.resume,
                                strategy.load_state_dict)
    elif cfg.model.pretrained:
        line = load_pretrained(wrapped, cfg.model.pretrained, cfg.model.arch, strategy)
        if strategy.is_main:
            print(line, flush=True)
    return wrapped


def _build(plan: RunPlan) -> dict:
    """The trainer's parts for ``plan``: data, the model with its weights, optimizer,
    schedule and scaler, and the resolved config (the keyword arguments of :class:`Trainer`)."""
    strategy = plan.strategy
    train_set, val_set, info = _data(plan)
    cfg = _with_model_classes(plan.cfg, info, plan.checkpoint)
    wrapped = _prepared_model(plan, cfg, info, train_set)
    optim = cfg.optim
    optimizer = make_optimizer(optim, wrapped.parameters())
    batches = batches_per_epoch(train_set, optim.batch_size)
    return dict(
        cfg=cfg, strategy=strategy, model=wrapped,
        criterion=make_criterion(optim, strategy, plan.supplied.criterion),
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, optim, -(-batches // optim.accum_steps)),
        scaler=amp_precision(strategy.device.type, cfg.parallel.amp,
                             cfg.parallel.amp_dtype).scaler(),
        train_set=train_set, val_set=val_set, batches_per_epoch=batches,
        config_dict=auto.recorded(_resolved(cfg, strategy, info), plan))


def _restore(plan: RunPlan, parts: dict) -> tuple[dict, list[str]]:
    """Where the trainer starts (the checkpoint's position, best accuracy, RNG, with its
    optimizer, schedule and scaler loaded into ``parts``) and the lines to say about it."""
    if plan.checkpoint is None:
        return {}, []
    ckpt, path, cfg = plan.checkpoint, plan.resume_path, parts["cfg"]
    start, notes = restore(ckpt, path, cfg, parts["batches_per_epoch"], parts["optimizer"],
                           parts["scheduler"], parts["scaler"])
    plan.strategy.load_split_state(parts["model"], ckpt.get("split"))  # --split auto's shares
    if foreign.is_foreign(ckpt):
        check_max_steps(cfg, ckpt, start["position"].step)  # now that its steps are known
        notes += foreign.assumed(cfg, plan.given, parts["config_dict"])
    return start, [*plan.notes, *notes]


def _open_run_dir(plan: RunPlan, trainer: Trainer, notes: list[str]) -> MetricsLog | None:
    """Make the plan's run directory what the run needs (the main process writes); say how
    a resume goes on; the metrics log to append to (``None`` on other processes)."""
    strategy, run = plan.strategy, plan.run_dir
    strategy.barrier()  # every process has checked --out before the main one writes there
    if not strategy.is_main:
        return None
    run.create()
    if plan.mode != RESUMED:
        run.clear()
    if plan.mode == FORKED:
        run.fork_from(plan.source)
    if plan.checkpoint is not None:
        _say_resuming(trainer, plan.resume_path, notes)
    if plan.mode != RESUMED:  # a resume's changes go in with its next checkpoint (Trainer.save)
        run.write_config(trainer.config_dict)
    return run.metrics_log(keep_epochs=None if plan.mode == FRESH else trainer.position.epoch)


def _say_resuming(trainer: Trainer, path: str, notes: list[str]) -> None:
    """The ``resuming`` line (naming a torchrun restart), then one line per accepted change."""
    pos, restarts = trainer.position, restart_count()
    print(f"resuming {path} at epoch {pos.epoch + 1}/{trainer.cfg.optim.epochs}, step "
          f"{pos.step} ({pos.batch}/{trainer.batches_per_epoch} batches of the epoch done)"
          + (f" (torchrun restart {restarts})" if restarts else ""), flush=True)
    for note in notes:
        print(f"  {note}", flush=True)


def _say_starting(plan: RunPlan, trainer: Trainer) -> None:
    """A fresh run's image size and how tandem's defaults differ from the imagenet example's
    (a run from another program's file says both in :func:`.foreign.assumed`); any run's
    precision under ``--amp``."""
    cfg, lines = trainer.cfg, []
    if plan.checkpoint is None and plan.supplied.data is None:  # a file's: foreign.assumed
        size = trainer.config_dict["resolved"]["dataset"]["image_size"]
        lines += [size_line(cfg, plan.given, size), *example_block(cfg, plan.given)]
    p = cfg.parallel
    lines.append(precision_line(amp_precision(plan.strategy.device.type, p.amp,
                                                    p.amp_dtype), " (--amp)"))
    for line in lines:
        if line:
            print(line, flush=True)


def train(cfg: TrainConfig, given: frozenset[str] = frozenset()) -> int:
    """``tandem train``: fit (or only validate). ``given``: fields typed on the command line."""
    execute(plan_train(cfg, given))  # the plan: every check, before anything is done
    return 0


def execute(plan: RunPlan | str) -> dict | None:
    """Run ``plan`` (:func:`~.plan.plan_train`'s): fit, or validate only; return the last
    metrics row (the validation's figures with ``-e``), on the main process, else ``None``.
    A supplied model is left holding the final weights."""
    if isinstance(plan, str):  # a complete run: one line, from the first process
        if os.environ.get("RANK", "0") == "0":
            print(plan, flush=True)
        return None
    if plan.mode == EVALUATE:
        return _print_validation(plan)
    plan = auto.settle(plan)  # --strategy auto: race now, once
    # the main process holds the run directory's lock from before it writes until the end
    locked = runlock.held(plan.run_dir) if plan.strategy.is_main else contextlib.nullcontext()
    with locked, plan.strategy as strategy:  # joins the process group (ddp); always leaves it
        parts = _build(plan)
        start, notes = _restore(plan, parts)
        trainer = Trainer(**parts, **start)
        _warm_up(trainer, train=True)
        log = _open_run_dir(plan, trainer, notes)
        if strategy.is_main:
            _say_starting(plan, trainer)
        with StopRequest(quiet=not strategy.is_main, when=strategy.stops_when) as stop:
            records = trainer.fit(log, stop)
        if plan.supplied.model is not None:
            load_plain_state_dict(plan.supplied.model, strategy.state_dict(trainer.model))
        strategy.barrier()
    return records[-1] if records and strategy.is_main else None


def _print_validation(plan: RunPlan) -> dict | None:
    """``train -e``: validate and print one line (and what a file from elsewhere assumed)."""
    result = _validate(plan)
    if not result["is_main"]:
        return None
    for note in plan.notes:
        print(note.replace(foreign.DATA_SIZE, f"{result['image_size']}px"))
    if result["precision"]:
        print(result["precision"])
    print(f"val loss {result['loss']:.4f} {eval_scores(result)} ({result['count']} images)")
    return {"val_loss": result["loss"], "val_acc": result["acc1"],
            "val_acc5": result["acc5"], "count": result["count"]}


def _run_precision(parallel: ParallelConfig, saved: TrainConfig, amp: bool | None,
                   amp_dtype: str | None) -> tuple[ParallelConfig, str]:
    """``parallel`` with the ``--amp`` an eval uses: as typed (``amp``, ``amp_dtype``), else the
    run's; and the words for where it came from."""
    if amp is not None or amp_dtype is not None:
        return replace(parallel, amp=bool(amp) or amp_dtype is not None,
                       amp_dtype=amp_dtype), " (as given)"
    if not saved.parallel.amp:
        return replace(parallel, amp=False, amp_dtype=None), ""
    return (replace(parallel, amp=True, amp_dtype=saved.parallel.amp_dtype),
            " (the run's --amp; --no-amp for float32)")


def evaluate(checkpoint_path: str, *, parallel: ParallelConfig, data: dict | None = None,
             batch_size: int | None = None, seed: int | None = None,
             label_smoothing: float | None = None, arch: str | None = None,
             amp: bool | None = None, amp_dtype: str | None = None) -> dict:
    """Validate the checkpoint at ``checkpoint_path``; return its loss and accuracies.

    Architecture, data settings, loss and seed come from the checkpoint's config, each
    overridden by ``data`` / ``batch_size`` / ``label_smoothing`` / ``seed`` when given;
    ``arch`` is for a file that names none (a bare state dict) and must match one that does.
    A tandem run is evaluated at its own image size and precision (``amp``/``amp_dtype``:
    ``None`` takes the run's). A file without tandem's config is evaluated as the imagenet
    example does (plain cross-entropy, at the size of :func:`.start.size_rule`); ``note`` in
    the result then says so. Never augments.
    """
    checkpoint_path = checkpoint_path_of(checkpoint_path)  # a run directory: its latest
    ckpt = checkpoint.load(checkpoint_path)
    arch = foreign.checkpoint_arch(ckpt, arch, checkpoint_path)
    saved = TrainConfig.from_dict(ckpt.get("config") or {})
    optim = replace(saved.optim, **{k: v for k, v in (("batch_size", batch_size),
                                                       ("label_smoothing", label_smoothing))
                                    if v is not None})
    parallel, source = _run_precision(parallel, saved, amp, amp_dtype)
    trained_at = ((ckpt.get("config") or {}).get("resolved") or {}).get("dataset") or {}
    spec = (data or {}).get("data", saved.data.data)
    if saved.data.image_size is None and trained_at.get("image_size") and \
            not is_reference(spec) and spec != GIVEN_DATA:  # the run's own size (tandem's data)
        saved = replace(saved, data=replace(saved.data, image_size=trained_at["image_size"]))
    cfg = TrainConfig(model=replace(saved.model, arch=arch),
                      data=replace(saved.data, **(data or {})), optim=optim, parallel=parallel,
                      run=saved.run if seed is None else replace(saved.run, seed=seed))
    note = None
    if foreign.is_foreign(ckpt):
        given = set(data or {}) | ({"label_smoothing"} if label_smoothing is not None else set())
        cfg, note = foreign.eval_settings(cfg, frozenset(given), checkpoint_path)
    cfg = replace(cfg, run=replace(cfg.run, resume=checkpoint_path))
    result = _validate(plan_eval(cfg, ckpt))
    if note:
        note = note.replace(foreign.DATA_SIZE, f"{result['image_size']}px")
    if result["precision"]:
        result["precision"] += source
    return dict(result, note=note)


def _validate(plan: RunPlan) -> dict:
    """One pass over the validation set of the plan's model (with its checkpoint's weights,
    if any), the same for ``tandem eval`` and ``tandem train -e``."""
    with plan.strategy as strategy:
        _, val_set, info = _data(plan, splits=("val",))
        if val_set is None:
            raise UsageError("no validation data to evaluate on (val_data is None)")
        cfg = _with_model_classes(plan.cfg, info, plan.checkpoint)
        trainer = Trainer(cfg=cfg, strategy=strategy, model=_prepared_model(plan, cfg, info, val_set),
                          criterion=make_criterion(cfg.optim, strategy, plan.supplied.criterion),
                          optimizer=None,
                          scheduler=None, scaler=None, train_set=None, val_set=val_set,
                          batches_per_epoch=0, config_dict={})
        seconds = _warm_up(trainer, train=False)
        val = trainer.validate()
        return {"arch": cfg.model.arch, "loss": val.loss, "acc": val.acc, "acc1": val.acc,
                "acc5": val.acc5, **({"miou": val.miou} if val.dense else {}),
                "count": val.count, "compile_seconds": seconds,
                "is_main": strategy.is_main, "image_size": info.image_size,
                "precision": precision_line(amp_precision(
                    strategy.device.type, cfg.parallel.amp, cfg.parallel.amp_dtype))}
