"""What every tandem dataset shares: :class:`DatasetInfo`, sample keys, and the augmentation step.

A dataset is indexed by a sample key ``(index, seed, epoch)`` (a plain ``int`` means
``(index, 0, 0)``) that seeds that sample's augmentation, so a sample looks the same whichever
worker, rank or strategy loads it. Subclasses implement ``__len__`` and ``raw(index)``; a
``uint8`` dataset names a ``normalization`` that the training step applies on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from tandem.errors import UsageError

from .transforms import SampleRandom, hflip, random_shift, to_tensor

__all__ = [
    "DatasetInfo", "ImageDataset", "AUGMENT_MODES", "check_augment", "split_key",
    "stratified_split", "SPLITS",
]

AUGMENT_MODES = ("none", "standard", "imagenet")
SPLITS = ("train", "val")  # what every loader returns, in this order, then the DatasetInfo


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    classes: list[str] | None = None


def check_augment(augment: str) -> str:
    if augment not in AUGMENT_MODES:
        raise UsageError(f"unknown augment {augment!r}; choose one of: {', '.join(AUGMENT_MODES)}")
    return augment


def split_key(key) -> tuple[int, int, int]:
    """``(index, seed, epoch)`` from a sample key or a bare int index."""
    if isinstance(key, tuple):
        index, seed, epoch = key
        return int(index), int(seed), int(epoch)
    return int(key), 0, 0


class ImageDataset(Dataset):
    """Base class: key -> raw sample -> (augmentation) -> normalisation -> ``(image, label)``.

    ``augment="standard"`` shifts the image by up to ``pad`` pixels (zero fill) and, when
    ``flip`` is true, mirrors it with probability 1/2. ``augment="none"`` returns the raw
    sample, normalised. Labels are ints; :func:`make_loader` collates them into a long tensor.
    """

    dtype = torch.float32  # of the images __getitem__ returns
    normalization = None  # what the device applies to uint8 images (None: already float)

    def __init__(self, *, shape: tuple[int, int, int], augment: str, pad: int, flip: bool,
                 mean: Sequence[float], std: Sequence[float]):
        self.shape = tuple(shape)  # (C, H, W) of every sample this dataset returns
        self.augment = check_augment(augment)
        self.pad = pad
        self.flip = flip
        self.mean = list(mean)
        self.std = list(std)
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

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        index, seed, epoch = self._split(key)
        image, label = self.raw(index)
        if self.augment == "standard":
            rng = SampleRandom(seed, epoch, index)
            image = random_shift(image, self.pad, rng)
            if self.flip and rng.coin():
                image = hflip(image)
        return to_tensor((image - self._mean) * self._inv_std), label


def stratified_split(labels: Sequence[int], val_fraction: float, seed: int
                     ) -> tuple[list[int], list[int]]:
    """Split sample indices into ``(train, val)``, taking ``val_fraction`` of every class.

    Each class's indices are shuffled by a generator seeded with ``seed`` and the first
    ``round(val_fraction * n_class)`` go to val (at least one when a class has two or more
    samples, none when it has one). Both lists come back sorted, so the split depends only on
    the labels, the fraction and the seed.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train: list[int] = []
    val: list[int] = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        k = int(round(val_fraction * len(idx)))
        k = min(max(k, 1 if len(idx) > 1 else 0), len(idx) - 1)
        val.extend(idx[:k].tolist())
        train.extend(idx[k:].tolist())
    return sorted(train), sorted(val)
