"""The few image transforms tandem needs, written on PIL and tensors (no torchvision).

Two halves:

* **Decoding** (PIL): :func:`decode`, :func:`resize_shorter`, :func:`center_crop_pil`,
  :func:`to_tensor`. They run once per sample and are deterministic.
* **Augmentation and normalisation** (CHW float tensors): :func:`random_shift`, :func:`hflip`,
  :func:`normalize`. Randomness comes only from a :class:`SampleRandom`, a tiny counter-based
  generator keyed by ``(seed, epoch, sample index)``. Because the key is the sample itself and
  not the process or thread that happens to load it, the augmentation of a sample is the same
  whatever the number of DataLoader workers, ranks or the strategy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = [
    "SampleRandom", "mix_seed", "decode", "resize_shorter", "center_crop_pil", "to_tensor",
    "random_shift", "hflip", "normalize", "resize_tensor",
]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of splitmix64: a well-mixed 64-bit integer from any 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers (e.g. ``seed, epoch, index``) into one 63-bit seed; order matters."""
    h = 0x1234567
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK))
    return h >> 1  # 63 bits: valid for torch.Generator.manual_seed and numpy


class SampleRandom:
    """A deterministic stream of random numbers for one sample: ``SampleRandom(seed, epoch, i)``.

    Counter-based (splitmix64 over a running counter), so creating one costs about a
    microsecond and no global RNG is touched.
    """

    __slots__ = ("_state",)

    def __init__(self, *key: int):
        self._state = mix_seed(*key)

    def _next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK
        return _splitmix64(self._state)

    def randint(self, n: int) -> int:
        """Uniform integer in ``[0, n)`` (``n >= 1``)."""
        return self._next() % n  # bias < n / 2**64: negligible for crop offsets

    def coin(self) -> bool:
        """A fair coin flip."""
        return bool(self._next() >> 63)


# -- decoding (PIL) ------------------------------------------------------------------------

def decode(path) -> Image.Image:
    """Open and fully decode an image file as RGB (``OSError`` or a PIL error if corrupt)."""
    with Image.open(path) as img:
        img.load()  # force the decode now, inside the caller's error handling
        return img.convert("RGB")


def resize_shorter(img: Image.Image, size: int) -> Image.Image:
    """Resize so the shorter side is ``size`` pixels, keeping the aspect ratio (bilinear)."""
    w, h = img.size
    if min(w, h) == size:
        return img
    if w <= h:
        new = (size, max(1, round(h * size / w)))
    else:
        new = (max(1, round(w * size / h)), size)
    return img.resize(new, Image.BILINEAR)


def center_crop_pil(img: Image.Image, size: int) -> Image.Image:
    """Crop the central ``size x size`` square (the image must be at least that big)."""
    w, h = img.size
    left, top = (w - size) // 2, (h - size) // 2
    return img.crop((left, top, left + size, top + size))


def to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image (RGB or L) to a float CHW tensor with values in ``[0, 1]``."""
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


# -- tensors -------------------------------------------------------------------------------

def resize_tensor(img: torch.Tensor, size: int) -> torch.Tensor:
    """Resize a CHW tensor to ``size x size`` (bilinear; a no-op when already that size)."""
    if img.shape[-1] == size and img.shape[-2] == size:
        return img
    return F.interpolate(img.unsqueeze(0), size=(size, size), mode="bilinear",
                         align_corners=False).squeeze(0)


def random_shift(img: torch.Tensor, padding: int, rng: SampleRandom) -> torch.Tensor:
    """Zero-pad ``padding`` pixels on every side, then crop the original size at a random offset.

    This is the classic CIFAR "random crop with padding": content moves by up to ``padding``
    pixels and the uncovered border is zero (black before normalisation).
    """
    if padding <= 0:
        return img
    h, w = img.shape[-2:]
    dy, dx = rng.randint(2 * padding + 1), rng.randint(2 * padding + 1)
    padded = F.pad(img, (padding, padding, padding, padding))
    return padded[..., dy:dy + h, dx:dx + w]


def hflip(img: torch.Tensor) -> torch.Tensor:
    """Mirror a CHW tensor left to right."""
    return img.flip(-1)


def normalize(img: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(img - mean) / std`` per channel; returns a new tensor."""
    m = torch.as_tensor(mean, dtype=img.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=img.dtype).view(-1, 1, 1)
    return (img - m) / s
