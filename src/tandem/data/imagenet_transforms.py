"""ImageNet crops decoded straight to ``uint8``: RandomResizedCrop + flip, and the val crop.

The box is drawn from the sample's :class:`~tandem.data.transforms.SampleRandom`, whatever the
decoder; a training crop decodes at reduced scale where the box allows (:mod:`.decode`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .decode import decoding, open_image, open_pillow, read_bytes
from .transforms import SampleRandom, center_offset, shorter_side_size

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
TRIES = 10
VAL_RESIZE_RATIO = 256 / 224  # val: resize the shorter side to size * 256/224, crop size


def random_resized_box(width: int, height: int, rng: SampleRandom, scale=SCALE, ratio=RATIO,
                       tries: int = TRIES) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` of torchvision's RandomResizedCrop box in a ``width x
    height`` image (after ``tries`` misses, the largest centred box within ``ratio``)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(tries):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(width - w + 1)
            top = rng.randint(height - h + 1)
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:  # too tall: full width, height cut to the ratio
        w, h = width, min(height, max(1, round(width / ratio[0])))
    elif in_ratio > ratio[1]:  # too wide
        w, h = min(width, max(1, round(height * ratio[1]))), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def val_resize(size: int) -> int:
    """The shorter side the val transform resizes to before its centre crop (256 for 224)."""
    return max(size, round(size * VAL_RESIZE_RATIO))


def resized_crop(image: np.ndarray, box, scale: float, size: int, flip: bool) -> np.ndarray:
    """``box`` (full-scale pixels) of ``image`` (decoded at ``1/scale``) resampled bilinearly
    to an ``(S, S, 3)`` uint8 crop, flipped if ``flip``: at full scale by torch's uint8 kernel
    (within 1 of Pillow's, a fifth of its time), at reduced scale (fractional corners) by Pillow."""
    if scale == 1:
        left, top, right, bottom = box
        crop = torch.from_numpy(image[top:bottom, left:right]).permute(2, 0, 1)[None]
        crop = crop.contiguous(memory_format=torch.channels_last)  # the kernel's fast layout
        out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True,
                            align_corners=False)  # (1, 3, S, S), channels-last
        if flip:
            out = out.flip(3)
        return out[0].permute(1, 2, 0).numpy()  # (S, S, 3) with contiguous strides
    out = Image.fromarray(image).resize((size, size), Image.BILINEAR,
                                        box=tuple(c / scale for c in box))
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.array(out)  # a writable (S, S, 3) uint8 copy


def train_crop(path, size: int, rng: SampleRandom, decoder: str | None = None) -> np.ndarray:
    """RandomResizedCrop to ``size x size``, then a flip with probability 1/2."""
    img = open_image(path, decoder)
    box, flip = train_draws(img.width, img.height, rng)
    return decode_crop(img, box, size, flip)


def train_draws(width: int, height: int, rng: SampleRandom) -> tuple[tuple, bool]:
    """The training crop's draws, in order: the box, then the flip (``--decode gpu`` too)."""
    box = random_resized_box(width, height, rng)
    return box, rng.coin()


def decode_crop(img, box, size: int, flip: bool) -> np.ndarray:
    """``box`` of the opened image ``img`` as an ``(S, S, 3)`` uint8 crop."""
    image, scale = img.decode(box, size, size)
    return resized_crop(image, box, scale, size, flip)


def val_crop(path, size: int, resize_to: int | None = None) -> np.ndarray:
    """torchvision's ``Resize(resize_to)`` then ``CenterCrop(size)``, pixel for pixel, so
    validation accuracy is the imagenet example's (no reduced-scale decode: other pixels)."""
    with decoding(path):  # the decode; what follows works on pixels in memory
        img = open_pillow(read_bytes(path), path)
        img.load()
    # torchvision's loader converts to RGB first; "L" resized then converted is the same.
    full = img if img.mode in ("RGB", "L") else img.convert("RGB")
    resized, box = val_geometry(full.width, full.height, size, resize_to)
    full = full.resize(resized, Image.BILINEAR)
    if full.mode != "RGB":
        full = full.convert("RGB")
    return np.array(full.crop(box))


def val_geometry(width: int, height: int, size: int, resize_to: int | None = None
                 ) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """:func:`val_crop`'s resized ``(w, h)`` and its centre box ``(left, top, right, bottom)``."""
    resize_to = val_resize(size) if resize_to is None else resize_to
    new_w, new_h = shorter_side_size(width, height, resize_to)
    left, top = center_offset(new_w, size), center_offset(new_h, size)
    return (new_w, new_h), (left, top, left + size, top + size)
