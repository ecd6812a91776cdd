"""What a run takes that was not typed, and the lines that say so at its start.

One image-size rule for training and eval (:func:`size_rule`): an ImageFolder (photos of any
size, cropped) gets the arch's native size (224: RandomResizedCrop 224 to train, resize 256 +
centre crop 224 to validate); data of one fixed size (digits, CIFAR-10, synthetic, a factory's
tensors) keeps its own; a ``package.module:function`` model has no native size, so an
ImageFolder keeps its shorter side. A fresh run on an ImageFolder without ``-a`` builds the
example's ``resnet18``, and one block lists tandem's defaults that differ from the imagenet
example's (:func:`example_block`): tandem keeps its own (see the README for why).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tandem.config import TrainConfig
from tandem.factory import is_reference
from tandem.models import native_input_size
from tandem.precision import Precision

__all__ = ["is_imagefolder", "size_rule", "fresh_defaults", "sized", "size_line", "example_block",
           "precision_line", "IMAGEFOLDER_ARCH"]

IMAGEFOLDER_ARCH = "resnet18"  # the imagenet example's default -a

# The imagenet example's defaults that tandem's differ from: (section, field, theirs, flag);
# the example's seed is None (unseeded), tandem's a fixed number.
_EXAMPLE = (("optim", "lr", 0.1, "--lr"), ("optim", "weight_decay", 1e-4, "--wd"),
            ("optim", "batch_size", 256, "-b"), ("optim", "epochs", 90, "--epochs"),
            ("data", "workers", 4, "-j"), ("optim", "label_smoothing", 0.0, "--label-smoothing"),
            ("optim", "lr_schedule", "step", "--lr-schedule"), ("run", "print_freq", 10, "-p"),
            ("run", "seed", None, "--seed"))


def is_imagefolder(spec: str) -> bool:
    """True when ``--data`` names an ImageFolder directory (a directory, not CIFAR-10's)."""
    from tandem.data.cifar10 import find_cifar_dir

    if not isinstance(spec, str) or spec in ("synthetic", "digits"):
        return False
    path = Path(spec).expanduser()
    if is_reference(spec) and not path.exists():
        return False
    return path.is_dir() and find_cifar_dir(path) is None


def size_rule(arch: str, data: str) -> int | None:
    """The default image side for ``arch`` on ``data`` (``None``: the data's own: its fixed
    size, or an ImageFolder's shorter side under a factory's model)."""
    if is_imagefolder(data) and not is_reference(arch):
        return native_input_size(arch)
    return None


def fresh_defaults(cfg: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """``cfg`` of a fresh run with the arch and image size it takes when not typed; the config
    then records them, so a resume and an eval of the run use the same."""
    if "arch" not in given and is_imagefolder(cfg.data.data):
        cfg = replace(cfg, model=replace(cfg.model, arch=IMAGEFOLDER_ARCH))
    return sized(cfg, given)


def sized(cfg: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """``cfg`` with the image size of :func:`size_rule` unless ``--image-size`` was typed (a
    fresh run, or one continuing a file from elsewhere, which names its arch)."""
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
        why = (f"the data's shorter side: {arch} has no native size, and photos are "
               f"cropped to it")
    else:
        resize = round(size * 256 / 224)
        why = (f"{arch}'s native size: training crops {size}px, validation resized to "
               f"{resize} and centre-cropped to {size}")
    return f"image size {size}px ({why}; --image-size to change)"


def _show(value) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def example_block(cfg: TrainConfig, given: frozenset[str]) -> list[str]:
    """For a fresh run on an ImageFolder (the example's data): one line per setting that
    tandem's defaults set otherwise than the imagenet example, with its flag; none typed."""
    if not is_imagefolder(cfg.data.data):
        return []
    lines = []
    for section, name, theirs, flag in _EXAMPLE:
        mine = getattr(getattr(cfg, section), name)
        if name not in given and mine != theirs:
            fixed = ", fixed" if theirs is None else ""  # the example's runs differ, ours not
            lines.append(f"  {flag} {_show(mine)}{fixed} (the example: "
                         f"{'unseeded' if theirs is None else _show(theirs)})")
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
