"""``synthetic``: random images from a seed, for speed runs and tests. Sample ``i`` is its
class's template plus noise from ``(seed, split, i)``: learnable, whatever the load order.
"""

from __future__ import annotations

import numpy as np

from tandem.errors import UsageError

from .dataset import SPLITS, DatasetInfo, ImageDataset, check_size
from .transforms import mix_seed

SYNTHETIC_DEFAULTS = dict(size=1024, num_classes=10, in_channels=3, image_size=32)
_TEMPLATE = 4  # side of the per-class template before upsampling
CACHE_BYTES = 256 * 2**20


class SyntheticDataset(ImageDataset):
    """``size`` random ``(in_channels, image_size, image_size)`` images over ``num_classes``."""

    def __init__(self, size: int, *, num_classes: int, in_channels: int, image_size: int,
                 seed: int, split: int, augment: str = "none"):
        super().__init__(shape=(in_channels, image_size, image_size), augment=augment,
                         pad=image_size // 8, flip=True, mean=[0.0] * in_channels,
                         std=[1.0] * in_channels)
        self.size, self.num_classes, self.seed, self.split = size, num_classes, seed, split
        g = np.random.default_rng(mix_seed(seed, 7919))  # the same templates for every split
        self.templates = g.standard_normal((num_classes, in_channels, _TEMPLATE, _TEMPLATE),
                                           dtype=np.float32)
        # nearest-neighbour upsampling of a template: which template cell each pixel shows
        self._rows = np.arange(image_size) * _TEMPLATE // image_size
        self._cache = None
        if size * int(np.prod(self.shape)) * 4 <= CACHE_BYTES:
            samples = [self._generate(i) for i in range(size)]
            self._cache = (np.stack([s[0] for s in samples]),
                           np.array([s[1] for s in samples], dtype=np.int64))

    def __len__(self) -> int:
        return self.size

    def _generate(self, index: int) -> tuple[np.ndarray, int]:
        g = np.random.Generator(np.random.Philox(mix_seed(self.seed, self.split, index)))
        label = int(g.integers(self.num_classes))
        signal = self.templates[label][:, self._rows][:, :, self._rows]
        return signal + g.standard_normal(self.shape, dtype=np.float32), label

    def raw(self, index: int) -> tuple[np.ndarray, int]:
        if self._cache is None:
            return self._generate(index)
        return self._cache[0][index], int(self._cache[1][index])


def split_sizes(size: int | None) -> tuple[int, int]:
    """The samples of the train and val splits for ``--synthetic-size`` ``size``."""
    size = SYNTHETIC_DEFAULTS["size"] if size is None else size
    return size, max(1, size // 4)


def load_synthetic(*, augment: str, seed: int, image_size: int | None, size: int | None,
                   num_classes: int | None, splits: tuple[str, ...] = SPLITS):
    """``(train, val, info)``; a split not in ``splits`` is None (not generated)."""
    size = split_sizes(size)[0]
    policy = getattr(augment, "policy", None)
    if policy is not None:
        raise UsageError(f"augment {policy.spec!r} works on images (pixels in [0, 1]), and "
                         f"synthetic data is noise: use digits, CIFAR-10 or an ImageFolder")
    num_classes = SYNTHETIC_DEFAULTS["num_classes"] if num_classes is None else num_classes
    image_size = SYNTHETIC_DEFAULTS["image_size"] if image_size is None else image_size
    channels = SYNTHETIC_DEFAULTS["in_channels"]
    for name, value in (("synthetic_size", size), ("num_classes", num_classes),
                        ("image_size", image_size)):
        check_size(value, "synthetic data", name)
    common = dict(num_classes=num_classes, in_channels=channels, image_size=image_size, seed=seed)
    train = (SyntheticDataset(size, split=0, augment=augment, **common)
             if "train" in splits else None)
    val = (SyntheticDataset(split_sizes(size)[1], split=1, augment="none", **common)
           if "val" in splits else None)
    info = DatasetInfo("synthetic", num_classes, channels, image_size,
                       [str(c) for c in range(num_classes)])
    return train, val, info
