"""The image operations of RandAugment and TrivialAugment, on Pillow images, and their
magnitudes.

The operations are timm's (``timm/data/auto_augment.py``, its ``_RAND_TRANSFORMS``: the 14 of
Cubuk et al. 2020, RandAugment, arXiv 1909.13719, less identity, with invert and solarize-add):
Pillow's ``ImageOps`` and ``ImageEnhance``, and affine maps whose uncovered area takes
``fill``, the data's mean colour (timm's ``img_mean``). Each takes the image and its argument;
a geometric one also the resampling filter and the fill. Posterize and solarize run as lookup
tables written here, so that 0 bits (timm's level below 2.5) gives black, as TensorFlow's
posterize does, where Pillow's own refuses it.

Magnitudes, as timm's RandAugment (``rand-mM-nN``, ``_LEVEL_DENOM`` 10) maps its ``M`` in
``[0, 10]``: rotate ``30 M/10`` degrees, shear ``0.3 M/10``, translate ``0.45 M/10`` of the
side, the four enhancements a factor ``1.8 M/10 + 0.1``, posterize ``int(4 M/10)`` bits kept,
solarize at ``int(256 M/10)``, solarize-add ``int(110 M/10)`` below 128 (the signed ones
negated half the time). TrivialAugment's "wide" space (Müller and Hutter 2021, arXiv
2103.10158, Table 1; torchvision's ``TrivialAugmentWide``, 31 bins): rotate to 135 degrees,
shear to 0.99, translate to 32 pixels, enhancements ``1 ± 0.99``, posterize 8 down to 2 bits,
solarize 255 down to 0.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from PIL import Image, ImageEnhance, ImageOps

__all__ = ["Op", "RAND_OPS", "WIDE_OPS", "WIDE_BINS", "RAND_MAX", "auto_contrast", "equalize",
           "invert", "rotate", "posterize", "solarize", "solarize_add", "color", "contrast",
           "brightness", "sharpness", "shear_x", "shear_y", "translate_x", "translate_y",
           "identity"]

RAND_MAX = 10.0  # timm's _LEVEL_DENOM: RandAugment's M runs from 0 to this
WIDE_BINS = 31  # TrivialAugment's magnitude bins: 0 to 30


# -- colour: no argument, or one number ----------------------------------------------------
def identity(img: Image.Image) -> Image.Image:
    return img


def auto_contrast(img: Image.Image) -> Image.Image:
    """Each channel stretched to 0..255 (Pillow's ``autocontrast``)."""
    return ImageOps.autocontrast(img)


def equalize(img: Image.Image) -> Image.Image:
    """Each channel's histogram equalised (Pillow's ``equalize``)."""
    return ImageOps.equalize(img)


def invert(img: Image.Image) -> Image.Image:
    """``255 - v``."""
    return ImageOps.invert(img)


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


def color(img: Image.Image, factor: float) -> Image.Image:
    """Saturation: 0 grey, 1 unchanged (``ImageEnhance.Color``)."""
    return ImageEnhance.Color(img).enhance(factor)


def contrast(img: Image.Image, factor: float) -> Image.Image:
    """Blend with the mean grey: 0 flat, 1 unchanged (``ImageEnhance.Contrast``)."""
    return ImageEnhance.Contrast(img).enhance(factor)


def brightness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with black: 0 black, 1 unchanged (``ImageEnhance.Brightness``)."""
    return ImageEnhance.Brightness(img).enhance(factor)


def sharpness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with a smoothed copy: 0 smooth, 1 unchanged (``ImageEnhance.Sharpness``)."""
    return ImageEnhance.Sharpness(img).enhance(factor)


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
    """One operation of a policy: its function, the argument a magnitude gives it
    (``level(m, width, height)``; None: it takes none), whether that argument is negated half
    the time, and whether it is geometric (takes a filter and a fill)."""

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
