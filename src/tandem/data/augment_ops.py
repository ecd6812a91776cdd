"""RandAugment's and TrivialAugment's image operations on Pillow images, and their magnitudes.

timm's ``_RAND_TRANSFORMS`` and torchvision's ``TrivialAugmentWide`` space (31 bins); each
table's level functions turn a magnitude into the argument. Geometric ones fill with the mean
colour. Posterize and solarize are lookup tables: 0 bits gives black, which Pillow refuses.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from PIL import Image, ImageEnhance, ImageOps

RAND_MAX = 10.0  # timm's _LEVEL_DENOM: RandAugment's M runs from 0 to this
WIDE_BINS = 31  # TrivialAugment's magnitude bins: 0 to 30


# -- colour: no argument, or one number ----------------------------------------------------
auto_contrast, equalize, invert = ImageOps.autocontrast, ImageOps.equalize, ImageOps.invert


def identity(img: Image.Image) -> Image.Image:
    return img


def _table(img: Image.Image, lut: list[int]) -> Image.Image:
    return img.point(lut * len(img.getbands()))


def posterize(img: Image.Image, bits: int) -> Image.Image:
    """Keep the ``bits`` most significant bits of each value (0 bits: black; 8: unchanged)."""
    if bits >= 8:
        return img
    mask = (0xFF << (8 - max(bits, 0))) & 0xFF
    return _table(img, [v & mask for v in range(256)])


def solarize(img: Image.Image, threshold: float) -> Image.Image:
    """Values at or above ``threshold`` inverted (``255 - v``)."""
    return _table(img, [v if v < threshold else 255 - v for v in range(256)])


def solarize_add(img: Image.Image, add: int, threshold: int = 128) -> Image.Image:
    """``add`` added (to at most 255) to the values below ``threshold``."""
    return _table(img, [min(255, v + add) if v < threshold else v for v in range(256)])


def _enhancer(kind) -> Callable[[Image.Image, float], Image.Image]:
    """``kind``'s blend by ``factor``: 0 grey, flat, black or smooth; 1 unchanged."""
    return lambda img, factor: kind(img).enhance(factor)


color, contrast, brightness, sharpness = (_enhancer(kind) for kind in (
    ImageEnhance.Color, ImageEnhance.Contrast, ImageEnhance.Brightness, ImageEnhance.Sharpness))


# -- geometry: an affine map, resampled, the uncovered area filled --------------------------
def _affine(img: Image.Image, matrix, resample, fill) -> Image.Image:
    """Output pixel ``(x, y)`` shows input ``(a x + b y + c, d x + e y + f)``."""
    return img.transform(img.size, Image.Transform.AFFINE, matrix, resample=resample,
                         fillcolor=fill)


def shear_x(img: Image.Image, factor: float, resample, fill) -> Image.Image:
    return _affine(img, (1, factor, 0, 0, 1, 0), resample, fill)


def shear_y(img: Image.Image, factor: float, resample, fill) -> Image.Image:
    return _affine(img, (1, 0, 0, factor, 1, 0), resample, fill)


def translate_x(img: Image.Image, pixels: float, resample, fill) -> Image.Image:
    """Content moves ``pixels`` to the left (right when negative)."""
    return _affine(img, (1, 0, pixels, 0, 1, 0), resample, fill)


def translate_y(img: Image.Image, pixels: float, resample, fill) -> Image.Image:
    """Content moves ``pixels`` up (down when negative)."""
    return _affine(img, (1, 0, 0, 0, 1, pixels), resample, fill)


def rotate(img: Image.Image, degrees: float, resample, fill) -> Image.Image:
    """Counter-clockwise about the centre (Pillow's ``rotate``, same size)."""
    return img.rotate(degrees, resample=resample, fillcolor=fill)


class Op(NamedTuple):
    """A policy's operation: its function, ``level(m, width, height)`` (its argument; None:
    none), whether that is negated half the time, whether it takes a filter and a fill."""

    fn: Callable
    level: Callable | None = None
    signed: bool = False
    geometric: bool = False


def _enhance_rand(m, w, h):
    return m / RAND_MAX * 1.8 + 0.1


# timm's _RAND_TRANSFORMS, with its level functions (magnitude m in [0, RAND_MAX])
RAND_OPS: dict[str, Op] = {
    "AutoContrast": Op(auto_contrast),
    "Equalize": Op(equalize),
    "Invert": Op(invert),
    "Rotate": Op(rotate, lambda m, w, h: m / RAND_MAX * 30.0, True, True),
    "Posterize": Op(posterize, lambda m, w, h: int(m / RAND_MAX * 4)),
    "Solarize": Op(solarize, lambda m, w, h: int(m / RAND_MAX * 256)),
    "SolarizeAdd": Op(solarize_add, lambda m, w, h: int(m / RAND_MAX * 110)),
    "Color": Op(color, _enhance_rand),
    "Contrast": Op(contrast, _enhance_rand),
    "Brightness": Op(brightness, _enhance_rand),
    "Sharpness": Op(sharpness, _enhance_rand),
    "ShearX": Op(shear_x, lambda m, w, h: m / RAND_MAX * 0.3, True, True),
    "ShearY": Op(shear_y, lambda m, w, h: m / RAND_MAX * 0.3, True, True),
    "TranslateXRel": Op(translate_x, lambda m, w, h: m / RAND_MAX * 0.45 * w, True, True),
    "TranslateYRel": Op(translate_y, lambda m, w, h: m / RAND_MAX * 0.45 * h, True, True),
}

_TOP = WIDE_BINS - 1


def _enhance_wide(b, w, h):
    return 0.99 * b / _TOP  # the factor is 1 plus or minus this


def _plus_one(fn):
    """An enhancement whose signed argument ``s`` is taken as the factor ``1 + s``."""
    return lambda img, s: fn(img, 1.0 + s)


# TrivialAugment Wide (the magnitude is a bin b in 0..30)
WIDE_OPS: dict[str, Op] = {
    "Identity": Op(identity),
    "ShearX": Op(shear_x, lambda b, w, h: 0.99 * b / _TOP, True, True),
    "ShearY": Op(shear_y, lambda b, w, h: 0.99 * b / _TOP, True, True),
    "TranslateX": Op(translate_x, lambda b, w, h: 32.0 * b / _TOP, True, True),
    "TranslateY": Op(translate_y, lambda b, w, h: 32.0 * b / _TOP, True, True),
    "Rotate": Op(rotate, lambda b, w, h: 135.0 * b / _TOP, True, True),
    "Brightness": Op(_plus_one(brightness), _enhance_wide, True),
    "Color": Op(_plus_one(color), _enhance_wide, True),
    "Contrast": Op(_plus_one(contrast), _enhance_wide, True),
    "Sharpness": Op(_plus_one(sharpness), _enhance_wide, True),
    "Posterize": Op(posterize, lambda b, w, h: 8 - round(b / (_TOP / 6))),
    "Solarize": Op(solarize, lambda b, w, h: 255.0 * (1 - b / _TOP)),
    "AutoContrast": Op(auto_contrast),
    "Equalize": Op(equalize),
}
