"""CIFAR-10 from its python-pickle directory; ``test_batch`` is validation. The unpickler takes
numpy arrays and plain containers only, so a tampered file cannot run code.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from tandem.errors import MissingFileError, UsageError, a

from .dataset import SPLITS, DatasetInfo, ImageDataset, check_size
from .transforms import resize_array

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

# numpy's array reconstruction (and ``_codecs.encode``: bytes at pickle protocol 2)
_ALLOWED = {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def find_cifar_dir(path: Path) -> Path | None:
    """``path`` or ``path/cifar-10-batches-py`` if it holds CIFAR-10 batches."""
    for candidate in (path, path / "cifar-10-batches-py"):
        if (candidate / TEST_FILE).exists() or any((candidate / f).exists() for f in TRAIN_FILES):
            return candidate
    return None


def read_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N,3,32,32), labels int64 (N,))`` from one batch file, validated."""
    try:
        with open(file, "rb") as f:
            batch = _ArraysOnly(f, encoding="bytes").load()
    except FileNotFoundError:
        raise MissingFileError(f"CIFAR-10 file '{file}' is missing") from None
    except Exception as exc:  # truncated, not a pickle, refused class...
        raise UsageError(f"CIFAR-10 file '{file}' is corrupt or not a CIFAR batch "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, dict):
        raise UsageError(f"CIFAR-10 file '{file}' holds {a(type(batch).__name__)}, not a dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3 * 32 * 32:
        found = getattr(data, "shape", type(data).__name__)
        raise UsageError(f"CIFAR-10 file '{file}': 'data' must be a uint8 array of shape "
                         f"(N, 3072), found {found}")
    labels = np.asarray(labels if labels is not None else [], dtype=np.int64).reshape(-1)
    if labels.shape[0] != data.shape[0]:
        raise UsageError(f"CIFAR-10 file '{file}': {data.shape[0]} images but "
                         f"{labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UsageError(f"CIFAR-10 file '{file}': labels must be in 0..9, found "
                         f"{labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels


def _read_classes(directory: Path) -> list[str]:
    try:
        with open(directory / "batches.meta", "rb") as f:
            names = _ArraysOnly(f, encoding="bytes").load()[b"label_names"]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        return names if len(names) == 10 else CIFAR10_CLASSES
    except Exception:  # optional file: fall back to the official names
        return list(CIFAR10_CLASSES)


class Cifar10Dataset(ImageDataset):
    """CIFAR images held as a ``uint8`` ``(N, 3, 32, 32)`` array."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, augment: str,
                 image_size: int = 32):
        super().__init__(shape=(3, image_size, image_size), augment=augment,
                         pad=image_size // 8, flip=True, mean=MEAN, std=STD)
        self.images, self.labels, self.image_size = images, labels, image_size

    def __len__(self) -> int:
        return self.images.shape[0]

    def raw(self, index: int) -> tuple[np.ndarray, int]:
        image = self.images[index].astype(np.float32) / 255.0
        return resize_array(image, self.image_size), int(self.labels[index])


def load_cifar10(directory: Path, *, augment: str, image_size: int | None,
                 splits: tuple[str, ...] = SPLITS):
    """``(train, val, info)``; a split not in ``splits`` is None, its files not read."""
    size = 32 if image_size is None else image_size
    check_size(size, "CIFAR-10")
    train = val = None
    if "train" in splits:
        images, labels = zip(*[read_batch(directory / f) for f in TRAIN_FILES])
        train = Cifar10Dataset(np.concatenate(images), np.concatenate(labels), augment=augment,
                               image_size=size)
    if "val" in splits:
        val = Cifar10Dataset(*read_batch(directory / TEST_FILE), augment="none", image_size=size)
    return train, val, DatasetInfo("cifar10", 10, 3, size, _read_classes(directory))
