"""``load_dataset(spec)``: a ``--data`` value as ``(train, val, info)``.

``spec`` is ``synthetic``, ``digits`` (names win: ``./digits`` is a directory), a CIFAR-10
pickle directory, an ImageFolder directory, or ``package.module:function`` (:mod:`.given`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.errors import MissingFileError, UsageError
from tandem.factory import is_reference
from tandem.suggest import closest_names

from .dataset import AUGMENT_FORMS, SPLITS, Recipe, parse_augment

DATASET_NAMES = ("synthetic", "digits")
# what "auto" (and a policy) takes as the geometry, by kind of data
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


def check_spec(spec: str) -> None:
    """Refuse a ``--data`` that names nothing (a missing path, an unknown word), before any
    run is made."""
    if spec == GIVEN_DATA or spec in DATASET_NAMES or is_reference(spec) or \
            Path(spec).expanduser().exists():
        return
    if os.sep in spec or (os.altsep or os.sep) in spec or spec.startswith((".", "~")):
        raise MissingFileError(f"data path '{spec}' does not exist (expected an ImageFolder or "
                               f"CIFAR-10 directory)")
    close = closest_names(spec, list(DATASET_NAMES), 1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(f"unknown dataset {spec!r}: {hint}not one of {', '.join(DATASET_NAMES)}, "
                     f"and no such path",
                     hint="give a path to an ImageFolder or CIFAR-10 python directory, or "
                          "package.module:function returning your own")


def load_dataset(spec: str, *, augment: str = "none", seed: int = 0,
                 image_size: int | None = None, synthetic_size: int | None = None,
                 num_classes: int | None = None, splits: tuple[str, ...] = SPLITS,
                 reprob: float = 0.0):
    """``(train, val, DatasetInfo)`` for ``spec``; a split not in ``splits`` is None, never read.
    ``augment`` (:data:`AUGMENT_FORMS`) and ``reprob`` apply to the training split only; ``seed``
    chooses the ``synthetic`` data; for real data ``num_classes`` (the model's outputs) is at
    least the data's class count."""
    if not isinstance(spec, (str, os.PathLike)):
        raise UsageError(f"data spec must be a name or a path, got {spec!r}")
    spec = os.fspath(spec)
    splits = (splits,) if isinstance(splits, str) else tuple(splits)
    if not splits or not set(splits) <= set(SPLITS):
        raise UsageError(f"splits must name one or more of {', '.join(SPLITS)}, got {splits!r}")
    if spec == GIVEN_DATA:
        raise UsageError("this run's data sets were given to tandem.fit: tandem cannot load "
                         "them again", hint="give the data (a name, directory or "
                                            "package.module:function)")
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
        check_spec(spec)
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise UsageError(f"data path '{spec}' is not a directory")
        from .cifar10 import find_cifar_dir, load_cifar10
        from .imagefolder import load_imagefolder
        cifar_dir = find_cifar_dir(path)
        if cifar_dir is not None:
            result = load_cifar10(cifar_dir, augment=_augment_for(recipe, "other", spec),
                                  image_size=image_size, splits=splits)
        else:
            result = load_imagefolder(path, augment=_augment_for(recipe, "imagefolder", spec),
                                      image_size=image_size, splits=splits)
    info = result[2]
    if num_classes is not None and num_classes < info.num_classes:
        raise UsageError(f"data '{spec}' has {info.num_classes} classes, more than num_classes="
                         f"{num_classes}: the model needs an output for each class")
    return result
