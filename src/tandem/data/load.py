"""``load_dataset(spec)``: turn a ``--data`` value into ``(train, val, info)``.

``splits`` names the splits a command uses (eval: ``("val",)``); the others come back None and
are never read from disk.

``spec`` is ``synthetic``, ``digits`` (names win: write ``./digits`` for a directory), a CIFAR-10
pickle directory, an ImageFolder directory, or ``package.module:function`` returning data sets
of the user's own (:mod:`.given`; a path of that name wins). A missing path raises
``FileNotFoundError``; an unknown word raises ``ValueError`` listing the valid names.
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.errors import MissingFileError, UsageError
from tandem.factory import is_reference
from tandem.suggest import closest_names

from .dataset import AUGMENT_FORMS, SPLITS, Recipe, parse_augment

__all__ = ["load_dataset", "check_spec", "DATASET_NAMES", "GIVEN_DATA", "AUGMENT_FORMS",
           "DEFAULT_AUGMENT", "SPLITS"]

DATASET_NAMES = ("synthetic", "digits")
# "auto" is each kind of data's own recipe: DEFAULT_AUGMENT["imagefolder"] for ImageFolder
# directories, DEFAULT_AUGMENT["other"] for digits, synthetic and CIFAR-10; a policy
# (randaugment:N:M, trivialaugment: AUGMENT_FORMS) follows that geometry.
DEFAULT_AUGMENT = {"imagefolder": "imagenet", "other": "standard"}
#: what a run's config records for data sets handed to ``tandem.fit`` (nothing to load again)
GIVEN_DATA = "given-to-tandem.fit"


def _augment_for(recipe: Recipe, kind: str, spec: str) -> Recipe:
    """Resolve ``auto`` for this kind of data; ``imagenet`` needs an ImageFolder directory."""
    recipe = recipe.resolved(DEFAULT_AUGMENT[kind])
    if recipe.geometry == "imagenet" and kind != "imagefolder":
        raise UsageError(f"augment 'imagenet' (RandomResizedCrop) needs an ImageFolder "
                         f"directory; data '{spec}' is not one (use 'standard')")
    return recipe


def _check_splits(splits) -> tuple[str, ...]:
    """``splits`` as a tuple, refused unless it is a non-empty part of :data:`SPLITS`."""
    if isinstance(splits, str):
        splits = (splits,)
    splits = tuple(splits)
    if not splits or not set(splits) <= set(SPLITS):
        raise UsageError(f"splits must name one or more of {', '.join(SPLITS)}, got {splits!r}")
    return splits


def _looks_like_path(spec: str) -> bool:
    return (os.sep in spec or (os.altsep is not None and os.altsep in spec)
            or spec.startswith((".", "~")))


def check_spec(spec: str) -> None:
    """Refuse a ``--data`` that names nothing: a missing path, or an unknown word (with the
    closest name); run plans ask it before anything is made."""
    if spec == GIVEN_DATA or spec in DATASET_NAMES or is_reference(spec) or \
            Path(spec).expanduser().exists():
        return
    if _looks_like_path(spec):
        raise MissingFileError(f"data path '{spec}' does not exist (expected an ImageFolder or "
                               f"CIFAR-10 directory)")
    close = closest_names(spec, list(DATASET_NAMES), 1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(
        f"unknown dataset {spec!r}: {hint}not one of {', '.join(DATASET_NAMES)}, and no such "
        f"path (give a path to an ImageFolder or CIFAR-10 python directory, or "
        f"package.module:function returning your own)")


def _checked(spec, splits) -> tuple[str, tuple[str, ...]]:
    """``spec`` as a string and ``splits`` checked, or a one-line refusal of the arguments."""
    if not isinstance(spec, (str, os.PathLike)):
        raise UsageError(f"data spec must be a name or a path, got {spec!r}")
    spec = os.fspath(spec)
    splits = _check_splits(splits)
    if spec == GIVEN_DATA:
        raise UsageError(f"this run's data sets were given to tandem.fit, and tandem cannot "
                         f"load them again: give the data (a name, directory or "
                         f"package.module:function)")
    return spec, splits


def _load_directory(spec: str, augment: Recipe, image_size: int | None, splits):
    """A CIFAR-10 pickle directory, else an ImageFolder directory."""
    check_spec(spec)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UsageError(f"data path '{spec}' is not a directory")
    from .cifar10 import find_cifar_dir, load_cifar10
    cifar_dir = find_cifar_dir(path)
    if cifar_dir is not None:
        return load_cifar10(cifar_dir, augment=_augment_for(augment, "other", spec),
                            image_size=image_size, splits=splits)
    from .imagefolder import load_imagefolder
    return load_imagefolder(path, augment=_augment_for(augment, "imagefolder", spec),
                            image_size=image_size, splits=splits)


def load_dataset(spec: str, *, augment: str = "none", seed: int = 0,
                 image_size: int | None = None, synthetic_size: int | None = None,
                 num_classes: int | None = None, splits: tuple[str, ...] = SPLITS,
                 reprob: float = 0.0):
    """Return ``(train_dataset, val_dataset, DatasetInfo)`` for ``spec`` (``splits``: see the
    module doc).

    ``augment`` (one of :data:`AUGMENT_FORMS`) and random erasing with probability
    ``reprob`` apply to the training split only; validation is never augmented (``auto``:
    the data's own recipe, see :data:`DEFAULT_AUGMENT`; a policy follows it). ``seed``
    chooses the ``synthetic`` data; real data splits are fixed whatever the seed, so the
    validation set never changes between runs. ``synthetic_size`` and ``num_classes`` shape
    the synthetic data; for real data ``num_classes`` is the model's
    outputs, so it must be at least the data's class count (labels index the first outputs).
    """
    spec, splits = _checked(spec, splits)
    recipe = parse_augment(augment, reprob)
    if is_reference(spec) and not os.path.exists(spec):
        from .given import load_factory
        result = load_factory(spec, splits=splits, augment=recipe, image_size=image_size,
                              num_classes=num_classes)
    elif spec == "synthetic":
        from .synthetic import load_synthetic
        return load_synthetic(augment=_augment_for(recipe, "other", spec), seed=seed,
                              image_size=image_size, size=synthetic_size, num_classes=num_classes,
                              splits=splits)
    elif spec == "digits":
        from .digits import load_digits_data
        result = load_digits_data(augment=_augment_for(recipe, "other", spec),
                                  image_size=image_size, splits=splits)
    else:
        result = _load_directory(spec, recipe, image_size, splits)
    info = result[2]
    if num_classes is not None and num_classes < info.num_classes:
        raise UsageError(f"data '{spec}' has {info.num_classes} classes, more than num_classes="
                         f"{num_classes}: the model needs an output for each class")
    return result
