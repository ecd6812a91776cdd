"""Random erasing as timm's ``RandomErasing`` (``--remode pixel --recount 1``), each draw from
the sample's own :class:`SampleRandom`: one box of per-pixel normal noise of the normalised image.

A ``uint8`` data set erases with the noise taken back through its normalisation
(:func:`erase_pixels`): clipped beyond about two standard deviations, quantised to 1/255.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .transforms import SampleRandom

AREA = (0.02, 1 / 3)
ASPECT = (0.3, 1 / 0.3)
TRIES = 10


def erase_box(height: int, width: int, prob: float, rng: SampleRandom
              ) -> tuple[int, int, int, int] | None:
    """``(top, left, h, w)`` of the box to erase (up to :data:`TRIES` of an :data:`AREA` and
    an :data:`ASPECT`), or None."""
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
    (a new array when erased, ``image`` itself when not)."""
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
    """An ``(H, W, C)`` ``uint8`` image with a box of noise ``z``, with probability ``prob``,
    as the pixels ``255 (mean + std z)`` (rounded, clipped)."""
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
