"""Continuing a run: its settings, then its optimizer, schedule, position and RNG.

:func:`resumed_config` finds the config and checkpoint to continue (:mod:`.rundir`);
:func:`complete_line` and :func:`check_launched` stop, before anything is built, a resume that
has nothing to do or needs its launcher (both called by the run's plan); :func:`restore` loads
the built optimizer, schedule and scaler and says where the trainer starts.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from tandem import checkpoint
from tandem.checkpoint import compat as checkpoint_compat
from tandem.config import TrainConfig
from tandem.distributed.env import (cpu_bf16_override, in_torchrun, join_timeout, launch_id,
                                    restart_count, several_processes)
from tandem.distributed.shared_resume import Continued, continue_from_rank0
from tandem.errors import UsageError, first_line
from tandem.parallel.devices import parse_device_spec
from tandem.precision import amp_flags, amp_refusal
from tandem.strategies import strategy_class, strategy_names

from . import foreign, rundir, runlock
from .position import Position
from .schedule import lr_factor

__all__ = ["resumed_config", "complete_line", "check_max_steps", "check_launched", "restore"]


def resumed_config(cfg: TrainConfig, given: frozenset[str]):
    """The config to run, the checkpoint to continue (``None`` for a fresh run) and the lines
    saying what was taken: a tandem run's settings (:mod:`.rundir`) or what a file from
    elsewhere holds (:mod:`.foreign`)."""
    path, local, restarted = _to_continue(cfg)
    if restarted and path is None:  # failed before its first save: start it again
        return replace(cfg, run=replace(cfg.run, overwrite=True)), None, []
    if path is None:
        return cfg, None, []
    ckpt = checkpoint.load(local)
    if local != path:  # rank 0's bytes, sent to this machine (shared_resume)
        os.unlink(local)
    if foreign.is_foreign(ckpt):
        cfg, notes = foreign.file_settings(cfg, given, ckpt, path)
    else:
        cfg, notes = rundir.resume_config(cfg, given, ckpt.get("config"), path)
        _check_portable(ckpt.get("config"), cfg.parallel.strategy, path)
        if "devices" not in given:
            cfg, notes = _fit_devices(cfg, notes)
        _check_precision_runs(cfg, path)
    return replace(cfg, run=replace(cfg.run, resume=path)), ckpt, notes


def _to_continue(cfg: TrainConfig) -> Continued:
    """The checkpoint this run continues (``None``: a fresh run), and whether torchrun
    restarted it. Under several processes rank 0 decides and sends the file to the ranks
    whose machine lacks it (:mod:`tandem.distributed.shared_resume`): only rank 0 writes."""
    def decide() -> tuple[str | None, bool]:
        run = rundir.RunDir(cfg.run.out)
        if not cfg.run.resume and restart_count() > 0:  # torchrun restarted the workers
            if not run.launched_by(launch_id()):
                raise UsageError(
                    f"torchrun restarted this job (restart {restart_count()}), but rank 0's "
                    f"machine holds no run of this launch in '{cfg.run.out}': it cannot be "
                    "continued, and starting it afresh would not be the run that failed; "
                    "start a new launch (with --resume, if a checkpoint of it is elsewhere)")
            return (run.latest if os.path.isfile(run.latest) else None), True
        if not cfg.run.resume:
            return None, False
        if cfg.model.pretrained:
            raise UsageError("--pretrained starts a new run from a weights file and --resume "
                             "continues a run from its checkpoint: give one of them")
        runlock.check_saved(cfg.run.resume)  # a run that has not saved yet: its process, named
        return rundir.checkpoint_path(cfg.run.resume), False

    if not cfg.run.resume and restart_count() == 0:
        return Continued(None, None, False)  # a fresh run: every rank knows it alike
    if several_processes():
        return continue_from_rank0(decide, join_timeout())
    path, restarted = decide()
    return Continued(path, path, restarted)


def _check_precision_runs(cfg: TrainConfig, path: str) -> None:
    """A run's ``--amp`` is part of what it computes and goes on as it was: refused in one
    line, naming the run's flags, on a device where it cannot run (fp16 on a CPU)."""
    p = cfg.parallel
    if not p.amp:
        return
    device = parse_device_spec(p.devices, "--devices")[0]
    refusal = amp_refusal(device.type, p.amp_dtype, cpu_bf16=cpu_bf16_override())
    if refusal is not None:
        why = "fp16 autocast is for CUDA" if p.amp_dtype == "fp16" else refusal
        raise UsageError(f"'{path}' trains with {amp_flags(p.amp_dtype)}, which cannot run on "
                         f"{device.type} ({why}); a run keeps its precision: resume it on a "
                         "device where it runs (`tandem eval` scores it here, in float32)")


def _saved_position(ckpt: dict) -> tuple[int, int, int | None]:
    """Epochs done, batches of the next one done and optimizer steps (``None``: not saved)."""
    position = ckpt.get("data_position") or {"epoch": int(ckpt.get("epoch") or 0), "batch": 0}
    return int(position["epoch"]), int(position["batch"]), position.get("step")


def complete_line(cfg: TrainConfig, ckpt: dict, given: frozenset[str],
                  by_fit: bool = False) -> str | None:
    """The one line to print, instead of training, when the resumed run has done all its
    epochs (``None`` while it has not); ``by_fit``: it was resumed by ``tandem.fit``, which
    the line then names. ``--epochs`` and ``--max-steps`` behind where it stands are
    refused: the one would shorten what is done, the other would stop before it."""
    epoch, batch, step = _saved_position(ckpt)
    path, epochs, saved = cfg.run.resume, cfg.optim.epochs, ckpt.get("config")
    target, name = _named(path, ckpt)
    if "epochs" in given and epochs < epoch + (1 if batch else 0):
        done = (f"{epoch} epoch{'' if epoch == 1 else 's'}"
                + (f" and {batch} batches of epoch {epoch + 1}" if batch else ""))
        raise UsageError(f"--epochs {epochs} is fewer than {name} has done ({done}); give "
                         f"--epochs {epoch + 1} or more to train it further")
    if epoch >= epochs:
        where = ", ".join([f"{epoch}/{epochs} epochs"] + ([f"step {step}"] if step else []) +
                          [f"best val acc {float(ckpt.get('best_acc1') or 0.0):.2f}%"])
        if by_fit:
            return (f"{name} is complete ({where}); to train it further, give it more epochs: "
                    f"tandem.fit(..., resume='{target}', epochs=N) (N > {epoch})")
        again = (rundir.command(saved, target, _needed_flags(cfg, saved, given))
                 if isinstance(saved, dict) else f"tandem train --resume {path} ...")
        return (f"{name} is complete ({where}); to train it further, give it more epochs: "
                f"{again} --epochs N (N > {epoch})")
    if step is not None:
        check_max_steps(cfg, ckpt, step)
    return None


def _needed_flags(cfg: TrainConfig, saved: dict, given: frozenset[str]) -> str:
    """The flags a command continuing the run must repeat: ``--out`` when given, and what
    stands for a ``tandem.fit`` run's model or data (``-a``, ``--data``)."""
    run = TrainConfig.from_dict(saved)
    flags = [("-a", cfg.model.arch)] if "arch" in rundir.handed_to_fit(run) else []
    flags += [("--data", cfg.data.data)] if "data" in rundir.handed_to_fit(run) else []
    flags += [("--out", cfg.run.out)] if "out" in given else []
    return "".join(f" {flag} {value}" for flag, value in flags)


def check_max_steps(cfg: TrainConfig, ckpt: dict, step: int) -> None:
    """Refuse a ``--max-steps`` that the resumed run, at optimizer step ``step``, has reached
    (it counts the run's steps from its start, not this invocation's). A torchrun restart
    runs the command line that reached it: there the loop says there is nothing to train."""
    max_steps = cfg.optim.max_steps
    if max_steps is not None and max_steps <= step and not restart_count():
        raise UsageError(f"--max-steps {max_steps}: {_named(cfg.run.resume, ckpt)[1]} has "
                         f"already made {step} optimizer steps (--max-steps counts them from "
                         f"the run's start); give more, e.g. --max-steps {step + max_steps} "
                         f"for {max_steps} more")


def _named(path: str, ckpt: dict) -> tuple[str, str]:
    """What to give ``--resume`` for ``path`` and what to call it: ``run 'RUN'`` for a run's
    latest checkpoint, else the file."""
    target = rundir.target_of(path) if isinstance(ckpt.get("config"), dict) else path
    return target, (f"run '{target}'" if target != path else f"'{path}'")


def check_launched(cfg: TrainConfig, ckpt: dict, given: frozenset[str]) -> None:
    """A multi-process run resumed outside its launcher: say how many processes it ran, the
    command that launches them, and a strategy that continues it in this one process."""
    saved, cls = ckpt.get("config"), strategy_class(cfg.parallel.strategy)
    if not isinstance(saved, dict) or "strategy" in given or not cls.multiprocess or \
            in_torchrun():
        return
    target = rundir.target_of(cfg.run.resume)
    out = f" --out {cfg.run.out}" if "out" in given else ""
    processes = int((saved.get("resolved") or {}).get("world_size") or 1)
    kind = str(((saved.get("resolved") or {}).get("devices") or ["cpu"])[0]).split(":")[0]
    alone = [n for n in strategy_names(multiprocess=False, portable_optimizer_state=True)
             if not cfg.parallel.compile or strategy_class(n).compile_unsupported is None]
    alone.sort(key=lambda n: strategy_class(n).max_devices is not None)  # all devices first
    launch = (f"run '{target}' ran as {processes} {cls.name} process"
              f"{'' if processes == 1 else 'es'}: continue it with "
              f"`{rundir.command(saved, target, out)}`")
    if not alone:
        raise UsageError(launch)
    count = min(strategy_class(alone[0]).max_devices or processes, processes)
    devices = _device_spec([torch.device("cpu")] * count if kind == "cpu" else
                           [torch.device(kind, i) for i in range(count)])
    raise UsageError(f"{launch}, or in this one process with `tandem train --resume {target}"
                     f"{out} --strategy {alone[0]} --devices {devices}`")


def _device_spec(devices: list[torch.device]) -> str:
    """The ``--devices`` spec that gives ``devices``."""
    if devices[0].type == "cpu":
        return "cpu" if len(devices) == 1 else f"cpu:{len(devices)}"
    return f"{devices[0].type}:" + ",".join(str(d.index or 0) for d in devices)


def _fit_devices(cfg: TrainConfig, notes: list[str]) -> tuple[TrainConfig, list[str]]:
    """The run's devices, less those its (new) strategy cannot drive, with a note saying so."""
    cls = strategy_class(cfg.parallel.strategy)
    if cls.multiprocess or cls.max_devices is None:
        return cfg, notes
    devices = parse_device_spec(cfg.parallel.devices, "--devices")
    if len(devices) <= cls.max_devices:
        return cfg, notes
    spec = _device_spec(devices[:cls.max_devices])
    note = (f"--devices {spec} (the run had {cfg.parallel.devices}; --strategy {cls.name} "
            f"drives {cls.max_devices} device{'s' if cls.max_devices > 1 else ''})")
    return replace(cfg, parallel=replace(cfg.parallel, devices=spec)), [*notes, note]


def restore(ckpt: dict, path: str, cfg: TrainConfig, batches_per_epoch: int, optimizer,
            scheduler, scaler, device=None, load_optimizer=None) -> tuple[dict, list[str]]:
    """Load ``ckpt``'s optimizer, scheduler, scaler and RNG into those built for the run
    (``device``: the one this process trains on, whose generator continues the saver's;
    ``load_optimizer(state)``: the strategy's loader of a plain-layout optimizer state).

    Returns where the trainer starts (``position``, ``best_acc1``, ``carried``: its fields)
    and the lines to say about it. An imagenet-example checkpoint resumes at the start of
    epoch ``ckpt['epoch']``, with its StepLR as the run's step schedule (:mod:`.foreign`).
    """
    steps_per_epoch = -(-batches_per_epoch // cfg.optim.accum_steps)
    epoch, batch, step = _saved_position(ckpt)
    position = Position(epoch, batch, epoch * steps_per_epoch if step is None else int(step))
    if batch % cfg.optim.accum_steps and batch != batches_per_epoch:
        raise UsageError(f"checkpoint '{path}' stopped mid-accumulation; resume it with the "
                         f"--accum-steps it was saved with")
    foreign_schedule = checkpoint_compat.foreign_scheduler(ckpt)
    own_schedule = checkpoint_compat.tandem_scheduler(ckpt)
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
    for group in optimizer.param_groups:  # this run's flags win over the file's
        group.update(momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay,
                     nesterov=cfg.optim.nesterov)
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
    start = {"position": position, "best_acc1": 0.0 if foreign.is_foreign(ckpt) else best,
             "carried": ckpt.get("epoch_progress") if position.batch else None}
    notes = []
    lr = optimizer.param_groups[0]['lr']
    if foreign_schedule == "StepLR" and cfg.optim.lr_schedule == "step":
        notes.append(f"its StepLR goes on at epoch {position.epoch + 1} (lr {lr:.4g})")
    elif foreign_schedule:
        notes.append(f"its {foreign_schedule} state is not tandem's: tandem's --lr-schedule "
                     f"{cfg.optim.lr_schedule} resumes at epoch {position.epoch + 1} "
                     f"(lr {lr:.4g})")
    if foreign.is_foreign(ckpt):
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
                        f"{tuple(value.shape)} but its parameter {tuple(param.shape)}; was it "
                        f"saved, before checkpoints held the plain layout, under a --strategy "
                        f"with sharded layers (it then resumes only under that one)?")


def _check_portable(saved: dict | None, strategy: str, path: str) -> None:
    """Refuse to move a run to another strategy when its optimizer state cannot follow."""
    old = ((saved or {}).get("parallel") or {}).get("strategy")
    if old and old != strategy and not strategy_class(old).portable_optimizer_state:
        raise UsageError(f"--strategy {strategy}: the optimizer state in '{path}' was saved by "
                         f"--strategy {old}, and only that strategy can load it; resume "
                         f"without --strategy")
