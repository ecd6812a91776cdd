"""ImageNet-style crops decoded straight to ``uint8``: RandomResizedCrop + flip, and the val crop.

The crop box is drawn from a :class:`~tandem.data.transforms.SampleRandom` keyed by the sample,
so it does not depend on worker, rank or strategy. Training crops decode only what is needed:
JPEGs are decoded at reduced scale when the crop allows (Pillow's ``draft``) and only the box is
resampled. The val crop is torchvision's ``Resize`` + ``CenterCrop``, pixel for pixel. Float
conversion happens on the device.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError

from .transforms import SampleRandom, center_offset, shorter_side_size

__all__ = ["SCALE", "RATIO", "TRIES", "VAL_RESIZE_RATIO", "random_resized_box", "val_resize",
           "train_crop", "val_crop", "resize_box"]

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
TRIES = 10
VAL_RESIZE_RATIO = 256 / 224  # val: resize the shorter side to size * 256/224, crop size


def random_resized_box(width: int, height: int, rng: SampleRandom, scale=SCALE, ratio=RATIO,
                       tries: int = TRIES) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` of a random crop inside a ``width x height`` image.

    Each try draws an area fraction uniformly from ``scale`` and an aspect ratio (w/h)
    log-uniformly from ``ratio``; the first box that fits is placed uniformly at random.
    After ``tries`` misses, the largest centred box whose ratio lies in ``ratio`` is used.
    """
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


def _draft(img: Image.Image, box, out_w: int, out_h: int):
    """Ask libjpeg to decode at the smallest 1/2^k scale that still leaves the box at least
    ``out_w x out_h``; returns the box in the (maybe reduced) image's coordinates."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if img.format != "JPEG" or bw < 2 * out_w or bh < 2 * out_h:
        return box
    width, height = img.size
    # draft picks s <= min(width // req_w, height // req_h) <= min(bw / out_w, bh / out_h)
    request = (math.ceil(width * out_w / bw), math.ceil(height * out_h / bh))
    result = img.draft(None, request)
    if result is None:
        return box
    s = width / result[1][2]  # result[1] is the whole image's box at the reduced scale
    return tuple(c / s for c in box)


def resize_box(img: Image.Image, box, out_w: int, out_h: int) -> Image.Image:
    """Decode (drafting a JPEG when it can) and resample ``box`` to ``out_w x out_h`` RGB."""
    box = _draft(img, box, out_w, out_h)
    if img.mode not in ("RGB", "L", "CMYK"):  # palette, alpha, 16-bit...: to RGB first
        img = img.convert("RGB")
    out = img.resize((out_w, out_h), Image.BILINEAR, box=box)
    return out if out.mode == "RGB" else out.convert("RGB")


def _open(path) -> Image.Image:
    """Open ``path`` from one read into memory, to be decoded in one call.

    Pillow then parses from a buffer rather than through many small file reads, and hands the
    decoder the whole file at once instead of 64 KB blocks, so libjpeg never suspends and
    resumes mid-scan (each saves about 5% of a JPEG's decode). A file object is opened as is.
    Not an image: Pillow's ``UnidentifiedImageError``, naming ``path`` (not the buffer).
    """
    if hasattr(path, "read"):
        return Image.open(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"cannot identify image file '{path}'") from None
    img.decodermaxblock = max(len(data), img.decodermaxblock)  # bytes per decoder call
    return img


def _array(img: Image.Image) -> np.ndarray:
    return np.array(img)  # a writable (H, W, 3) uint8 copy


def train_crop(path, size: int, rng: SampleRandom) -> np.ndarray:
    """RandomResizedCrop to ``size x size`` then a horizontal flip with probability 1/2."""
    with _open(path) as img:
        box = random_resized_box(img.width, img.height, rng)
        flip = rng.coin()
        out = resize_box(img, box, size, size)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _array(out)


def val_crop(path, size: int, resize_to: int | None = None) -> np.ndarray:
    """torchvision's ``Resize(resize_to)`` then ``CenterCrop(size)`` (``resize_to`` defaults
    to :func:`val_resize`), pixel for pixel: the shorter side to ``resize_to``, the longer to
    ``int(resize_to * long / short)``, bilinear over the whole decoded image, then the crop at
    ``int(round(excess / 2.0))``. Validation accuracy is then the imagenet example's for the
    same weights, so no ``draft`` here: a reduced-scale decode gives other pixels (and at 224 px
    it applies only to photos with a shorter side of 512 or more)."""
    resize_to = val_resize(size) if resize_to is None else resize_to
    with _open(path) as img:
        # torchvision's loader converts to RGB first; "L" resized then converted is the same.
        full = img if img.mode in ("RGB", "L") else img.convert("RGB")
        new_w, new_h = shorter_side_size(full.width, full.height, resize_to)
        full = full.resize((new_w, new_h), Image.BILINEAR)
    if full.mode != "RGB":
        full = full.convert("RGB")
    left, top = center_offset(new_w, size), center_offset(new_h, size)
    return _array(full.crop((left, top, left + size, top + size)))
