"""What a plan builds before the loop runs (:mod:`.settings` → :mod:`.plan` → build →
:mod:`.loop`): the data, the model with its weights (built on the CPU from a seed: initial
weights never depend on devices), optimizer, schedule, scaler, and the checkpoint's states.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from tandem import checkpoint
from tandem.checkpoint import compat as checkpoint_compat
from tandem.config import ModelConfig, OptimConfig, TrainConfig
from tandem.data import batches_per_epoch, load_dataset
from tandem.data.device_decode import decode_on, decoded_on
from tandem.errors import CheckpointError, UsageError, first_line, param
from tandem.factory import is_reference
from tandem.keyed import KEYED, keyed_dropout
from tandem.models import create_model, model_info
from tandem.pretrained import load_pretrained
from tandem.strategies import Strategy
from tandem.strategies.compile import compiled
from tandem.strategies.outputs import pick_output

from . import settings
from .loop import Position
from .recipe import make_clip, make_ema, make_optimizer, scaled_lr
from .rundir import EVALUATE
from .schedule import lr_factor, make_scheduler
from .settings import check_max_steps, saved_position


def data(plan, splits: tuple[str, ...] = ("train", "val")):
    """``(train, val, info)``: the data sets handed over, else the config's, decoded."""
    if plan.supplied.data is None:
        read = plan.data if plan.data is not None else build_data(plan.cfg.data,
                                                                  plan.cfg.run.seed, splits)
        return decode_on(read, plan.cfg.data.decode, plan.strategy.device,
                         say=plan.mode != EVALUATE)  # tandem eval, train -e: no run to tell of
    train_set, val_set, info = plan.supplied.data
    return (train_set if "train" in splits else None), val_set, info


def make_criterion(cfg: OptimConfig, strategy: Strategy, given=None) -> nn.Module:
    """Cross-entropy, or the criterion handed to ``tandem.fit``, on the strategy's device."""
    if given is not None:
        return given.to(strategy.device) if isinstance(given, nn.Module) else given
    return nn.CrossEntropyLoss(ignore_index=cfg.ignore_index,
                               label_smoothing=cfg.label_smoothing).to(strategy.device)


def mixing_of(cfg: TrainConfig, train_set):
    """The run's mixup and cutmix, or None; refused for targets that are not classes."""
    mixing = cfg.data.mixing(cfg.data.num_classes)
    if mixing is not None and getattr(train_set, "target_shape", ()):
        raise UsageError(f"{param('mixup')} and {param('cutmix')} mix class-index targets; "
                         f"this data's targets are {tuple(train_set.target_shape)} per sample")
    return mixing


def _resolved(plan, cfg: TrainConfig, info, datasets) -> dict:
    """The run's settings plus what they resolved to (config.json and checkpoints)."""
    strategy = plan.strategy
    out = cfg.settings()
    out["resolved"] = {
        "devices": [str(d) for d in strategy.devices], "world_size": strategy.world_size,
        "dataset": {"name": info.name, "num_classes": info.num_classes,
                    "in_channels": info.in_channels, "image_size": info.image_size},
        "decode": decoded_on(*datasets),
        "images_per_step": cfg.optim.batch_size * cfg.optim.accum_steps,
        "lr": scaled_lr(cfg.optim),  # --lr after --lr-scale
        "wd_exclude_norm": cfg.optim.excludes_norm(), "launch_id": plan.place.launch_id,
    }
    race = plan.race or settings.race_record(plan.checkpoint)
    if race is not None:
        out["resolved"]["auto"] = race
    return out


def same_data(agreement, train_set, val_set, info) -> None:
    """Refuse data that differs from rank 0's: each machine reads its own copy."""
    size = lambda dataset: None if dataset is None else len(dataset)  # noqa: E731
    agreement.settings({"training samples": size(train_set), "validation samples":
                        size(val_set), "classes": info.num_classes, "image size":
                        info.image_size, "channels": info.in_channels}, named=str,
                       what="every node must have the same data (see --data)")


def build(plan) -> dict:
    """The trainer's parts for ``plan`` (the keyword arguments of :class:`Trainer`)."""
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
        scaler=strategy.agreement.grad_scaler(strategy.device.type, plan.precision.scaled),
        precision=plan.precision, train_set=train_set, val_set=val_set, batches_per_epoch=batches,
        mixing=mixing_of(cfg, train_set),
        config_dict=_resolved(plan, cfg, info, (train_set, val_set)))


# -- what the config names: its data sets and its model -----------------------------------------
def build_data(cfg, seed: int, splits: tuple[str, ...] = ("train", "val")):
    """``(train, val, info)`` of a :class:`~tandem.config.DataConfig`, not yet decoded."""
    return load_dataset(cfg.data, augment=cfg.augment, seed=seed, image_size=cfg.image_size,
                        synthetic_size=cfg.synthetic_size, num_classes=cfg.num_classes,
                        splits=splits, reprob=cfg.reprob)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_model(cfg: ModelConfig, info, seed: int) -> nn.Module:
    """Seed, then create ``cfg.arch`` on the CPU for ``info``'s classes, channels and size."""
    minimum = model_info(cfg.arch).min_input_size  # unknown arch: ValueError listing them
    if info.image_size < minimum:
        raise UsageError(f"{param('arch')} {cfg.arch} needs images of at least {minimum}px, but "
                         f"{info.name} gives {info.image_size}px (set {param('image_size')})")
    kwargs = {} if cfg.dropout is None else {"dropout": cfg.dropout}
    if cfg.drop_path:
        kwargs["drop_path"] = cfg.drop_path
    seed_everything(seed)
    return create_model(cfg.arch, num_classes=info.num_classes, in_channels=info.in_channels,
                        **kwargs)


def check_model(strategy: Strategy, model: nn.Module) -> None:
    """Refuse a model ``strategy`` cannot train, in one line."""
    problem = strategy.check_model(model, **strategy.options)
    if problem:
        raise UsageError(f"{param('strategy')} {strategy.name} {problem}")


def check_fits(model: nn.Module, dataset, dtype: torch.dtype, classes: int, name: str,
               output_key=None, handed: bool = False) -> None:
    """Refuse a model that cannot take the data's inputs or gives fewer outputs than there
    are classes (else the loss fails deep inside): one eval-mode forward of one zero input.
    ``handed``: the model was handed to ``tandem.fit`` (else a factory built it)."""
    shape = getattr(dataset, "shape", None)
    if shape is None:
        return
    x = torch.zeros((1, *shape), dtype=dtype)
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            out = model(x)
    except (RuntimeError, ValueError) as exc:  # shape and size mismatches
        raise UsageError(f"the model cannot take {getattr(dataset, 'name', name)}'s inputs: it "
                         f"got a batch of shape {tuple(x.shape)} (inputs of shape "
                         f"{tuple(shape)}) and raised {type(exc).__name__}: {first_line(exc)}"
                         ) from None
    finally:
        model.train(was_training)
    logits = pick_output(out, output_key)
    width = logits.shape[1] if logits.dim() >= 2 else 1
    if width < classes:
        remedy = (f"hand tandem.fit a model with {classes} outputs" if handed else
                  f"build the model with num_classes outputs (the factory is called with "
                  f"num_classes={classes})")
        raise UsageError(f"the model gives {width} output{'s' if width != 1 else ''} per "
                         f"sample, but {name} has {classes} classes (targets 0 to "
                         f"{classes - 1})", hint=remedy)


def resumed(plan, parts: dict) -> tuple[dict, list[str]]:
    """Where the trainer starts (states loaded into ``parts``) and the lines to say."""
    if plan.checkpoint is None:
        return {}, []
    ckpt, path, cfg, s = plan.checkpoint, plan.resume_path, parts["cfg"], plan.strategy
    model, optimizer = parts["model"], parts["optimizer"]
    start, notes = restore(ckpt, path, cfg, parts["batches_per_epoch"], optimizer,
                           parts["scheduler"], parts["scaler"], s.device,
                           lambda state: s.load_optimizer_state_dict(model, optimizer, state))
    s.split.load_state_dict(ckpt.get("split"))  # --split auto's shares
    if s.compressor is not None:  # --grad-compression powersgd's state
        notes += filter(None, [s.compressor.load(ckpt.get("grad_compression"), s.rank, s.device)])
    if parts["ema"] is not None:
        notes += _restore_ema(parts["ema"], ckpt, path, s, model)
    if settings.is_foreign(ckpt):  # now that its steps are known
        check_max_steps(cfg, ckpt, start["position"].step, restarted=plan.place.restart > 0)
        notes += settings.assumed(cfg, plan.given, parts["config_dict"], ckpt)
    return start, [*plan.notes, *notes]


def _restore_ema(ema, ckpt: dict, path: str, strategy: Strategy, model: nn.Module) -> list[str]:
    """Load the checkpoint's EMA into ``ema``; a file without one starts from its weights, said."""
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
    """``cfg`` with ``data.num_classes`` the model's outputs: ``--num-classes``, else a
    checkpoint's classifier when larger than the data's classes, else the data's."""
    classes = cfg.data.num_classes
    if classes is None:
        layer = checkpoint_compat.final_layer(ckpt["state_dict"]) if ckpt is not None else None
        classes = layer[1] if layer and layer[1] > info.num_classes else info.num_classes
    return replace(cfg, data=replace(cfg.data, num_classes=classes))


def prepared_model(plan, cfg: TrainConfig, info, dataset=None) -> nn.Module:
    """The model of ``cfg`` set up by the plan's strategy, with its weights."""
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
    (``load_optimizer(state)``: the strategy's loader of a plain-layout optimizer state).
    Returns the trainer's ``position``, ``best_acc1`` and ``carried``, and the lines to say."""
    steps_per_epoch = -(-batches_per_epoch // cfg.optim.accum_steps)
    epoch, batch, step = saved_position(ckpt)
    position = Position(epoch, batch, epoch * steps_per_epoch if step is None else int(step))
    if batch % cfg.optim.accum_steps and batch != batches_per_epoch:
        raise UsageError(f"checkpoint '{path}' stopped mid-accumulation; resume it with the "
                         f"--accum-steps it was saved with")
    foreign_schedule = checkpoint_compat.foreign_scheduler(ckpt)
    own_schedule = checkpoint_compat.tandem_scheduler(ckpt)
    # this run's settings of each group (momentum, weight decay, ...) win: put back after
    settings_of = [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
                   for group in optimizer.param_groups]
    notes = []
    if settings.is_foreign(ckpt) and not (cfg.optim.optimizer == "sgd"
                                          and len(optimizer.param_groups) == 1):
        notes.append(f"its optimizer state is SGD's, one group: --opt {cfg.optim.optimizer}"
                     f"{' with --wd-exclude-norm on' if cfg.optim.excludes_norm() else ''} "
                     f"starts its own")
    else:
        checkpoint.load_optimizer_state(optimizer, ckpt, path, load_optimizer)
    try:
        if own_schedule is not None:
            scheduler.load_state_dict(own_schedule)
            # the lr this run's schedule gives the next step (--epochs may differ), not the file's
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
    # a file from elsewhere keeps its best weights apart (model_best.pth.tar): best starts afresh
    best = float(ckpt.get("best_acc1") or 0.0)
    start = {"position": position, "best_acc1": 0.0 if settings.is_foreign(ckpt) else best,
             "carried": ckpt.get("epoch_progress") if position.batch else None}
    lr = optimizer.param_groups[0]['lr']
    if foreign_schedule == "StepLR" and cfg.optim.lr_schedule == "step":
        notes.append(f"its StepLR goes on at epoch {position.epoch + 1} (lr {lr:.4g})")
    elif foreign_schedule:
        notes.append(f"its {foreign_schedule} state is not tandem's: tandem's --lr-schedule "
                     f"{cfg.optim.lr_schedule} resumes at epoch {position.epoch + 1} (lr {lr:.4g})")
    if settings.is_foreign(ckpt):
        notes.append(f"best.pt starts afresh in --out {cfg.run.out}: the file's best_acc1 "
                     f"{best:.2f}% was its own best model's, which this file does not hold")
    return start, notes


def _check_optimizer_shapes(optimizer: torch.optim.Optimizer, path: str) -> None:
    """Per-parameter state must have its parameter's shape (matched by order only)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise UsageError(
                        f"checkpoint '{path}': optimizer state {name!r} has shape "
                        f"{tuple(value.shape)} but its parameter {tuple(param.shape)}",
                        hint="a checkpoint saved before checkpoints held the plain layout, "
                             "under a --strategy with sharded layers, resumes only under it")
