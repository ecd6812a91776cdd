"""Running a :class:`~tandem.config.TrainConfig`: ``train``, and the validation pass it shares
with ``tandem eval`` (:mod:`.evaluate`).

``execute`` reads top to bottom: the strategy is launched and the run built (data, the model
of :mod:`.model_setup`, the optimizer on what setup returned), the checkpoint's states
restored, the run directory opened (:mod:`.opening`), and the fit. ``tandem.fit`` runs the
same path with the model, data sets and criterion it was handed (:class:`~.plan.Supplied`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tandem import cpu_malloc
from tandem.config import DataConfig, OptimConfig, TrainConfig
from tandem.data import batches_per_epoch, load_dataset
from tandem.data.device_decode import decode_on, decoded_on
from tandem.distributed.env import cpu_bf16_override, is_main_process, launch_id, speaks_for_node
from tandem.errors import UsageError
from tandem.model_state import load_plain_state_dict
from tandem.precision import amp_precision
from tandem.strategies import Strategy
from tandem.strategies.outputs import label_smoothing

from . import auto, foreign, runlock, warmup
from .start import precision_line
from .interrupt import StopRequest
from .loop import Trainer
from .metrics import eval_scores
from .model_setup import build_model, prepared_model, seed_everything, with_model_classes
from .opening import open_run_dir, say_starting
from .plan import EVALUATE, RunPlan, plan_train
from .resume import check_max_steps, restore
from .schedule import make_scheduler

__all__ = ["train", "execute", "validate", "build_data", "build_model", "make_criterion",
           "make_optimizer", "seed_everything"]


def _warm_up(trainer: Trainer, train: bool) -> float | None:
    """With ``--compile``: compile now, before any clock runs (saying how long it took on the
    main process); the seconds it took, else None."""
    if not trainer.cfg.parallel.compile:
        return None
    seconds = warmup.warm_up(trainer, train=train)
    if train and trainer.strategy.is_main:
        print(warmup.describe(seconds, trainer.cfg.parallel.compile_mode), flush=True)
    return seconds


def build_data(cfg: DataConfig, seed: int, splits: tuple[str, ...] = ("train", "val")):
    return load_dataset(cfg.data, augment=cfg.augment, seed=seed, image_size=cfg.image_size,
                        synthetic_size=cfg.synthetic_size, num_classes=cfg.num_classes,
                        splits=splits)


def _data(plan: RunPlan, splits: tuple[str, ...] = ("train", "val"), decoded: bool = True):
    """``(train, val, info)``: the data sets handed over, else those the config names
    (``decoded``: as the run reads them, decoded where ``--decode`` says; else as built, for
    their shapes only)."""
    if plan.supplied.data is None:  # --decode gpu: its ImageFolder data decoded on the device
        data = build_data(plan.cfg.data, plan.cfg.run.seed, splits)
        return decode_on(data, plan.cfg.data.decode, plan.strategy.device) if decoded else data
    train_set, val_set, info = plan.supplied.data
    return (train_set if "train" in splits else None), val_set, info


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


def _resolved(cfg: TrainConfig, strategy: Strategy, info, datasets) -> dict:
    """The run's settings plus what they resolved to (written to config.json and checkpoints):
    the devices, the data set, where ``datasets``' JPEGs are decoded (``--decode auto``)."""
    out = cfg.settings()
    out["resolved"] = {
        "devices": [str(d) for d in strategy.devices],
        "world_size": strategy.world_size,
        "dataset": {"name": info.name, "num_classes": info.num_classes,
                    "in_channels": info.in_channels, "image_size": info.image_size},
        "decode": decoded_on(*datasets),
        "images_per_step": cfg.optim.batch_size * cfg.optim.accum_steps,
        "launch_id": launch_id(),
    }
    return out


def _build(plan: RunPlan) -> dict:
    """The trainer's parts for ``plan``: data, the model with its weights, optimizer,
    schedule and scaler, and the resolved config (the keyword arguments of :class:`Trainer`)."""
    strategy = plan.strategy
    train_set, val_set, info = _data(plan)
    cfg = with_model_classes(plan.cfg, info, plan.checkpoint)
    wrapped = prepared_model(plan, cfg, info, train_set)
    optim = cfg.optim
    optimizer = make_optimizer(optim, wrapped.parameters())
    batches = batches_per_epoch(train_set, optim.batch_size)
    return dict(
        cfg=cfg, strategy=strategy, model=wrapped,
        criterion=make_criterion(optim, strategy, plan.supplied.criterion),
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, optim, -(-batches // optim.accum_steps)),
        scaler=amp_precision(strategy.device.type, cfg.parallel.amp, cfg.parallel.amp_dtype,
                             cpu_bf16=cpu_bf16_override()).scaler(),
        train_set=train_set, val_set=val_set, batches_per_epoch=batches,
        config_dict=auto.recorded(_resolved(cfg, strategy, info, (train_set, val_set)), plan))


def _restore(plan: RunPlan, parts: dict) -> tuple[dict, list[str]]:
    """Where the trainer starts (the checkpoint's position, best accuracy, RNG, with its
    optimizer, schedule and scaler loaded into ``parts``) and the lines to say about it."""
    if plan.checkpoint is None:
        return {}, []
    ckpt, path, cfg = plan.checkpoint, plan.resume_path, parts["cfg"]
    model, optimizer = parts["model"], parts["optimizer"]
    start, notes = restore(ckpt, path, cfg, parts["batches_per_epoch"], optimizer,
                           parts["scheduler"], parts["scaler"], plan.strategy.device,
                           lambda state: plan.strategy.load_optimizer_state_dict(
                               model, optimizer, state))
    plan.strategy.split.load_state_dict(ckpt.get("split"))  # --split auto's shares
    if foreign.is_foreign(ckpt):
        check_max_steps(cfg, ckpt, start["position"].step)  # now that its steps are known
        notes += foreign.assumed(cfg, plan.given, parts["config_dict"], ckpt)
    return start, [*plan.notes, *notes]


def train(cfg: TrainConfig, given: frozenset[str] = frozenset(),
          opening: tuple[str, ...] = ()) -> int:
    """``tandem train``: fit (or only validate). ``given``: fields typed on the command line;
    ``opening``: lines the command line has to say as the run starts."""
    execute(plan_train(cfg, given, opening=opening))  # every check, before anything is done
    return 0


def execute(plan: RunPlan | str) -> dict | None:
    """Run ``plan`` (:func:`~.plan.plan_train`'s): fit, or validate only; return the last
    metrics row (the validation's figures with ``-e``), on the main process, else ``None``.
    A supplied model is left holding the final weights."""
    if isinstance(plan, str):  # a complete run: one line, from the first process
        if is_main_process():
            print(plan, flush=True)
        return None
    if plan.mode == EVALUATE:
        return _print_validation(plan)
    plan = auto.settle(plan)  # --strategy auto: race now, once
    # the main process holds the run directory's lock from before it writes until the end
    locked = runlock.held(plan.run_dir) if plan.strategy.is_main else contextlib.nullcontext()
    cpu_malloc.tune()  # a process that trains keeps its step's memory (tandem.cpu_malloc)
    with locked, plan.strategy as strategy:  # joins the process group (ddp); always leaves it
        parts = _build(plan)
        start, notes = _restore(plan, parts)
        trainer = Trainer(**parts, **start)
        _warm_up(trainer, train=True)
        log = open_run_dir(plan, trainer, notes)
        if strategy.is_main:
            say_starting(plan, trainer)
        with StopRequest(quiet=not speaks_for_node(), when=strategy.stops_when) as stop:
            records = trainer.fit(log, stop)
        if plan.supplied.model is not None:
            load_plain_state_dict(plan.supplied.model, strategy.state_dict(trainer.model))
        strategy.barrier()
    return records[-1] if records and strategy.is_main else None


def _print_validation(plan: RunPlan) -> dict | None:
    """``train -e``: validate and print one line (and what a file from elsewhere assumed)."""
    result = validate(plan)
    if not result["is_main"]:
        return None
    for note in plan.notes:
        print(note.replace(foreign.DATA_SIZE, f"{result['image_size']}px"))
    if result["precision"]:
        print(result["precision"])
    print(f"{eval_scores(result)} ({result['count']} images)")
    return {"val_loss": result["loss"], "val_acc": result["acc1"],
            "val_acc5": result["acc5"], "count": result["count"]}


def validate(plan: RunPlan) -> dict:
    """One pass over the validation set of the plan's model (with its checkpoint's weights,
    if any), the same for ``tandem eval`` and ``tandem train -e``."""
    with plan.strategy as strategy:
        _, val_set, info = _data(plan, splits=("val",))
        if val_set is None:
            raise UsageError("no validation data to evaluate on (val_data is None)")
        cfg = with_model_classes(plan.cfg, info, plan.checkpoint)
        trainer = Trainer(cfg=cfg, strategy=strategy, model=prepared_model(plan, cfg, info, val_set),
                          criterion=make_criterion(cfg.optim, strategy, plan.supplied.criterion),
                          optimizer=None,
                          scheduler=None, scaler=None, train_set=None, val_set=val_set,
                          batches_per_epoch=0, config_dict={})
        seconds = _warm_up(trainer, train=False)
        val = trainer.validate()
        smoothing = label_smoothing(trainer.criterion)
        return {"arch": cfg.model.arch, "loss": val.loss, "label_smoothing": smoothing,
                "plain_ce": val.ce if smoothing else None, "acc": val.acc, "acc1": val.acc,
                "acc5": val.acc5, **({"miou": val.miou} if val.dense else {}),
                "count": val.count, "compile_seconds": seconds,
                "is_main": strategy.is_main, "image_size": info.image_size,
                "precision": precision_line(amp_precision(
                    strategy.device.type, cfg.parallel.amp, cfg.parallel.amp_dtype,
                    cpu_bf16=cpu_bf16_override()))}
