"""Continuing a file from elsewhere (no tandem config), such as the imagenet example's.

Such a file gives its ``arch``, ``epoch``, in its optimizer's ``param_groups`` the lr,
momentum, weight decay and nesterov, and in a StepLR's state (the example's schedule) its
step size and gamma: they become the run's unless a flag overrides them, and each override
is said (:func:`file_settings`). It trains and is evaluated with plain cross-entropy, as the
example does, unless ``--label-smoothing`` is given. What the file does not say (global
batch, epochs, image size, another scheduler's schedule) tandem assumes, and :func:`assumed`
says so in one block. Nothing changes silently.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.checkpoint.compat import foreign_scheduler
from tandem.config import TrainConfig
from tandem.errors import UsageError
from tandem.factory import rebuildable
from tandem.models import model_info

__all__ = ["DATA_SIZE", "is_foreign", "file_settings", "takes_schedule", "assumed", "eval_settings",
           "checkpoint_arch"]

#: in an eval note, where the data's own size goes once the data is loaded
DATA_SIZE = "<data size>"

# OptimConfig field, the words for it, its flag; read from the file's first param group.
_FROM_OPTIMIZER = (("lr", "lr", "--lr"), ("momentum", "momentum", "--momentum"),
                   ("weight_decay", "weight decay", "--wd"), ("nesterov", "nesterov", "--nesterov"))


def is_foreign(ckpt: dict) -> bool:
    """True for a checkpoint without tandem's run config (another program wrote it)."""
    return not isinstance(ckpt.get("config"), dict)


def _show(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}"


def _param_group(ckpt: dict) -> dict | None:
    """The first param group of the file's optimizer state (``None`` without one)."""
    optimizer = ckpt.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    return groups[0] if groups and isinstance(groups[0], dict) else None


def _step_schedule(ckpt: dict) -> dict | None:
    """The run's ``lr_schedule``, ``lr_step`` and ``lr_gamma`` from the file's StepLR state
    (``None`` without one): stepped once per epoch, as the example steps it."""
    state = ckpt.get("scheduler")
    if foreign_scheduler(ckpt) != "StepLR":
        return None
    return {"lr_schedule": "step", "lr_step": float(state["step_size"]),
            "lr_gamma": float(state.get("gamma", 0.1))}


def takes_schedule(ckpt: dict, given: frozenset[str]) -> bool:
    """True when the run continues the file's own schedule (a StepLR, no flag against it)."""
    return _step_schedule(ckpt) is not None and "lr_schedule" not in given


def _schedule_settings(cfg: TrainConfig, given: frozenset[str],
                       ckpt: dict) -> tuple[TrainConfig, list[str], list[str]]:
    """``cfg`` with the file's StepLR and plain cross-entropy unless flags say otherwise;
    what was taken, and the lines saying a flag's override."""
    optim, taken, said = cfg.optim, [], []
    step = _step_schedule(ckpt)
    if step is not None:
        words = f"StepLR every {step['lr_step']:g} epochs x{step['lr_gamma']:g}"
        if "lr_schedule" in given:
            said.append(f"--lr-schedule {optim.lr_schedule} overrides the file's {words}")
        else:
            mine = {k: v for k, v in step.items() if k not in given}
            optim = replace(optim, **mine)
            taken.append(f"lr schedule {words}")
    if "label_smoothing" not in given:  # the example's loss
        optim = replace(optim, label_smoothing=0.0)
    return replace(cfg, optim=optim), taken, said


def file_settings(cfg: TrainConfig, given: frozenset[str], ckpt: dict,
                  path: str) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with what the foreign file at ``path`` holds, and the lines that say it.

    The lr is the schedule's base (``initial_lr``, which torch's schedulers keep) when the
    file has one, else its current lr; a StepLR gives the schedule (:func:`_step_schedule`).
    A flag in ``given`` wins over the file, and is said.
    """
    arch = ckpt.get("arch")
    if "arch" not in given and isinstance(arch, str) and arch:
        cfg = replace(cfg, model=replace(cfg.model, arch=arch))
    taken = [f"arch {cfg.model.arch}", f"epoch {int(ckpt.get('epoch') or 0)}"]
    group, values, said = _param_group(ckpt), {}, []
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
    """The block of lines saying what the run uses that the foreign file ``ckpt`` does not
    say (its StepLR is the file's, in :func:`file_settings`' line).

    ``resolved`` is the run's resolved config (``image_size`` is the data's when not given).
    """
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
        if name == "lr_schedule" and takes_schedule(ckpt, given):
            continue
        if name in given:
            source = "as given"
        elif name == "image_size":
            own = cfg.data.image_size is None  # else the size rule's (tandem.train.start)
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
    """``cfg`` to evaluate the foreign file at ``path`` as the imagenet example's ``-e`` does.

    Plain cross-entropy, and the arch's native size (an ImageFolder is resized to 256 and
    centre-cropped to 224 for a 224-pixel arch), each unless ``given``; with the line saying
    so (``None`` when both were given).
    """
    said, flags = [], []
    if "label_smoothing" not in given:
        cfg = replace(cfg, optim=replace(cfg.optim, label_smoothing=0.0))
        said.append("plain cross-entropy")
        flags.append("--label-smoothing")
    if "image_size" not in given:  # the size rule of training (tandem.train.start)
        from .start import size_rule

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
    """The architecture to rebuild for the file at ``path``: the one it names, else ``arch``
    (``-a``, for a bare state dict). An ``arch`` that differs from the file's is refused."""
    if arch is not None:
        model_info(arch)  # a typo: the closest names
    named = ckpt.get("arch")
    named = named if isinstance(named, str) and named else None
    if named is not None and not rebuildable(named):  # a torch class handed to tandem.fit
        if arch is not None:
            return arch
        raise UsageError(f"checkpoint '{path}' holds a model handed to tandem.fit, a "
                         f"{named.split(':')[-1]} that tandem cannot rebuild by name: give "
                         f"-a package.module:function, a function that builds the same model")
    if named is not None and arch is not None and arch != named:
        raise UsageError(f"-a {arch} does not match checkpoint '{path}', which names {named} "
                         f"(leave out -a)")
    if named is None and arch is None:
        raise UsageError(f"checkpoint '{path}' names no architecture ('arch'): say which it "
                         f"is with -a ARCH (see `tandem models`)")
    return named or arch
