"""``digits``: scikit-learn's bundled 8x8 digits (1,797 images), split 80/20 by a fixed seed.
``augment="standard"`` shifts but never flips: digits are not mirror-symmetric.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from .dataset import (SPLIT_SEED, SPLITS, VAL_FRACTION, DatasetInfo, ImageDataset, check_size,
                      stratified_split)
from .transforms import resize_array


class DigitsDataset(ImageDataset):
    """A subset of the digits images held in memory as a ``(N, 1, S, S)`` float32 array."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, augment: str,
                 mean: float, std: float):
        size = images.shape[-1]
        super().__init__(shape=(1, size, size), augment=augment, pad=max(1, size // 8),
                         flip=False, mean=[mean], std=[std])
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def raw(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images (1797, 8, 8), labels)`` from scikit-learn's ``digits.csv.gz``, without
    importing ``sklearn.datasets`` (1.8 s of CPU in every rank) unless the file is missing."""
    spec = importlib.util.find_spec("sklearn")
    places = list(spec.submodule_search_locations or []) if spec else []
    for place in places:
        path = os.path.join(place, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            rows = np.loadtxt(path, delimiter=",")
            if rows.shape == (1797, 65):
                return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def load_digits_data(*, augment: str, image_size: int | None, splits: tuple[str, ...] = SPLITS):
    """``(train, val, info)`` at ``image_size`` (default 8); a split not in ``splits`` is None."""
    size = 8 if image_size is None else image_size
    check_size(size, "digits")
    pixels, labels = _bundled_digits()
    images = pixels.astype(np.float32)[:, None] / 16.0
    if size != 8:
        images = np.stack([resize_array(img, size) for img in images])
    train_idx, val_idx = stratified_split(labels.tolist(), VAL_FRACTION, SPLIT_SEED)
    train_images = images[train_idx]
    mean, std = float(train_images.mean()), float(train_images.std())
    train = DigitsDataset(train_images, labels[train_idx], augment=augment, mean=mean, std=std)
    val = DigitsDataset(images[val_idx], labels[val_idx], augment="none", mean=mean, std=std)
    info = DatasetInfo("digits", 10, 1, size, [str(d) for d in range(10)])
    return (train if "train" in splits else None), (val if "val" in splits else None), info
