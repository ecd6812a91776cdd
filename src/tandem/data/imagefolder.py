"""ImageFolder directories: ``root/<class>/**/<image>``, as ``root/train`` and ``root/val`` or
one directory split 80/20 per class by a fixed seed. Samples are ``uint8`` ``(3, S, S)``
(``S``: default the shorter side of the first validation image), normalised on the device.

Warning: a file the decoders refuse is warned about once and replaced by the next that
decodes, which then appears twice that epoch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

import torch

from tandem.errors import TandemError, UsageError

from .dataset import (SPLIT_SEED, SPLITS, VAL_FRACTION, DatasetInfo, ImageDataset, check_size,
                      stratified_split)
from .decode import UnreadableImage, decoding
from .device import Normalization
from .erasing import erase_pixels
from .imagenet_transforms import train_crop, val_crop
from .transforms import SampleRandom, hflip, random_shift

log = logging.getLogger("tandem.data")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

_warned: set[str] = set()  # files already reported in this process


def _warn_once(path: str, exc: UnreadableImage) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("skipping %s", exc)  # "unreadable image 'PATH': WHY"


class NoDecodableImage(TandemError, ValueError):
    """No file of a split decodes (from a worker: the message cut back to the original)."""

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


def first_decodable(samples: list[tuple[str, int]], bad: set[int], index: int, decode):
    """``(decode(i), label of i)`` for the first file ``i`` from ``index`` on (wrapping) that
    decodes; a refused file is warned about and added to ``bad``, any other error raised."""
    n = len(samples)
    for step in range(n):
        i = (index + step) % n
        if i in bad:
            continue
        try:
            return decode(i), samples[i][1]
        except UnreadableImage as exc:  # the file's own fault: substitute the next one
            bad.add(i)
            _warn_once(samples[i][0], exc)
    raise NoDecodableImage(f"no image in this ImageFolder split can be decoded (all {n}, "
                           f"first: '{samples[0][0]}')")


def _classes(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def list_images(root: Path, classes: list[str]) -> list[tuple[str, int]]:
    """Sorted ``(path, class index)`` of the image files under ``root/<class>/`` (not opened)."""
    samples = []
    for label, name in enumerate(classes):  # os.walk yields nothing for a missing class
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames.sort()
            samples.extend((os.path.join(dirpath, fname), label) for fname in sorted(filenames)
                           if fname.lower().endswith(IMG_EXTENSIONS))
    return samples


class ImageFolderDataset(ImageDataset):
    """A list of ``(path, label)`` decoded on access to ``uint8`` crops; ``decoder``: the
    training crops' JPEG decoder (:func:`~tandem.data.decode.open_image`)."""

    dtype = torch.uint8
    normalization = Normalization(MEAN, STD)

    def __init__(self, samples: list[tuple[str, int]], *, image_size: int, augment: str,
                 decoder: str | None = None):
        super().__init__(shape=(3, image_size, image_size), augment=augment,
                         pad=image_size // 8, flip=True, mean=MEAN, std=STD)
        self.samples, self.image_size, self.decoder = samples, image_size, decoder
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, index: int, rng: SampleRandom) -> np.ndarray:
        """``(S, S, 3)`` uint8 crop of file ``index``, then the recipe's policy and erasing."""
        path = self.samples[index][0]
        if self.augment == "imagenet":
            image = train_crop(path, self.image_size, rng, self.decoder)
        else:
            image = val_crop(path, self.image_size)
        if self.augment == "standard":
            chw = random_shift(image.transpose(2, 0, 1), self.pad, rng)
            image = np.ascontiguousarray((hflip(chw) if rng.coin() else chw).transpose(1, 2, 0))
        if self.policy is not None:
            image = self.policy.on_uint8(image, rng, self.fill)
        if self.reprob:
            image = erase_pixels(image, self.reprob, rng, self.mean, self.std)
        return image

    def decode_key(self, key) -> tuple[np.ndarray, int]:
        """``(HWC uint8 image, label)`` for a sample key (:func:`first_decodable`)."""
        index, seed, epoch = self._split(key)
        return first_decodable(self.samples, self._bad, index,
                               lambda i: self._decode(i, SampleRandom(seed, epoch, index)))

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        """``(3, S, S)`` uint8, a channels-last view of the crop (collate keeps it)."""
        image, label = self.decode_key(key)
        return torch.from_numpy(image).permute(2, 0, 1), label


def load_imagefolder(root: Path, *, augment: str, image_size: int | None,
                     splits: tuple[str, ...] = SPLITS):
    """``(train, val, info)``; a split not in ``splits`` is None, not even listed."""
    if image_size is not None:
        check_size(image_size, "ImageFolder")
    wanted = [s for s in SPLITS if s in splits or (s == "val" and image_size is None)]
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
        found = {split: (f"'{where}'", _check_listed(where, list_images(where, classes),
                                                     classes if split == "train" else None))
                 for split, where in (("train", train_dir), ("val", val_dir)) if split in wanted}
    else:
        classes = _classes(root)
        _check_classes(root, classes)
        both = zip(SPLITS, _split_flat(root, _check_listed(root, list_images(root, classes),
                                                            classes)))
        found = {split: (f"'{root}' ({split} split)", samples) for split, samples in both
                 if split in wanted}
    sizes = {split: _check_readable(where, samples) for split, (where, samples) in found.items()}
    size = sizes["val"] if image_size is None else image_size
    info = DatasetInfo(root.name or str(root), len(classes), 3, size, classes)
    augments = {"train": augment, "val": "none"}
    train, val = (ImageFolderDataset(found[split][1], image_size=size, augment=augments[split])
                  if split in splits else None for split in SPLITS)
    return train, val, info


def _split_flat(root: Path, samples: list) -> tuple[list, list]:
    """``(train, val)`` samples of a directory without train/ and val/ (logged)."""
    train_idx, val_idx = stratified_split([s[1] for s in samples], VAL_FRACTION, SPLIT_SEED)
    if not val_idx:
        _check_readable(f"'{root}'", samples)  # none readable: the more useful message
        raise UsageError(f"ImageFolder '{root}' is too small to split off a validation set "
                         f"(needs a class with at least 2 images)")
    log.info("ImageFolder '%s' has no train/ and val/: each class is split %d/%d, %d images "
             "to train and %d to validate, by a shuffle with the fixed seed %d (the same "
             "split whatever --seed)", root, round(100 * (1 - VAL_FRACTION)),
             round(100 * VAL_FRACTION), len(train_idx), len(val_idx), SPLIT_SEED)
    return [samples[i] for i in train_idx], [samples[i] for i in val_idx]


def _check_classes(root: Path, classes: list[str]) -> None:
    if not classes:
        raise UsageError(f"ImageFolder '{root}' is empty: expected one subdirectory per class")


def _check_listed(root: Path, samples: list, classes: list[str] | None = None) -> list:
    """``samples``, refused when empty or when one of ``classes`` has none (as torchvision)."""
    if not samples:
        raise UsageError(f"ImageFolder '{root}' has no image files "
                         f"(extensions: {' '.join(IMG_EXTENSIONS)})")
    empty = sorted(set(classes) - {classes[label] for _, label in samples}) if classes else []
    if empty:
        listed = ", ".join(f"'{name}'" for name in empty[:3]) + (" ..." if len(empty) > 3 else "")
        raise UsageError(f"ImageFolder '{root}': class folder{'s' if len(empty) > 1 else ''} "
                         f"{listed} {'hold' if len(empty) > 1 else 'holds'} no image files",
                         hint=f"add its images or remove the folder (extensions: "
                              f"{' '.join(IMG_EXTENSIONS)})")
    return samples


def _check_readable(where: str, samples: list) -> int:
    """The shorter side of the first image of ``samples`` whose header opens; refused if none."""
    for path, _ in samples:
        try:
            with decoding(path), Image.open(path) as img:
                return min(img.size)
        except UnreadableImage as exc:
            _warn_once(path, exc)
    raise UsageError(f"ImageFolder {where} has no readable images: all {len(samples)} "
                     f"image files fail to open")
