"""What every tandem dataset shares: :class:`DatasetInfo`, sample keys, the augmentation step.

A dataset is indexed by a sample key ``(index, seed, epoch)`` (an ``int`` is ``(index, 0, 0)``)
that seeds that sample's augmentation, so a sample looks the same whoever loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from tandem.errors import UsageError, param

from .erasing import erase_normalised
from .policies import POLICY_FORMS, Policy, parse_policy
from .transforms import SampleRandom, hflip, random_shift, to_tensor

AUGMENT_MODES = ("none", "standard", "imagenet")
#: what ``--augment`` takes: ``auto`` (the data's own geometry), a geometry, or a policy
#: after the data's own geometry
AUGMENT_FORMS = ("auto", *AUGMENT_MODES, *POLICY_FORMS)
SPLITS = ("train", "val")  # what every loader returns, in this order, then the DatasetInfo
SPLIT_SEED, VAL_FRACTION = 0, 0.2  # a data set without a val split: 80/20 per class, fixed


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    classes: list[str] | None = None


@dataclass(frozen=True)
class Recipe:
    """A split's augmentation: ``geometry`` (:data:`AUGMENT_MODES`, or ``auto`` until the data
    resolves it), then ``policy`` (:mod:`.policies`), then random erasing (:mod:`.erasing`)."""

    geometry: str = "none"
    policy: Policy | None = None
    reprob: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.reprob <= 1.0:
            raise UsageError(f"bad {param('reprob')} {self.reprob:g}: must be in [0, 1]")

    @property
    def pixels(self) -> bool:
        """Whether it changes pixels after the crop, which ``--decode gpu`` cannot do."""
        return self.policy is not None or self.reprob > 0

    def resolved(self, geometry: str) -> "Recipe":
        """The recipe with an ``auto`` geometry as ``geometry``."""
        return replace(self, geometry=geometry) if self.geometry == "auto" else self


def parse_augment(augment: str | Recipe, reprob: float = 0.0) -> Recipe:
    """``--augment`` (:data:`AUGMENT_FORMS`) and ``--reprob`` as a :class:`Recipe`."""
    if isinstance(augment, Recipe):
        return augment
    if augment == "auto" or augment in AUGMENT_MODES:
        return Recipe(augment, None, reprob)
    if not isinstance(augment, str) or not augment.startswith(("randaugment", "trivialaugment")):
        raise UsageError(f"bad {param('augment')} {augment!r}: choose one of "
                         f"{', '.join(AUGMENT_FORMS)}")
    return Recipe("auto", parse_policy(augment), reprob)


def check_size(value, what: str, name: str = "image_size") -> None:
    """Refuse a size that is not a positive int, naming the data (``what``) and the size."""
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"{what}: {name} must be a positive int, got {value!r}")


def split_key(key) -> tuple[int, int, int]:
    """``(index, seed, epoch)`` from a sample key or a bare int index."""
    if isinstance(key, tuple):
        index, seed, epoch = key
        return int(index), int(seed), int(epoch)
    return int(key), 0, 0


class ImageDataset(Dataset):
    """Base class: key -> ``raw(index)`` -> augmentation -> normalisation -> ``(image, label)``.
    ``"standard"`` shifts by up to ``pad`` pixels and, with ``flip``, mirrors half the time; a
    policy works on the float image in ``[0, 1]``, erasing on the normalised one."""

    dtype = torch.float32  # of the images __getitem__ returns
    normalization = None  # what the device applies to a uint8 subclass's images

    def __init__(self, *, shape: tuple[int, int, int], augment: str, pad: int, flip: bool,
                 mean: Sequence[float], std: Sequence[float]):
        self.shape = tuple(shape)  # (C, H, W) of every sample this dataset returns
        self.recipe = parse_augment(augment)
        self.augment = self.recipe.geometry
        if self.augment not in AUGMENT_MODES:
            raise UsageError(f"unknown augment {self.augment!r}; choose one of: "
                             f"{', '.join(AUGMENT_MODES)}")
        self.policy, self.reprob = self.recipe.policy, self.recipe.reprob
        self.pad, self.flip = pad, flip
        self.mean, self.std = list(mean), list(std)
        self._mean = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
        self._inv_std = 1.0 / np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def raw(self, index: int) -> tuple[np.ndarray, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _split(self, key) -> tuple[int, int, int]:
        index, seed, epoch = split_key(key)
        n = len(self)
        if not 0 <= index < n:
            raise IndexError(f"sample index {index} out of range for {type(self).__name__} "
                             f"of {n} samples")
        return index, seed, epoch

    @property
    def fill(self) -> tuple[int, ...] | int:
        """The mean colour as ``uint8`` pixels (timm's ``img_mean``); an int for one channel."""
        pixels = tuple(min(255, round(255 * m)) for m in self.mean)
        return pixels[0] if len(pixels) == 1 else pixels

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        index, seed, epoch = self._split(key)
        image, label = self.raw(index)
        rng = SampleRandom(seed, epoch, index)  # the sample's one stream, drawn in this order
        if self.augment == "standard":
            image = random_shift(image, self.pad, rng)
            if self.flip and rng.coin():
                image = hflip(image)
        if self.policy is not None:
            image = self.policy.on_float(image, rng, self.fill)
        image = (image - self._mean) * self._inv_std
        if self.reprob:
            image = erase_normalised(image, self.reprob, rng)
        return to_tensor(image), label


def stratified_split(labels: Sequence[int], val_fraction: float, seed: int
                     ) -> tuple[list[int], list[int]]:
    """Sorted ``(train, val)`` indices, ``round(val_fraction * n)`` of each class to val (at
    least one of a class of two or more, none of one), shuffled by ``seed``."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(val_fraction * len(idx)))
        k = min(max(k, 1 if len(idx) > 1 else 0), len(idx) - 1)
        val.extend(idx[:k].tolist())
        train.extend(idx[k:].tolist())
    return sorted(train), sorted(val)
