"""A run's plan (:mod:`.settings` → plan → :mod:`.build` → :mod:`.loop`): the config to run,
this process's place in its job, the devices and strategy (``--strategy auto`` races here) and
the precision, decided once. A refusal comes before anything is joined, built or written.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from tandem.config import ModelConfig, ParallelConfig, TrainConfig
from tandem.data import batches_per_epoch
from tandem.data.device_decode import resolve_decode
from tandem.data.load import check_spec
from tandem.distributed.compression import Compression
from tandem.distributed.agree import LOCAL, Agreement
from tandem.distributed.env import Environment, Place, place_of, read_env
from tandem.distributed.process_group import Job
from tandem.errors import UsageError, param, quoted
from tandem.factory import is_reference
from tandem.models import create_model, list_models, model_info
from tandem.parallel import threaded_backward
from tandem.parallel.devices import parse_device_spec
from tandem.parallel.split import clock_from_spec, parse_split
from tandem.precision import Precision, amp_flags, amp_precision
from tandem.strategies import (Strategy, auto, create_strategy, strategy_class, strategy_names)
from tandem.strategies.compile import check_compile

from . import rundir, runlock, settings
from .build import build_data, build_model, check_fits, check_model
from .rundir import EVALUATE, FORKED, FRESH, RESUMED, RunDir
from .settings import check_max_steps, saved_position


@dataclass(frozen=True)
class Supplied:
    """What ``tandem.fit`` (``by_fit``) hands over: a model, the data sets ``(train, val,
    info)`` and a criterion; ``None``: built as configured."""

    model: nn.Module | None = field(default=None, repr=False)
    data: tuple | None = field(default=None, repr=False)
    criterion: Callable | None = field(default=None, repr=False)
    by_fit: bool = False

    @property
    def handed(self) -> bool:
        return any(x is not None for x in (self.model, self.data, self.criterion))


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved and checked; ``strategy`` is built but not launched."""

    cfg: TrainConfig
    strategy: Strategy
    mode: str  # FRESH, RESUMED, FORKED or EVALUATE
    run_dir: RunDir | None = None  # None: nothing is written
    source: RunDir | None = None  # the run a fork takes its history from
    checkpoint: dict | None = field(default=None, repr=False)  # what --resume names, read
    notes: tuple[str, ...] = ()  # what the resume took or changed, one line each
    given: frozenset[str] = frozenset()  # fields typed on the command line
    supplied: Supplied = field(default_factory=Supplied)
    race: dict | None = None  # --strategy auto's record: its table, choice and reason
    opening: tuple[str, ...] = ()  # lines the command line says as the run starts (--dummy)
    # the data sets (train, val, info) the race read, which the build takes (None: it reads)
    data: tuple | None = field(default=None, repr=False)
    agreement: Agreement = field(default=LOCAL, repr=False)  # the job's decisions (alone: its own)
    place: Place = field(default_factory=Place, repr=False)  # the environment, read once
    precision: Precision = Precision("cpu")  # what --amp is on the strategy's device

    @property
    def resume_path(self) -> str | None:
        return self.cfg.run.resume if self.checkpoint is not None else None


def plan_train(cfg: TrainConfig, given: frozenset[str] = frozenset(),
               supplied: Supplied = Supplied(), opening: tuple[str, ...] = (),
               job: Job | None = None, environ: Environment = Environment()) -> RunPlan | str:
    """The plan of ``tandem train``; or, for a complete run, the line to print instead (empty
    on a process that does not print). Under several processes (``job``) the plan joins the
    job's group once its own flags pass, and the ranks share every decision through its
    agreement (the checkpoint, the run directory, the settings, the race)."""
    place = place_of(environ)
    cfg, given = _by_fit_under_launch(cfg, given, supplied, place)
    settings.check_launchable(cfg, given, place)  # a one-process strategy under torchrun
    agreement = job.join(place.dist) if job is not None else LOCAL
    cfg, ckpt, notes = settings.resumed_config(cfg, given, place, agreement)
    newer = None
    if ckpt is not None:
        _check_handed(cfg, ckpt, supplied)
        newer = rundir.example_file_note(cfg.run.resume, cfg.data.data, cfg.run.evaluate)
        notes = [*notes, newer] if newer else notes
    if supplied.model is None and supplied.data is None:
        if ckpt is None:
            cfg = settings.fresh_defaults(cfg, given)  # an ImageFolder's arch and image size
        elif settings.is_foreign(ckpt) and not cfg.run.evaluate:  # -e: eval_settings
            cfg = settings.sized(cfg, given)  # the file's arch at its native size
    if supplied.model is None:
        model_info(cfg.model.arch)  # a mistyped --arch (or a factory that fails to import)
    check_drop_path(cfg.model, supplied.model)
    if supplied.data is None:
        check_spec(cfg.data.data)  # a mistyped --data, or a path that is not there
    if cfg.run.evaluate:  # notes: only what a file from elsewhere is evaluated as
        note = None
        if ckpt is not None and settings.is_foreign(ckpt):  # as the example's own -e
            cfg, note = settings.eval_settings(cfg, given, cfg.run.resume)
        return plan_eval(cfg, ckpt, [n for n in (newer, note) if n], supplied, environ)
    if ckpt is not None:
        line = complete_line(cfg, ckpt, given, place.restart, by_fit=supplied.handed)
        if line is not None:
            return line if place.main else ""
        check_launched(cfg, ckpt, given, place)
    run = RunDir(cfg.run.out)
    continues = ckpt is not None and not settings.is_foreign(ckpt)
    source = RunDir.of(cfg.run.resume) if continues else None
    mode = FRESH if not continues else RESUMED if run.same(source) else FORKED
    # the flags first (a bad --devices is the mistake to name); the race only once --out allows
    racing = auto.is_resolver(cfg.parallel.strategy)
    if racing and cfg.parallel.grad_compression != "none":
        raise UsageError(f"--grad-compression {cfg.parallel.grad_compression} changes the "
                         f"update, and --strategy auto never picks that by itself",
                         hint=f"name the strategy: --strategy "
                              f"{' or '.join(strategy_names(compresses_gradients=True))}")
    kind = _device_kind(cfg.parallel)
    cfg, precision, _ = _precision(cfg, kind, place, keeps=cfg.run.resume if continues else None)
    strategy = None if racing else _strategy(cfg.parallel, cfg.model, place, supplied.model,
                                             agreement)
    agreement.settings({**cfg.job_settings(), "device": kind})

    def run_dir_allows() -> None:  # the run directory is rank 0's alone (no shared disk)
        if mode != RESUMED:
            run.check_fresh(cfg.run.overwrite)
        run.check_writable()
        runlock.check_free(run, place)  # another run writes there: refused, --overwrite or not

    agreement.rank0(run_dir_allows)
    race = data = None
    if racing:  # --strategy auto: race now, once
        with auto.rng_kept():
            cfg, race, data = _race(cfg, supplied, agreement, place, precision)
        strategy = _strategy(cfg.parallel, cfg.model, place, supplied.model, agreement)
    cfg = _backward_recorded(cfg, strategy)
    strategy.split.check_fits(cfg.optim.batch_size)
    resolve_decode(cfg.data.decode, strategy.device)  # --decode gpu without CUDA: one line
    return RunPlan(cfg, strategy, mode, run, source, ckpt, tuple(notes), given, supplied,
                   race=race, opening=tuple(opening), data=data, agreement=agreement,
                   place=place, precision=precision)


def plan_eval(cfg: TrainConfig, ckpt: dict | None, notes=(), supplied: Supplied = Supplied(),
              environ: Environment = Environment(), fall_back: bool = False,
              place: Place | None = None) -> RunPlan:
    """The plan of a validation pass (``tandem eval``, ``train -e``): it writes nothing, and
    ``--strategy auto`` takes the simplest strategy that can (no race). With ``fall_back``, an
    ``--amp`` that cannot run here validates in float32, said in a note."""
    place = place or place_of(environ)
    cfg, precision, instead = _precision(cfg, _device_kind(cfg.parallel), place,
                                         fall_back=fall_back)
    if auto.is_resolver(cfg.parallel.strategy):
        cfg = replace(cfg, parallel=_simplest(cfg.parallel, cfg.model, place, supplied.model))
    strategy = _strategy(cfg.parallel, cfg.model, place, supplied.model)
    resolve_decode(cfg.data.decode, strategy.device)  # --decode gpu without CUDA: one line
    return RunPlan(cfg, strategy, EVALUATE, checkpoint=ckpt,
                   notes=(*notes, *([instead] if instead else [])), supplied=supplied,
                   place=place, precision=precision)


def _by_fit_under_launch(cfg: TrainConfig, given: frozenset[str], supplied: Supplied,
                         place: Place) -> tuple[TrainConfig, frozenset[str]]:
    """Under torchrun, ``tandem.fit``'s one-process strategy becomes its multi-process form,
    one device per process, said on rank 0; ``auto`` keeps its name."""
    asked = cfg.parallel.strategy
    name = asked if auto.is_resolver(asked) else auto.under_launch(asked)
    if not supplied.by_fit or not place.torchrun or (name == asked and not auto.is_resolver(asked)):
        return cfg, given
    kind = _device_kind(cfg.parallel)
    if not auto.is_resolver(asked) and place.main:
        print(f"under torchrun: strategy {name} on {kind}, one process per device "
              f"(instead of {asked} on {cfg.parallel.devices})", flush=True)
    parallel = replace(cfg.parallel, strategy=name, devices=kind)
    return replace(cfg, parallel=parallel), given | {"strategy", "devices"} - (
        {"strategy"} if auto.is_resolver(asked) else set())


def _precision(cfg: TrainConfig, kind: str, place: Place, keeps: str | None = None,
               fall_back: bool = False) -> tuple[TrainConfig, Precision, str | None]:
    """What ``--amp`` is on devices of ``kind``, recorded in the config; where it cannot run,
    one line (``keeps``: the run resumed, which keeps its precision), or with ``fall_back``
    float32 and the line saying so."""
    p = cfg.parallel
    try:
        precision = amp_precision(kind, p.amp, p.amp_dtype, cpu_bf16=place.cpu_bf16)
    except UsageError as refusal:
        if fall_back:
            return (replace(cfg, parallel=replace(p, amp=False, amp_dtype=None)), Precision(kind),
                    f"precision: float32 (the run's {amp_flags(p.amp_dtype)} cannot run on {kind})")
        if keeps is None:
            raise
        why = "fp16 autocast is for CUDA" if p.amp_dtype == "fp16" else refusal.marked
        raise UsageError(f"'{keeps}' trains with {amp_flags(p.amp_dtype)}, which cannot run on "
                         f"{kind} ({why}); a run keeps its precision",
                         hint="resume it on a device where it runs (`tandem eval` scores it "
                              "here, in float32)") from None
    if p.amp and p.amp_dtype is None and not cfg.run.resume:
        cfg = replace(cfg, parallel=replace(p, amp_dtype=precision.amp_dtype))  # bf16 on a CPU
    return cfg, precision, None


# -- a resume with nothing to do, or that needs what it was handed or its launcher --------------
_HANDED = {"arch": ("model", "model", "-a package.module:function",
                    "a function that builds the same model"),
           "data": ("data sets", "train_data, val_data", "--data package.module:function",
                    "a function that returns the same data sets")}


def _check_handed(cfg: TrainConfig, ckpt: dict, supplied: Supplied) -> None:
    """Refuse to continue a run of ``tandem.fit`` without what it was handed."""
    missing = [name for name in rundir.handed_to_fit(cfg)
               if getattr(supplied, "model" if name == "arch" else "data") is None]
    if not missing:
        return
    handed = set(missing) | set(rundir.handed_to_fit(TrainConfig.from_dict(
        ckpt.get("config") or {})))
    target = rundir.target_of(cfg.run.resume)
    what = " and ".join(_HANDED[n][0] for n in missing)
    args = ", ".join(_HANDED[n][1] if n in handed else "None" for n in ("arch", "data"))
    # every stand-in the run needs (offering only the missing one would drop the other)
    typed = {"arch": cfg.model.arch, "data": cfg.data.data}
    flags = " ".join(_HANDED[n][2] if n in missing or rundir.stands_in(n, typed[n])
                     else f"{_HANDED[n][2].split()[0]} {typed[n]}"
                     for n in ("arch", "data") if n in handed)
    meaning = " and ".join(_HANDED[n][3] for n in missing)
    raise UsageError(f"run '{target}' was trained by tandem.fit on the {what} handed to it, "
                     f"which tandem cannot load by name",
                     hint=f"continue it with tandem.fit({args}, resume='{target}'), or with "
                          f"`tandem train --resume {target} {flags}` ({meaning})")


def complete_line(cfg: TrainConfig, ckpt: dict, given: frozenset[str], restart: int = 0,
                  by_fit: bool = False) -> str | None:
    """The one line to print instead of training when the resumed run has done all its epochs
    (else ``None``). ``--epochs`` and ``--max-steps`` behind where it stands are refused."""
    epoch, batch, step = saved_position(ckpt)
    path, epochs, saved = cfg.run.resume, cfg.optim.epochs, ckpt.get("config")
    target, name = settings.resume_target(path, ckpt)
    if "epochs" in given and epochs < epoch + (1 if batch else 0):
        done = (f"{epoch} epoch{'' if epoch == 1 else 's'}"
                + (f" and {batch} batches of epoch {epoch + 1}" if batch else ""))
        raise UsageError(f"{param('epochs')} {epochs} is fewer than {name} has done ({done}); "
                         f"give {param('epochs')} {epoch + 1} or more to train it further")
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
        check_max_steps(cfg, ckpt, step, restarted=restart > 0)
    return None


def _needed_flags(cfg: TrainConfig, saved: dict, given: frozenset[str]) -> str:
    """The flags a command continuing the run must repeat (``--out``, ``-a``, ``--data``)."""
    run = TrainConfig.from_dict(saved)
    flags = [("-a", cfg.model.arch)] if "arch" in rundir.handed_to_fit(run) else []
    flags += [("--data", cfg.data.data)] if "data" in rundir.handed_to_fit(run) else []
    flags += [("--out", cfg.run.out)] if "out" in given else []
    return "".join(f" {flag} {value}" for flag, value in flags)


def check_launched(cfg: TrainConfig, ckpt: dict, given: frozenset[str], place: Place) -> None:
    """Refuse a multi-process run resumed outside its launcher, naming the command that
    launches it and a strategy that continues it in this one process."""
    saved, cls = ckpt.get("config"), strategy_class(cfg.parallel.strategy)
    if not isinstance(saved, dict) or "strategy" in given or not cls.multiprocess or place.torchrun:
        return
    target = rundir.target_of(cfg.run.resume)
    out = f" --out {cfg.run.out}" if "out" in given else ""
    processes = int((saved.get("resolved") or {}).get("world_size") or 1)
    kind = str(((saved.get("resolved") or {}).get("devices") or ["cpu"])[0]).split(":")[0]
    alone = [n for n in strategy_names(multiprocess=False, portable_optimizer_state=True)
             if not cfg.parallel.compile or strategy_class(n).compile_unsupported is None]
    alone.sort(key=lambda n: strategy_class(n).max_devices is not None)  # all devices first
    if cls.across_processes_of in alone:  # hybrid-ddp's own update, in one process: hybrid
        alone.remove(cls.across_processes_of)
        alone.insert(0, cls.across_processes_of)
    launch = (f"run '{target}' ran as {processes} {cls.name} process"
              f"{'' if processes == 1 else 'es'}: continue it with "
              f"`{rundir.command(saved, target, out)}`")
    if not alone:
        raise UsageError(launch)
    count = min(strategy_class(alone[0]).max_devices or processes, processes)
    devices = settings.device_spec([torch.device("cpu")] * count if kind == "cpu" else
                           [torch.device(kind, i) for i in range(count)])
    raise UsageError(f"{launch}, or in this one process with `tandem train --resume {target}"
                     f"{out} --strategy {alone[0]} --devices {devices}`")


def _split(cfg: ParallelConfig, place: Place) -> dict:
    """The strategy's ``split`` and ``max_share`` keywords (none when not asked for)."""
    if cfg.split is None and cfg.max_share is None:
        return {}
    return {"split": None if cfg.split is None else parse_split(cfg.split),
            "max_share": cfg.max_share, "split_clock": clock_from_spec(place.split_clock)}


def _backward_threads(cfg: ParallelConfig, devices: list[torch.device]) -> bool:
    """Whether the run's replica threads run their backward in threads."""
    if not strategy_class(cfg.strategy).replica_threads:
        return False
    wanted = None if cfg.backward_threads is None else cfg.backward_threads == "on"
    return threaded_backward.decide(devices, wanted, split=cfg.split is not None)


def _backward_recorded(cfg: TrainConfig, strategy: Strategy) -> TrainConfig:
    """``cfg`` with the backward path ``strategy`` took, so a resume takes the same."""
    if cfg.parallel.backward_threads is not None:
        return cfg
    path = "on" if strategy.backward_threads else "off"
    return replace(cfg, parallel=replace(cfg.parallel, backward_threads=path))


def _device_kind(cfg: ParallelConfig) -> str:
    """The kind of device ``--devices`` gives here (``cpu``, ``cuda``): a job's ranks share it."""
    return parse_device_spec(cfg.devices, "--devices")[0].type


def _strategy(cfg: ParallelConfig, model_cfg: ModelConfig, place: Place,
              model: nn.Module | None = None, agreement: Agreement = LOCAL) -> Strategy:
    """The strategy of ``cfg`` (built, not launched), checked against the model."""
    devices = parse_device_spec(cfg.devices, "--devices")
    extra = _split(cfg, place)
    compression = Compression.parse(cfg.grad_compression)
    if strategy_class(cfg.strategy).compresses_gradients:
        extra["compression"] = compression
    if strategy_class(cfg.strategy).multiprocess:
        extra["env"] = agreement.env or read_env(place.environ,
                                                 who=f"{param('strategy')} {cfg.strategy}")
    strategy = create_strategy(cfg.strategy, devices, sync_bn=cfg.sync_bn, buffers=cfg.buffers,
                               output_key=model_cfg.output_key, agreement=agreement,
                               options=dataclasses.asdict(model_cfg),
                               backward_threads=_backward_threads(cfg, devices), **extra)
    if (cfg.split or cfg.max_share) and not strategy.splits_batch:
        flag = "--split" if cfg.split else "--max-share"
        raise UsageError(f"{flag} needs a strategy that splits the batch "
                         f"({', '.join(strategy_names(splits_batch=True))}), not --strategy "
                         f"{cfg.strategy}")
    strategy.split.check_weights("--split")
    if not compression.exact and not strategy.compresses_gradients:
        raise UsageError(f"--grad-compression {compression} needs a strategy that compresses "
                         f"its gradients ({', '.join(strategy_names(compresses_gradients=True))}),"
                         f" not --strategy {cfg.strategy}")
    if cfg.compile:
        check_compile(strategy, strategy.device.type)
    if model is None and not is_reference(model_cfg.arch):  # a factory's: once built (build)
        with torch.device("meta"):  # the model's structure, no memory and no weights
            model = create_model(model_cfg.arch)
    if model is not None:
        check_model(strategy, model)
    return strategy


def _refusal(parallel: ParallelConfig, model_cfg: ModelConfig, place: Place,
             model: nn.Module | None) -> str | None:
    """Why the plan's checks refuse ``parallel``'s strategy for the model, else ``None``."""
    try:
        with warnings.catch_warnings():  # single on several devices: the caller says so
            warnings.simplefilter("ignore")
            _strategy(parallel, model_cfg, place, model)
    except UsageError as exc:
        return quoted(exc)
    return None


def _simplest(parallel: ParallelConfig, model_cfg: ModelConfig, place: Place,
              model: nn.Module | None) -> ParallelConfig:
    """``parallel`` with the simplest candidate the plan's checks accept."""
    refusals = []
    for name in auto.simplest_first():
        why = _refusal(replace(parallel, strategy=name), model_cfg, place, model)
        if why is None:
            return replace(parallel, strategy=name)
        refusals.append(why)
    raise UsageError(f"{param('strategy')} auto: no strategy can run this here: {refusals[0]}")


# -- --strategy auto's race ---------------------------------------------------------------------
def _race(cfg: TrainConfig, supplied: Supplied, agreement: Agreement, place: Place,
          precision: Precision) -> tuple[TrainConfig, dict, tuple | None]:
    """``cfg`` with ``auto`` raced and replaced by the choice; the race's record; the data
    sets read for it (``None``: handed over). Prints the race's block."""
    p = cfg.parallel
    devices = parse_device_spec(p.devices, "--devices")
    loaded = None if supplied.data is not None else build_data(cfg.data, cfg.run.seed)
    train_set, _, info = supplied.data if supplied.data is not None else loaded
    classes = cfg.data.num_classes or info.num_classes
    dtype = getattr(torch, p.dtype)
    model = (copy.deepcopy(supplied.model) if supplied.model is not None else
             build_model(cfg.model, replace(info, num_classes=classes), cfg.run.seed)).to(dtype)
    if supplied.model is not None or is_reference(cfg.model.arch):  # as the build checks it
        check_fits(model, train_set, dtype, classes, info.name, cfg.model.output_key,
                   handed=supplied.model is not None)
    images, targets = _batch(train_set, info, classes, cfg.optim.batch_size, dtype)
    split = None if p.split is None else parse_split(p.split)

    def check(name: str) -> str | None:  # the run's own refusals (--compile, --split)
        return _refusal(replace(p, strategy=name), cfg.model, place, supplied.model)

    processes = agreement.world_size
    if processes > 1 and agreement.rank == 0:  # no budget there: say what it will take first
        print(auto.process_race_line(processes, p.auto_steps), flush=True)
    result = auto.resolve(
        devices, model, (images, targets), options=dataclasses.asdict(cfg.model), check=check,
        amp=precision, lr=cfg.optim.lr, channels_last=p.channels_last, sync_bn=p.sync_bn,
        buffers=p.buffers, split=split, rounds=p.auto_steps,
        epoch_batches=batches_per_epoch(train_set, cfg.optim.batch_size), agreement=agreement)
    if agreement.rank == 0:
        where = f"{processes} processes" if processes > 1 else p.devices
        print(auto.format_block(result, result.planned,
                                f"{', '.join(result.raced)} on {where}, global batch "
                                f"{cfg.optim.batch_size}, "), flush=True)
    few = devices if processes > 1 else \
        devices[:strategy_class(result.choice).max_devices or len(devices)]
    parallel = replace(p, strategy=result.choice,  # single: the one device it drives
                       devices=p.devices if few == devices else settings.device_spec(few))
    return replace(cfg, parallel=parallel), result.record(), loaded


def _batch(train_set, info, classes: int, size: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random global batch of the data's shape (no data is read)."""
    shape = getattr(train_set, "shape", None) or (info.in_channels, info.image_size,
                                                   info.image_size)
    target = tuple(getattr(train_set, "target_shape", ()) or ())
    generator = torch.Generator().manual_seed(0)
    return (torch.randn((size, *shape), generator=generator).to(dtype),
            torch.randint(0, classes, (size, *target), generator=generator))


def check_drop_path(cfg: ModelConfig, model: nn.Module | None = None) -> None:
    """Refuse ``--drop-path`` for a model handed over or without residual blocks."""
    if not cfg.drop_path:
        return
    flag = f"{param('drop_path')} {cfg.drop_path}"
    if model is not None:
        raise UsageError(f"{flag} is for a model tandem builds (the zoo's ResNets); the model "
                         "handed over is yours: put tandem.keyed.DropPath in its residual branches")
    if not is_reference(cfg.arch) and "drop_path" not in model_info(cfg.arch).options:
        takers = [n for n in list_models() if "drop_path" in model_info(n).options]
        raise UsageError(f"{flag}: {cfg.arch} has no residual blocks to drop; the models "
                         f"that take it: {', '.join(takers)}")


