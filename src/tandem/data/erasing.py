"""Random erasing (Zhong et al. 2020, arXiv 1708.04896) as timm's ``RandomErasing`` does it,
each draw from the sample's own :class:`SampleRandom`.

With probability ``prob`` one box is erased: up to 10 tries draw an area of 2% to 1/3 of the
image and an aspect ratio log-uniform in ``[0.3, 1/0.3]``; the first box that fits inside is
placed uniformly and filled with per-pixel standard normal noise (timm's ``mode="pixel"``, one
box: its ``--reprob P --remode pixel --recount 1``).

timm erases after normalisation, so the noise is noise of the normalised image. Here it happens
in the sample's own transform, in the loader, where its draws are the sample's wherever it
is loaded: a float data set (digits, CIFAR-10) erases its normalised image exactly so
(:func:`erase_normalised`); a ``uint8`` one (ImageFolder) keeps its pixels ``uint8`` until
the device and erases with the noise taken back through its normalisation, ``255 (mean + std
z)``, rounded and clipped to ``0..255`` (:func:`erase_pixels`): draws beyond about two
standard deviations are clipped, and the rest are quantised to 1/255 of the range.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .transforms import SampleRandom

__all__ = ["erase_box", "erase_normalised", "erase_pixels", "AREA", "ASPECT", "TRIES"]

AREA = (0.02, 1 / 3)
ASPECT = (0.3, 1 / 0.3)
TRIES = 10


def erase_box(height: int, width: int, prob: float, rng: SampleRandom
              ) -> tuple[int, int, int, int] | None:
    """``(top, left, h, w)`` of the box to erase, or None (not erased, or no try fitted)."""
    if prob <= 0 or rng.uniform(0.0, 1.0) > prob:
        return None
    area = height * width
    log_lo, log_hi = math.log(ASPECT[0]), math.log(ASPECT[1])
    for _ in range(TRIES):
        target = rng.uniform(*AREA) * area
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        h = int(round(math.sqrt(target * aspect)))
        w = int(round(math.sqrt(target / aspect)))
        if w < width and h < height:
            return rng.randint(height - h + 1), rng.randint(width - w + 1), h, w
    return None


def _noise(rng: SampleRandom, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float32 noise from a generator keyed by the sample's stream."""
    g = np.random.Generator(np.random.Philox(key=rng.randint(1 << 63)))
    return g.standard_normal(shape, dtype=np.float32)


def erase_normalised(image: np.ndarray, prob: float, rng: SampleRandom) -> np.ndarray:
    """A normalised ``(C, H, W)`` float image with a box of noise, with probability ``prob``
    (the same array, written in place, when erased; as it was when not)."""
    channels, height, width = image.shape
    box = erase_box(height, width, prob, rng)
    if box is None:
        return image
    top, left, h, w = box
    image = np.array(image, dtype=np.float32)  # never a view of the data set's own
    image[:, top:top + h, left:left + w] = _noise(rng, (channels, h, w))
    return image


def erase_pixels(image: np.ndarray, prob: float, rng: SampleRandom, mean: Sequence[float],
                 std: Sequence[float]) -> np.ndarray:
    """An ``(H, W, C)`` ``uint8`` image with a box of noise, with probability ``prob``: the
    noise ``z`` of the normalised image, as the pixels ``255 (mean + std z)`` (rounded,
    clipped) that the device's normalisation turns back into it."""
    height, width, channels = image.shape
    box = erase_box(height, width, prob, rng)
    if box is None:
        return image
    top, left, h, w = box
    z = _noise(rng, (channels, h, w)).transpose(1, 2, 0)
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    values = np.clip(np.rint((mean + std * z) * 255.0), 0, 255).astype(np.uint8)
    image = np.array(image)  # a copy: the crop may be a view of a cache
    image[top:top + h, left:left + w] = values
    return image
