"""The few image transforms tandem needs, on PIL and CHW float32 numpy arrays (a numpy op costs
about a microsecond, a torch op tens). Randomness comes only from :class:`SampleRandom`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tandem.keyed.keys import mix_seed, splitmix64 as _splitmix64  # the keys' one home

_MASK = (1 << 64) - 1


class SampleRandom:
    """A deterministic stream for one sample, ``SampleRandom(seed, epoch, i)``: splitmix64 over
    a counter from :func:`mix_seed` of the key; about a microsecond, no global RNG touched."""

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

    def uniform(self, low: float, high: float) -> float:
        """Uniform float in ``[low, high)`` (53 random bits, like ``random.random``)."""
        return low + (high - low) * ((self._next() >> 11) * 2.0 ** -53)


def shorter_side_size(w: int, h: int, size: int) -> tuple[int, int]:
    """``(w, h)`` scaled so the shorter side is ``size``: torchvision's ``Resize(size)``, whose
    longer side is ``int(size * long / short)`` (truncated, not rounded)."""
    short, long = (w, h) if w <= h else (h, w)
    new_long = max(1, int(size * long / short))
    return (size, new_long) if w <= h else (new_long, size)


def center_offset(length: int, size: int) -> int:
    """Where torchvision's ``CenterCrop`` starts a ``size`` crop of ``length``: the excess
    halved, rounded half to even (``int(round((length - size) / 2.0))``)."""
    return int(round((length - size) / 2.0))


def to_array(img: Image.Image) -> np.ndarray:
    """PIL image (RGB or L) to a ``float32`` CHW array with values in ``[0, 1]``."""
    arr = np.asarray(img, dtype=np.float32) / 255.0
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return arr.transpose(2, 0, 1)


def resize_array(img: np.ndarray, size: int) -> np.ndarray:
    """Resize a CHW array to ``size x size`` (bilinear; the same array when already that size)."""
    if img.shape[-1] == size and img.shape[-2] == size:
        return img
    t = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)).unsqueeze(0)
    out = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
    return out.squeeze(0).numpy()


def random_shift(img: np.ndarray, padding: int, rng: SampleRandom) -> np.ndarray:
    """CIFAR's random crop with padding: content moved up to ``padding`` pixels each way, the
    uncovered border zero."""
    if padding <= 0:
        return img
    h, w = img.shape[-2:]
    dy = rng.randint(2 * padding + 1) - padding  # output (y, x) shows source (y + dy, x + dx)
    dx = rng.randint(2 * padding + 1) - padding
    out = np.zeros_like(img)
    if abs(dy) >= h or abs(dx) >= w:  # shifted right out of the frame
        return out
    out[..., max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)] = \
        img[..., max(0, dy):h - max(0, -dy), max(0, dx):w - max(0, -dx)]
    return out


def hflip(img: np.ndarray) -> np.ndarray:
    """Mirror a CHW array left to right (a view)."""
    return img[..., ::-1]


def to_tensor(img: np.ndarray | Image.Image) -> torch.Tensor:
    """A CHW array (or a PIL image, via :func:`to_array`) as a contiguous float tensor."""
    if isinstance(img, Image.Image):
        img = to_array(img)
    return torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32))
