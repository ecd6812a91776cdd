"""ImageFolder directories read with Pillow: ``root/<class>/**/<image>``.

Either ``root/train`` and ``root/val``, or one directory split 80/20 per class with the fixed
:data:`SPLIT_SEED`, whatever the run's seed; that split is logged (``tandem.data``, INFO: the CLI
prints it once). Samples are ``uint8`` ``(3, S, S)`` (``S``: ``image_size``, default the
images' own size), normalised on the device. Warning: corrupt images are skipped with a
warning, never a crash; a file that only fails to decode when loaded is replaced by the next
sample that decodes, which then appears twice that epoch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

import torch

from tandem.errors import UsageError

from .base import DatasetInfo, ImageDataset, stratified_split
from .device import Normalization
from .imagenet_transforms import train_crop, val_crop
from .transforms import SampleRandom, hflip, random_shift

__all__ = ["ImageFolderDataset", "load_imagefolder", "find_images", "IMG_EXTENSIONS",
           "SPLIT_SEED", "VAL_FRACTION", "NORMALIZATION"]

log = logging.getLogger("tandem.data")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
                  ".gif")
SPLIT_SEED = 0
VAL_FRACTION = 0.2
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
NORMALIZATION = Normalization(MEAN, STD)

_warned: set[str] = set()  # files already reported in this process


def _warn_once(path: str, why: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("skipping unreadable image '%s': %s", path, why)


def _header_ok(path: str) -> bool:
    try:
        with Image.open(path):
            return True
    except Exception as exc:  # PIL raises several types for bad files
        _warn_once(path, f"{type(exc).__name__}: {exc}")
        return False


def _classes(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def find_images(root: Path, classes: list[str]) -> list[tuple[str, int]]:
    """Sorted ``(path, class index)`` of readable images under ``root/<class>/``."""
    samples = []
    for label, name in enumerate(classes):
        class_dir = root / name
        if not class_dir.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
            dirnames.sort()
            for fname in sorted(filenames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    path = os.path.join(dirpath, fname)
                    if _header_ok(path):
                        samples.append((path, label))
    return samples


class ImageFolderDataset(ImageDataset):
    """A list of ``(path, label)`` decoded with Pillow on access to ``uint8`` (see module doc).

    It replaces the float ``raw`` -> normalise path of :class:`ImageDataset` by its own
    ``__getitem__``: crops come out of Pillow as ``uint8`` and stay so until the device.
    """

    dtype = torch.uint8
    normalization = NORMALIZATION

    def __init__(self, samples: list[tuple[str, int]], *, image_size: int, augment: str):
        super().__init__(shape=(3, image_size, image_size), augment=augment,
                         pad=image_size // 8, flip=True, mean=MEAN, std=STD)
        self.samples = samples
        self.image_size = image_size
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, index: int, rng: SampleRandom) -> np.ndarray:
        """``(S, S, 3)`` uint8 crop of file ``index``; the draws come from ``rng``."""
        path = self.samples[index][0]
        if self.augment == "imagenet":
            return train_crop(path, self.image_size, rng)
        image = val_crop(path, self.image_size)
        if self.augment == "standard":
            chw = random_shift(image.transpose(2, 0, 1), self.pad, rng)
            image = np.ascontiguousarray((hflip(chw) if rng.coin() else chw).transpose(1, 2, 0))
        return image

    def decode_key(self, key) -> tuple[np.ndarray, int]:
        """``(HWC uint8 image, label)`` for a sample key, substituting the next decodable file
        for a corrupt one (warned once per file per process)."""
        index, seed, epoch = self._split(key)
        n = len(self.samples)
        for step in range(n):
            i = (index + step) % n
            if i in self._bad:
                continue
            try:  # the draws are keyed by the sample asked for, even for a substitute
                return self._decode(i, SampleRandom(seed, epoch, index)), self.samples[i][1]
            except Exception as exc:  # corrupt pixels: substitute the next good sample
                self._bad.add(i)
                _warn_once(self.samples[i][0], f"{type(exc).__name__}: {exc}")
        raise RuntimeError(f"no image in this ImageFolder split can be decoded "
                           f"(first: '{self.samples[0][0]}')")

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        """``(3, S, S)`` uint8, a view of the ``(S, S, 3)`` crop (channels-last strides, which
        :func:`~tandem.data.loader.collate` keeps: no transpose on the CPU)."""
        image, label = self.decode_key(key)
        return torch.from_numpy(image).permute(2, 0, 1), label


def load_imagefolder(root: Path, *, augment: str, image_size: int | None):
    """``(train, val, info)`` for an ImageFolder directory (either layout)."""
    if image_size is not None and (not isinstance(image_size, int) or image_size < 1):
        raise UsageError(f"ImageFolder: image_size must be a positive int, got {image_size!r}")
    train_dir, val_dir = root / "train", root / "val"
    if train_dir.is_dir():
        if not val_dir.is_dir():
            raise UsageError(f"ImageFolder '{root}' has train/ but no val/ directory")
        classes = _classes(train_dir)
        extra = sorted(set(_classes(val_dir)) - set(classes))
        if extra:
            raise UsageError(f"ImageFolder '{val_dir}' has classes not in train/: "
                             f"{', '.join(extra[:5])}")
        _check_classes(train_dir, classes)
        train_samples = _check_samples(train_dir, find_images(train_dir, classes))
        val_samples = _check_samples(val_dir, find_images(val_dir, classes))
    else:
        classes = _classes(root)
        _check_classes(root, classes)
        samples = _check_samples(root, find_images(root, classes))
        train_idx, val_idx = stratified_split([s[1] for s in samples], VAL_FRACTION, SPLIT_SEED)
        train_samples = [samples[i] for i in train_idx]
        val_samples = [samples[i] for i in val_idx]
        if not val_samples:
            raise UsageError(f"ImageFolder '{root}' is too small to split off a validation set "
                             f"(needs a class with at least 2 images)")
        log.info("ImageFolder '%s' has no train/ and val/: each class is split %d/%d, %d images "
                 "to train and %d to validate, by a shuffle with the fixed seed %d (the same "
                 "split whatever --seed)", root, round(100 * (1 - VAL_FRACTION)),
                 round(100 * VAL_FRACTION), len(train_samples), len(val_samples), SPLIT_SEED)
    size = _own_size(train_samples or val_samples) if image_size is None else image_size
    info = DatasetInfo(root.name or str(root), len(classes), 3, size, classes)
    return (ImageFolderDataset(train_samples, image_size=size, augment=augment),
            ImageFolderDataset(val_samples, image_size=size, augment="none"),
            info)


def _own_size(samples: list) -> int:
    """The shorter side of the first image (its header only): the dataset's own size."""
    with Image.open(samples[0][0]) as img:
        return min(img.size)


def _check_classes(root: Path, classes: list[str]) -> None:
    if not classes:
        raise UsageError(f"ImageFolder '{root}' is empty: expected one subdirectory per class")


def _check_samples(root: Path, samples: list) -> list:
    if not samples:
        raise UsageError(f"ImageFolder '{root}' has no readable images "
                         f"(extensions: {' '.join(IMG_EXTENSIONS)})")
    return samples
