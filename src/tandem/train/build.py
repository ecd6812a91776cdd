"""What a plan builds before the loop runs: the data, the model with its weights, the
optimizer, the schedule and the scaler (with the recipe's clip and EMA, :mod:`.recipe`), and
the checkpoint's states restored (settings → :mod:`.plan` → build → :mod:`.loop`).

The model is built on the CPU from a seed (initial weights never depend on devices), checked
against a user's data, set up by the strategy and given its weights (the checkpoint's, or
``--pretrained``). :func:`build` returns the :class:`~.loop.Trainer`'s parts; :func:`restore`
loads a checkpoint's optimizer, schedule, scaler and RNG into them and says where the trainer
starts. ``tandem.fit`` runs the same path with the model, data sets and criterion it was handed
(:class:`~.plan.Supplied`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tandem import checkpoint
from tandem.checkpoint import compat as checkpoint_compat
from tandem.config import OptimConfig, TrainConfig
from tandem.data import batches_per_epoch
from tandem.data.device_decode import decode_on, decoded_on
from tandem.distributed.env import cpu_bf16_override, launch_id
from tandem.errors import CheckpointError, UsageError, first_line, param
from tandem.factory import is_reference
from tandem.keyed import KEYED, keyed_dropout
from tandem.precision import amp_precision
from tandem.pretrained import load_pretrained
from tandem.strategies import Strategy
from tandem.strategies.compile import compiled

from . import settings
from .loop import Position
from .plan import (EVALUATE, RunPlan, build_data, build_model, check_fits, check_max_steps,
                   check_model, saved_position, seed_everything)
from .recipe import make_clip, make_ema, make_optimizer, scaled_lr
from .schedule import lr_factor, make_scheduler

__all__ = ["build", "resumed", "restore", "data", "prepared_model", "with_model_classes",
           "make_criterion", "mixing_of"]


def data(plan: RunPlan, splits: tuple[str, ...] = ("train", "val")):
    """``(train, val, info)``: the data sets handed over, else those the config names (read
    by the plan for its race, or now), decoded where ``--decode`` says."""
    if plan.supplied.data is None:  # --decode gpu: its ImageFolder data decoded on the device
        read = plan.data if plan.data is not None else build_data(plan.cfg.data,
                                                                  plan.cfg.run.seed, splits)
        return decode_on(read, plan.cfg.data.decode, plan.strategy.device,
                         say=plan.mode != EVALUATE)  # tandem eval, train -e: no run to tell of
    train_set, val_set, info = plan.supplied.data
    return (train_set if "train" in splits else None), val_set, info


def make_criterion(cfg: OptimConfig, strategy: Strategy, given=None) -> nn.Module:
    """Cross-entropy, the same in training, validation and ``tandem eval``; or the criterion
    handed to ``tandem.fit`` (``given``), moved to the strategy's device."""
    if given is not None:
        return given.to(strategy.device) if isinstance(given, nn.Module) else given
    return nn.CrossEntropyLoss(ignore_index=cfg.ignore_index,
                               label_smoothing=cfg.label_smoothing).to(strategy.device)


def mixing_of(cfg: TrainConfig, train_set):
    """The run's mixup and cutmix (:class:`~tandem.data.mixing.Mixing`) over the model's
    classes, or None when off; refused for data whose targets are not class indices."""
    mixing = cfg.data.mixing(cfg.data.num_classes)
    if mixing is not None and getattr(train_set, "target_shape", ()):
        raise UsageError(f"{param('mixup')} and {param('cutmix')} mix class-index targets; "
                         f"this data's targets are {tuple(train_set.target_shape)} per sample")
    return mixing


def _resolved(plan: RunPlan, cfg: TrainConfig, info, datasets) -> dict:
    """The run's settings plus what they resolved to (written to config.json and checkpoints):
    the devices, the data set, where ``datasets``' JPEGs are decoded (``--decode auto``), and
    ``--strategy auto``'s race (this run's, or the resumed run's)."""
    strategy = plan.strategy
    out = cfg.settings()
    out["resolved"] = {
        "devices": [str(d) for d in strategy.devices],
        "world_size": strategy.world_size,
        "dataset": {"name": info.name, "num_classes": info.num_classes,
                    "in_channels": info.in_channels, "image_size": info.image_size},
        "decode": decoded_on(*datasets),
        "images_per_step": cfg.optim.batch_size * cfg.optim.accum_steps,
        "lr": scaled_lr(cfg.optim),  # --lr after --lr-scale
        "wd_exclude_norm": cfg.optim.excludes_norm(),
        "launch_id": launch_id(),
    }
    race = plan.race or settings.race_record(plan.checkpoint)
    if race is not None:
        out["resolved"]["auto"] = race
    return out


def same_data(agreement, train_set, val_set, info) -> None:
    """Every rank's data against rank 0's (its size, classes and images): each machine reads
    its own copy, and copies that differ would give the ranks different batches (one line,
    before any step)."""
    size = lambda dataset: None if dataset is None else len(dataset)  # noqa: E731
    agreement.settings({"training samples": size(train_set), "validation samples":
                        size(val_set), "classes": info.num_classes, "image size":
                        info.image_size, "channels": info.in_channels}, named=str,
                       what="every node must have the same data (see --data)")


def build(plan: RunPlan) -> dict:
    """The trainer's parts for ``plan``: data, the model with its weights, optimizer,
    schedule and scaler, the clip and the EMA, and the resolved config (the keyword arguments
    of :class:`Trainer`)."""
    strategy = plan.strategy
    train_set, val_set, info = data(plan)
    same_data(plan.agreement, train_set, val_set, info)
    cfg = with_model_classes(plan.cfg, info, plan.checkpoint)
    wrapped = prepared_model(plan, cfg, info, train_set)
    optim = cfg.optim
    norms = strategy.plain_norms(wrapped)  # the plain model's norms, split layers summed
    optimizer = make_optimizer(optim, wrapped.parameters(), norms)
    batches = batches_per_epoch(train_set, optim.batch_size)
    return dict(
        cfg=cfg, strategy=strategy, model=wrapped,
        criterion=make_criterion(optim, strategy, plan.supplied.criterion),
        optimizer=optimizer, clip=make_clip(optim, norms), ema=make_ema(optim, wrapped),
        scheduler=make_scheduler(optimizer, optim, -(-batches // optim.accum_steps)),
        # fp16's skipped steps agreed by every rank (tandem.distributed.agree)
        scaler=strategy.agreement.grad_scaler(strategy.device.type, amp_precision(
            strategy.device.type, cfg.parallel.amp, cfg.parallel.amp_dtype,
            cpu_bf16=cpu_bf16_override()).scaled),
        train_set=train_set, val_set=val_set, batches_per_epoch=batches,
        mixing=mixing_of(cfg, train_set),
        config_dict=_resolved(plan, cfg, info, (train_set, val_set)))


def resumed(plan: RunPlan, parts: dict) -> tuple[dict, list[str]]:
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
    if parts["ema"] is not None:
        notes += _restore_ema(parts["ema"], ckpt, path, plan.strategy, model)
    if settings.is_foreign(ckpt):
        check_max_steps(cfg, ckpt, start["position"].step)  # now that its steps are known
        notes += settings.assumed(cfg, plan.given, parts["config_dict"], ckpt)
    return start, [*plan.notes, *notes]


def _restore_ema(ema, ckpt: dict, path: str, strategy: Strategy, model: nn.Module) -> list[str]:
    """Load the checkpoint's EMA into ``ema`` through the strategy (any strategy's plain layout
    fits); a file without one starts the average from its weights, and says so."""
    entry = ckpt.get("ema")
    if entry is None:
        return [f"--model-ema: '{path}' holds no average of the weights; it starts from the "
                f"file's weights"]
    try:
        ema.load_state_dict(entry, lambda state: strategy.load_state_dict(model, state))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint '{path}': its EMA does not fit the model: "
                              f"{first_line(exc)}") from None
    return []


def with_model_classes(cfg: TrainConfig, info, ckpt: dict | None) -> TrainConfig:
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


def prepared_model(plan: RunPlan, cfg: TrainConfig, info, dataset=None) -> nn.Module:
    """The model of ``cfg`` (``cfg.data.num_classes`` outputs, see :func:`with_model_classes`)
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
    if cfg.model.dropout_rng == KEYED:  # masks keyed by sample: the same run on 1 device or N
        model = keyed_dropout(model)
    if given is not None or is_reference(cfg.model.arch):  # the zoo's models fit by build
        check_fits(model, dataset, getattr(torch, cfg.parallel.dtype), cfg.data.num_classes,
                   info.name, cfg.model.output_key, handed=given is not None)
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


def restore(ckpt: dict, path: str, cfg: TrainConfig, batches_per_epoch: int, optimizer,
            scheduler, scaler, device=None, load_optimizer=None) -> tuple[dict, list[str]]:
    """Load ``ckpt``'s optimizer, scheduler, scaler and RNG into those built for the run
    (``device``: the one this process trains on, whose generator continues the saver's;
    ``load_optimizer(state)``: the strategy's loader of a plain-layout optimizer state).

    Returns where the trainer starts (``position``, ``best_acc1``, ``carried``: its fields)
    and the lines to say about it. An imagenet-example checkpoint resumes at the start of
    epoch ``ckpt['epoch']``, with its StepLR as the run's step schedule
    (:func:`.settings.file_settings`).
    """
    steps_per_epoch = -(-batches_per_epoch // cfg.optim.accum_steps)
    epoch, batch, step = saved_position(ckpt)
    position = Position(epoch, batch, epoch * steps_per_epoch if step is None else int(step))
    if batch % cfg.optim.accum_steps and batch != batches_per_epoch:
        raise UsageError(f"checkpoint '{path}' stopped mid-accumulation; resume it with the "
                         f"--accum-steps it was saved with")
    foreign_schedule = checkpoint_compat.foreign_scheduler(ckpt)
    own_schedule = checkpoint_compat.tandem_scheduler(ckpt)
    # this run's settings of each group (momentum, weight decay, betas, ...) win over the
    # file's: kept here, put back after the load
    settings_of = [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
                   for group in optimizer.param_groups]
    notes = []
    if settings.is_foreign(ckpt) and not _takes_foreign_state(cfg.optim, optimizer):
        notes.append(f"its optimizer state is SGD's, one group: --opt {cfg.optim.optimizer}"
                     f"{' with --wd-exclude-norm on' if cfg.optim.excludes_norm() else ''} "
                     f"starts its own")
    else:
        checkpoint.load_optimizer_state(optimizer, ckpt, path, load_optimizer)
    try:
        if own_schedule is not None:
            scheduler.load_state_dict(own_schedule)
            # the lr of the step to come by this run's schedule, not the file's last lr: a
            # resume with other --epochs changed the schedule, and its first step took the old
            # one's lr (0 at a cosine's end); the same figure where nothing changed. (The
            # file's optimizer may hold the imagenet example's lr, schedule.example_lr.)
            factor = lr_factor(scheduler.last_epoch, cfg.optim, steps_per_epoch)
            for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base_lr * factor
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise UsageError(f"checkpoint '{path}' does not fit this run's scheduler or scaler: "
                         f"{first_line(exc)}") from None
    _check_optimizer_shapes(optimizer, path)
    for group, own in zip(optimizer.param_groups, settings_of):  # this run's flags win
        group.update(own)
    if own_schedule is None:  # set the lr where tandem's schedule stands
        factor = lr_factor(position.step, cfg.optim, steps_per_epoch)
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
            group.update(lr=base_lr * factor, initial_lr=base_lr)
        scheduler.last_epoch = position.step
    if ckpt.get("rng") is not None:
        checkpoint.restore_rng(ckpt["rng"], device)
    # A file from elsewhere has its best weights in a file of its own (model_best.pth.tar),
    # not here: "best" starts afresh in this run's directory, so best.pt is what it says.
    best = float(ckpt.get("best_acc1") or 0.0)
    start = {"position": position, "best_acc1": 0.0 if settings.is_foreign(ckpt) else best,
             "carried": ckpt.get("epoch_progress") if position.batch else None}
    lr = optimizer.param_groups[0]['lr']
    if foreign_schedule == "StepLR" and cfg.optim.lr_schedule == "step":
        notes.append(f"its StepLR goes on at epoch {position.epoch + 1} (lr {lr:.4g})")
    elif foreign_schedule:
        notes.append(f"its {foreign_schedule} state is not tandem's: tandem's --lr-schedule "
                     f"{cfg.optim.lr_schedule} resumes at epoch {position.epoch + 1} "
                     f"(lr {lr:.4g})")
    if settings.is_foreign(ckpt):
        notes.append(f"best.pt starts afresh in --out {cfg.run.out}: the file's best_acc1 "
                     f"{best:.2f}% was its own best model's, which this file does not hold")
    return start, notes


def _takes_foreign_state(cfg: OptimConfig, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a file from elsewhere (the imagenet example's: SGD, one group) gives its state
    to this run's optimizer: an SGD of one group."""
    return cfg.optimizer == "sgd" and len(optimizer.param_groups) == 1


def _check_optimizer_shapes(optimizer: torch.optim.Optimizer, path: str) -> None:
    """Per-parameter state must have its parameter's shape (matched by order only)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise UsageError(
                        f"checkpoint '{path}': optimizer state {name!r} has shape "
                        f"{tuple(value.shape)} but its parameter {tuple(param.shape)}; was it "
                        f"saved, before checkpoints held the plain layout, under a --strategy "
                        f"with sharded layers (it then resumes only under that one)?")
