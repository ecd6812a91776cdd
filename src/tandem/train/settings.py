"""What a run takes that was not typed, and the lines that say so (settings → :mod:`.plan` →
:mod:`.build` → :mod:`.loop`). A file from elsewhere (the imagenet example's) gives its arch,
epoch, optimizer settings and StepLR; a flag overrides each, and every override is said.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from tandem import checkpoint
from tandem.checkpoint.compat import foreign_scheduler
from tandem.config import TrainConfig
from tandem.data.cifar10 import find_cifar_dir
from tandem.distributed.agree import LOCAL, Agreement
from tandem.distributed.env import Place
from tandem.distributed.shared_resume import continue_from_rank0, done_with
from tandem.errors import UsageError, param
from tandem.factory import is_reference, rebuildable
from tandem.models import model_info, native_input_size
from tandem.parallel.devices import parse_device_spec
from tandem.precision import Precision
from tandem.strategies import auto, strategy_class

from . import rundir, runlock


# -- a run's own settings, or a file's --------------------------------------------------------
def check_launchable(cfg: TrainConfig, given: frozenset[str], place: Place) -> None:
    """Under torchrun with several processes, refuse a one-process strategy that has no
    multi-process form in every worker, before they meet (a resumed run's is rank 0's to read)."""
    if place.several and ("strategy" in given or not cfg.run.resume):
        try:
            auto.check_launchable(cfg.parallel.strategy, "several processes (torchrun)")
        except UsageError as exc:  # every worker refuses alike; rank 0 says it
            raise UsageError(exc.marked, quiet=not place.main, hint=exc.hint_marked) from None


def resumed_config(cfg: TrainConfig, given: frozenset[str], place: Place = Place(),
                   agreement: Agreement = LOCAL):
    """The config to run, the checkpoint to continue (``None``: a fresh run) and the lines
    saying what was taken. ``--strategy auto`` on a run that has its strategy keeps that one;
    under torchrun a one-process strategy with a multi-process form runs as that, said."""
    name = cfg.parallel.strategy
    if auto.is_resolver(name):
        cfg, ckpt, notes = _continued(cfg, given - {"strategy"}, place, agreement)  # its own
        if ckpt is not None and not auto.is_resolver(cfg.parallel.strategy):
            raced = "chosen by its race" if race_record(ckpt) else "as it started"
            notes = [*notes, f"--strategy auto: the run already has --strategy "
                             f"{cfg.parallel.strategy} ({raced}); it goes on with it, no race"]
        return cfg, ckpt, notes  # else a fresh run, or a file from elsewhere: it races
    twin = auto.across_processes(name) if place.torchrun else None
    if twin is not None:
        if place.main:
            print(f"--strategy {name}: under tandem launch it runs as {twin}, one process per "
                  f"device", flush=True)
        cfg = replace(cfg, parallel=replace(cfg.parallel, strategy=twin))
    return _continued(cfg, given, place, agreement)


def race_record(ckpt: dict | None) -> dict | None:
    """The race a checkpoint's run recorded (``resolved.auto``), if it raced."""
    config = (ckpt or {}).get("config") or {}
    return (config.get("resolved") or {}).get("auto")


def _continued(cfg: TrainConfig, given: frozenset[str], place: Place, agreement: Agreement):
    """:func:`resumed_config` of a strategy that is not ``auto``."""
    if place.elastic and not cfg.run.resume:
        _check_rank0_holds_the_run(cfg, place, agreement)
    continued = continue_from_rank0(lambda: _decide(cfg, place), agreement)  # rank 0 decides
    path, restarted = continued.path, continued.restarted
    if restarted and path is None:  # failed before its first save: start it again, said
        if place.main:
            what = (f"torchrun restart {place.restart}: the run had saved no checkpoint before "
                    "the failure" if place.restart else "the job's nodes changed before the "
                    "run's first checkpoint")
            print(f"{what}, so it starts again from step 1 (--save-every, --save-minutes "
                  f"bound the loss)", flush=True)
        return replace(cfg, run=replace(cfg.run, overwrite=True)), None, []
    if path is None:
        return cfg, None, []
    try:
        ckpt = checkpoint.load(continued.local)
    finally:
        done_with(continued, agreement)  # a copy sent to this machine goes
    if is_foreign(ckpt):
        cfg, notes = file_settings(cfg, given, ckpt, path)
    else:
        cfg, notes = rundir.resume_config(cfg, given, ckpt.get("config"), path, place.main)
        _check_portable(ckpt.get("config"), cfg.parallel.strategy, path)
        if "devices" not in given:
            cfg, notes = _fit_devices(cfg, notes)
    return replace(cfg, run=replace(cfg.run, resume=path)), ckpt, notes


def _check_rank0_holds_the_run(cfg: TrainConfig, place: Place, agreement: Agreement) -> None:
    """After a change of nodes rank 0 may be a newcomer (the rendezvous ranks the nodes by
    address): refuse on every rank where another machine holds this launch's run and rank 0's
    does not, rather than start the run afresh there."""
    holds = agreement.each(place.speaks and rundir.RunDir(cfg.run.out).launched_by(place.launch_id))
    if holds[0] or not any(holds):
        return
    holder = agreement.peer_name(holds.index(True))
    raise UsageError(f"{agreement.peer_name(0)} holds no run of this launch in "
                     f"'{cfg.run.out}', {holder} does: a node that joined became rank 0",
                     hint="the rendezvous gives rank 0 to the address that sorts first: start "
                          "newcomers with addresses after node 0's, or keep --out on a shared "
                          "disk", quiet=agreement.rank != 0)


def _decide(cfg: TrainConfig, place: Place) -> tuple[str | None, bool]:
    """Rank 0's: the checkpoint this run continues (``None``: none), and whether torchrun
    restarted it."""
    run = rundir.RunDir(cfg.run.out)
    if not cfg.run.resume and place.elastic and run.launched_by(place.launch_id):
        # the nodes changed (torchrun counts no restart for a join): this launch's run goes on
        return (run.latest if os.path.isfile(run.latest) else None), True
    if not cfg.run.resume and place.restart > 0:  # torchrun restarted the workers
        if not run.launched_by(place.launch_id):
            raise UsageError(
                f"torchrun restarted this job (restart {place.restart}), but rank 0's "
                f"machine holds no run of this launch in '{cfg.run.out}' to continue",
                hint="start a new launch (with --resume, if a checkpoint of it is "
                     "elsewhere): starting it afresh would not be the run that failed")
        return (run.latest if os.path.isfile(run.latest) else None), True
    if not cfg.run.resume:
        return None, False
    if cfg.model.pretrained:
        raise UsageError("--pretrained starts a new run from a weights file and --resume "
                         "continues a run from its checkpoint: give one of them")
    runlock.check_saved(cfg.run.resume, place)  # a run not saved yet: its process, named
    path = rundir.checkpoint_path(cfg.run.resume)
    if not os.path.isfile(path):
        checkpoint.load(path)  # one line saying what is wrong with it, on rank 0's machine
    return path, False


def device_spec(devices: list[torch.device]) -> str:
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
    spec = device_spec(devices[:cls.max_devices])
    note = (f"--devices {spec} (the run had {cfg.parallel.devices}; --strategy {cls.name} "
            f"drives {cls.max_devices} device{'s' if cls.max_devices > 1 else ''})")
    return replace(cfg, parallel=replace(cfg.parallel, devices=spec)), [*notes, note]


def _check_portable(saved: dict | None, strategy: str, path: str) -> None:
    """Refuse to move a run to another strategy when its optimizer state cannot follow."""
    old = ((saved or {}).get("parallel") or {}).get("strategy")
    if old and old != strategy and not strategy_class(old).portable_optimizer_state:
        raise UsageError(f"--strategy {strategy}: the optimizer state in '{path}' was saved by "
                         f"--strategy {old}, and only that strategy can load it; resume "
                         f"without --strategy")


def saved_position(ckpt: dict) -> tuple[int, int, int | None]:
    """Epochs done, batches of the next one done and optimizer steps (``None``: not saved)."""
    position = ckpt.get("data_position") or {"epoch": int(ckpt.get("epoch") or 0), "batch": 0}
    return int(position["epoch"]), int(position["batch"]), position.get("step")


def resume_target(path: str, ckpt: dict) -> tuple[str, str]:
    """What to give ``--resume`` for ``path``, and what to call it."""
    target = rundir.target_of(path) if isinstance(ckpt.get("config"), dict) else path
    return target, (f"run '{target}'" if target != path else f"'{path}'")


def check_max_steps(cfg: TrainConfig, ckpt: dict, step: int, restarted: bool) -> None:
    """Refuse a ``--max-steps`` the resumed run, at step ``step``, has reached (but for a
    torchrun restart: there the loop says there is nothing to train)."""
    max_steps = cfg.optim.max_steps
    if max_steps is not None and max_steps <= step and not restarted:
        flag = param("max_steps")
        raise UsageError(f"{flag} {max_steps}: {resume_target(cfg.run.resume, ckpt)[1]} has "
                         f"already made {step} optimizer steps ({flag} counts them from the run's "
                         f"start); give more, e.g. {flag} {step + max_steps} for {max_steps} more")


# -- a fresh run's defaults, and the lines said at its start ---------------------------------
IMAGEFOLDER_ARCH = "resnet18"  # the imagenet example's default -a

# The imagenet example's defaults that tandem's differ from: (section, field, theirs, flag)
_EXAMPLE = (("optim", "lr", 0.1, "--lr"), ("optim", "weight_decay", 1e-4, "--wd"),
            ("optim", "batch_size", 256, "-b"), ("optim", "epochs", 90, "--epochs"),
            ("data", "workers", 4, "-j"), ("optim", "label_smoothing", 0.0, "--label-smoothing"),
            ("optim", "lr_schedule", "step", "--lr-schedule"), ("run", "print_freq", 10, "-p"),
            ("run", "seed", None, "--seed"))
EXAMPLE_CLASSES = 1000  # the imagenet example's models' outputs, whatever its data


def is_imagefolder(spec: str) -> bool:
    """True when ``--data`` names an ImageFolder directory (a directory, not CIFAR-10's)."""
    if not isinstance(spec, str) or spec in ("synthetic", "digits"):
        return False
    path = Path(spec).expanduser()
    if is_reference(spec) and not path.exists():
        return False
    return path.is_dir() and find_cifar_dir(path) is None


def size_rule(arch: str, data: str) -> int | None:
    """The default image side for ``arch`` on ``data`` (``None``: the data's own)."""
    return native_input_size(arch) if is_imagefolder(data) and not is_reference(arch) else None


def fresh_defaults(cfg: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """``cfg`` of a fresh run with the arch and image size it takes when not typed."""
    if "arch" not in given and is_imagefolder(cfg.data.data):
        cfg = replace(cfg, model=replace(cfg.model, arch=IMAGEFOLDER_ARCH))
    return sized(cfg, given)


def sized(cfg: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """``cfg`` with the image size of :func:`size_rule` unless ``--image-size`` was typed."""
    size = size_rule(cfg.model.arch, cfg.data.data)
    if "image_size" not in given and size is not None:
        cfg = replace(cfg, data=replace(cfg.data, image_size=size))
    return cfg


def size_line(cfg: TrainConfig, given: frozenset[str], size: int) -> str | None:
    """The line saying which image size a fresh run uses and why (``None`` when typed)."""
    if "image_size" in given:
        return None
    arch, data = cfg.model.arch, cfg.data.data
    if not is_imagefolder(data):
        why = "the data's own"
    elif is_reference(arch):
        why = f"the data's shorter side: {arch} has no native size, and photos are cropped to it"
    else:
        why = (f"{arch}'s native size: training crops {size}px, validation resized to "
               f"{round(size * 256 / 224)} and centre-cropped to {size}")
    return f"image size {size}px ({why}; --image-size to change)"


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return value if isinstance(value, str) else f"{value:g}"


def example_block(cfg: TrainConfig, given: frozenset[str]) -> list[str]:
    """For a fresh run on an ImageFolder: a line per untyped default unlike the example's."""
    if not is_imagefolder(cfg.data.data):
        return []
    lines = []
    for section, name, theirs, flag in _EXAMPLE:
        mine = getattr(getattr(cfg, section), name)
        if name not in given and mine != theirs:
            fixed = ", fixed" if theirs is None else ""  # the example's seed: unseeded
            lines.append(f"  {flag} {_show(mine)}{fixed} (the example: "
                         f"{'unseeded' if theirs is None else _show(theirs)})")
    classes = cfg.data.num_classes
    if "num_classes" not in given and classes is not None and classes != EXAMPLE_CLASSES:
        lines.append(f"  --num-classes {classes}, the data's (the example: always "
                     f"{EXAMPLE_CLASSES}; its main.py cannot load a {classes}-class checkpoint)")
    if not lines:
        return []
    return ["tandem's defaults that differ from the imagenet example's (give the flag to "
            "change them):", *lines]


def precision_line(precision: Precision, where: str = "") -> str | None:
    """The line saying how ``--amp`` runs here (``None`` in float32)."""
    if precision.dtype is None:
        return None
    scaling = "with grad scaling" if precision.scaled else "no grad scaling"
    return (f"precision: {precision.amp_dtype} autocast on {precision.device_type}, {scaling}"
            f"{where}; weights and checkpoints stay float32")


# -- a file from elsewhere ------------------------------------------------------------------
#: in an eval note, where the data's own size goes once the data is loaded
DATA_SIZE = "<data size>"

# OptimConfig field, the words for it, its flag; read from the file's first param group
_FROM_OPTIMIZER = (("lr", "lr", "--lr"), ("momentum", "momentum", "--momentum"),
                   ("weight_decay", "weight decay", "--wd"), ("nesterov", "nesterov", "--nesterov"))


def is_foreign(ckpt: dict) -> bool:
    """True for a checkpoint without tandem's run config (another program wrote it)."""
    return not isinstance(ckpt.get("config"), dict)


def _step_schedule(ckpt: dict) -> dict | None:
    """The run's ``lr_schedule`` settings from the file's StepLR (``None``: none)."""
    state = ckpt.get("scheduler")
    if foreign_scheduler(ckpt) != "StepLR":
        return None
    return {"lr_schedule": "step", "lr_step": float(state["step_size"]),
            "lr_gamma": float(state.get("gamma", 0.1))}


def _schedule_settings(cfg: TrainConfig, given: frozenset[str],
                       ckpt: dict) -> tuple[TrainConfig, list[str], list[str]]:
    """``cfg`` with the file's StepLR and plain cross-entropy unless flags say otherwise."""
    optim, taken, said = cfg.optim, [], []
    step = _step_schedule(ckpt)
    if step is not None:
        words = f"StepLR every {step['lr_step']:g} epochs x{step['lr_gamma']:g}"
        if "lr_schedule" in given:
            said.append(f"--lr-schedule {optim.lr_schedule} overrides the file's {words}")
        else:
            optim = replace(optim, **{k: v for k, v in step.items() if k not in given})
            taken.append(f"lr schedule {words}")
    if "label_smoothing" not in given:  # the example's loss
        optim = replace(optim, label_smoothing=0.0)
    return replace(cfg, optim=optim), taken, said


def file_settings(cfg: TrainConfig, given: frozenset[str], ckpt: dict,
                  path: str) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with what the foreign file at ``path`` holds, and the lines that say it. The
    lr is the schedule's base (``initial_lr``) when the file has one; a flag wins, said."""
    arch = ckpt.get("arch")
    if "arch" not in given and isinstance(arch, str) and arch:
        cfg = replace(cfg, model=replace(cfg.model, arch=arch))
    taken = [f"arch {cfg.model.arch}", f"epoch {int(ckpt.get('epoch') or 0)}"]
    optimizer = ckpt.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    group = groups[0] if groups and isinstance(groups[0], dict) else None
    values, said = {}, []
    if group is None:
        said.append("it holds no optimizer state: lr, momentum, weight decay and "
                         "nesterov are this run's (--lr, --momentum, --wd, --nesterov)")
    for name, words, flag in _FROM_OPTIMIZER if group is not None else ():
        theirs = group.get("initial_lr", group.get("lr")) if name == "lr" else group.get(name)
        if theirs is None:
            continue
        mine = getattr(cfg.optim, name)
        theirs = type(mine)(theirs)  # bool or float, as the config holds it
        if name == "lr" and group.get("lr") is not None and float(group["lr"]) != theirs:
            taken.append(f"lr {_show(theirs)} (its schedule's base; {_show(group['lr'])} now)")
        else:
            taken.append(f"{words} {_show(theirs)}")
        if name in given and mine != theirs:
            said.append(f"{flag} {_show(mine)} overrides the file's {words} {_show(theirs)}")
        else:
            values[name] = theirs
    cfg = replace(cfg, optim=replace(cfg.optim, **values))
    cfg, schedule, overrides = _schedule_settings(cfg, given, ckpt)
    return cfg, [f"'{path}' is not a tandem run; from it: " + ", ".join(taken + schedule),
                 *said, *overrides]


def assumed(cfg: TrainConfig, given: frozenset[str], resolved: dict, ckpt: dict) -> list[str]:
    """The lines saying what the run uses that the foreign file ``ckpt`` does not say."""
    optim = cfg.optim
    size = resolved["resolved"]["dataset"]["image_size"]
    schedule = optim.lr_schedule + (f" (every {optim.lr_step:g} epochs x{optim.lr_gamma:g})"
                                    if optim.lr_schedule == "step" else "")
    items = (("global batch", optim.batch_size, "batch_size", "-b"),
             ("epochs", optim.epochs, "epochs", "--epochs"),
             ("image size", f"{size}px", "image_size", "--image-size"),
             ("lr schedule", schedule, "lr_schedule", "--lr-schedule"),
             ("label smoothing", f"{optim.label_smoothing:g}", "label_smoothing",
              "--label-smoothing"))
    lines = ["not in the file, so this run takes:"]
    for words, value, name, flag in items:
        if name == "lr_schedule" and _step_schedule(ckpt) is not None and name not in given:
            continue
        if name in given:
            source = "as given"
        elif name == "image_size":
            own = cfg.data.image_size is None  # else the size rule's (size_rule, above)
            source = ("the data's own" if own else f"{cfg.model.arch}'s native size") + \
                f"; {flag} to change"
        elif name == "label_smoothing":
            source = f"plain cross-entropy, as the imagenet example trains; {flag} to change"
        else:
            source = f"tandem's default; {flag} to change"
        lines.append(f"  {words} {value} ({source})")
    return lines


def eval_settings(cfg: TrainConfig, given: frozenset[str],
                  path: str) -> tuple[TrainConfig, str | None]:
    """``cfg`` to evaluate the foreign file at ``path`` as the example's ``-e`` does: plain
    cross-entropy at the arch's native size, each unless ``given``; and the line saying so."""
    said, flags = [], []
    if "label_smoothing" not in given:
        cfg = replace(cfg, optim=replace(cfg.optim, label_smoothing=0.0))
        said.append("plain cross-entropy")
        flags.append("--label-smoothing")
    if "image_size" not in given:  # the size rule of training (size_rule, above)
        size = size_rule(cfg.model.arch, cfg.data.data)
        cfg = replace(cfg, data=replace(cfg.data, image_size=size))
        said.append(f"{cfg.model.arch}'s native {size}px" if size else
                    f"the data's own size, {DATA_SIZE}")
        flags.append("--image-size")
    if not said:
        return cfg, None
    return cfg, (f"'{path}' is not a tandem run: evaluated as its source would, with "
                 f"{' at '.join(said)} ({' and '.join(flags)} to change)")


def checkpoint_arch(ckpt: dict, arch: str | None, path: str) -> str:
    """The architecture to rebuild for the file at ``path`` (the file's, else ``arch``)."""
    if arch is not None:
        model_info(arch)  # a typo: the closest names
    named = ckpt.get("arch")
    named = named if isinstance(named, str) and named else None
    if named is not None and not rebuildable(named):  # a torch class handed to tandem.fit
        if arch is not None:
            return arch
        raise UsageError(f"checkpoint '{path}' holds a model handed to tandem.fit, a "
                         f"{named.split(':')[-1]} that tandem cannot rebuild by name",
                         hint="give -a package.module:function, a function that builds the "
                              "same model")
    if named is not None and arch is not None and arch != named:
        raise UsageError(f"-a {arch} does not match checkpoint '{path}', which names {named} "
                         f"(leave out -a)")
    if named is None and arch is None:
        raise UsageError(f"checkpoint '{path}' names no architecture ('arch'): say which it "
                         f"is with -a ARCH (see `tandem models`)")
    return named or arch
