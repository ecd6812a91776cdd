"""Each RandAugment / TrivialAugment operation against a case computed by hand on a few pixels,
and the magnitude tables against timm's RandAugment levels and TrivialAugment Wide's bins."""

import numpy as np
import pytest
from PIL import Image

from tandem.data import augment_ops as ops
from tandem.data.augment_ops import RAND_OPS, WIDE_OPS

NEAREST, BILINEAR = Image.Resampling.NEAREST, Image.Resampling.BILINEAR


def grey(rows) -> Image.Image:
    return Image.fromarray(np.array(rows, dtype=np.uint8))


def pixels(img: Image.Image) -> list:
    return np.array(img).tolist()


GRID = [[0, 10, 20], [30, 40, 50], [60, 70, 80]]  # pixel (x, y) holds 10 (3 y + x)


def test_colour_operations_by_hand():
    # the range 10..40 stretched to 0..255: (v - 10) * 255 / 30
    assert pixels(ops.auto_contrast(grey([[10, 20], [30, 40]]))) == [[0, 85], [170, 255]]
    assert pixels(ops.invert(grey([[0, 55, 255]]))) == [[255, 200, 0]]
    # keep the 2 top bits (mask 0xC0); 0 bits is black, 8 unchanged
    assert pixels(ops.posterize(grey([[200, 63, 64, 255]]), 2)) == [[192, 0, 64, 192]]
    assert pixels(ops.posterize(grey([[200, 63]]), 0)) == [[0, 0]]
    assert pixels(ops.posterize(grey([[200, 63]]), 8)) == [[200, 63]]
    # at or above the threshold, 255 - v
    assert pixels(ops.solarize(grey([[100, 127, 128, 200]]), 128)) == [[100, 127, 127, 55]]
    assert pixels(ops.solarize(grey([[0, 255]]), 256)) == [[0, 255]]
    # below the threshold, v + add (at most 255)
    assert pixels(ops.solarize_add(grey([[100, 127, 128, 250]]), 50)) == [[150, 177, 128, 250]]
    assert pixels(ops.solarize_add(grey([[120]]), 200)) == [[255]]


def test_equalize_by_hand():
    """Pillow's equalize on 256 pixels: 128 at 0, 127 at 100, one at 200. Its step is
    (256 - 1) // 255 = 1 pixel, so a value maps to the count of pixels below it: 0 -> 0,
    100 -> 128, 200 -> 255."""
    img = np.zeros((16, 16), np.uint8)
    img.flat[128:255], img.flat[255] = 100, 200
    out = np.array(ops.equalize(Image.fromarray(img)))
    assert out.flat[0] == 0 and set(out.flat[128:255]) == {128} and out.flat[255] == 255


def test_enhancements_by_hand():
    # brightness: a blend with black, v * factor (clipped)
    assert pixels(ops.brightness(grey([[100, 200]]), 0.5)) == [[50, 100]]
    assert pixels(ops.brightness(grey([[100, 200]]), 1.5)) == [[150, 255]]
    # contrast: a blend with the image's mean grey (100): 100 + factor (v - 100)
    assert pixels(ops.contrast(grey([[0, 100], [100, 200]]), 0.0)) == [[100, 100], [100, 100]]
    assert pixels(ops.contrast(grey([[0, 100], [100, 200]]), 2.0)) == [[0, 100], [100, 255]]
    # colour: a blend with the grey of each pixel, L = (19595 R + 38470 G + 7471 B) >> 16
    red = Image.fromarray(np.array([[[255, 0, 0]]], np.uint8))
    assert np.array(ops.color(red, 0.0)).tolist() == [[[76, 76, 76]]]
    assert np.array(ops.color(red, 1.0)).tolist() == [[[255, 0, 0]]]
    # sharpness 0: Pillow's SMOOTH (1 1 1 / 1 5 1 / 1 1 1, over 13) inside the border
    spike = np.zeros((5, 5), np.uint8)
    spike[2, 2] = 130
    smooth = np.array(ops.sharpness(Image.fromarray(spike), 0.0))
    assert smooth[2, 2] == 50 and smooth[1, 1] == smooth[1, 2] == smooth[3, 2] == 10
    assert smooth[0].tolist() == [0] * 5


def test_geometry_by_hand():
    """Pillow samples pixel centres: output (x, y) shows input (x + 1/2 + b (y + 1/2) + c,
    ...) taken to its pixel; the uncovered pixels take the fill (255 here)."""
    img = grey(GRID)
    assert pixels(ops.translate_x(img, 1, NEAREST, 255)) == [[10, 20, 255], [40, 50, 255],
                                                             [70, 80, 255]]
    assert pixels(ops.translate_x(img, -1, BILINEAR, 255)) == [[255, 0, 10], [255, 30, 40],
                                                               [255, 60, 70]]
    assert pixels(ops.translate_y(img, 1, NEAREST, 255)) == [[30, 40, 50], [60, 70, 80],
                                                             [255, 255, 255]]
    # shear 1: row y reads from x + y + 1; shear 0.5: row 0 from x (x + 0.75), rows 1, 2 from
    # x + 1 (x + 1.25, x + 1.75)
    assert pixels(ops.shear_x(img, 1.0, NEAREST, 255)) == [[10, 20, 255], [50, 255, 255],
                                                           [255, 255, 255]]
    assert pixels(ops.shear_x(img, 0.5, NEAREST, 255)) == [[0, 10, 20], [40, 50, 255],
                                                           [70, 80, 255]]
    assert pixels(ops.shear_y(img, 1.0, NEAREST, 255)) == [[30, 70, 255], [60, 255, 255],
                                                           [255, 255, 255]]
    # 90 degrees counter-clockwise: the right column becomes the top row
    assert pixels(ops.rotate(img, 90, NEAREST, 255)) == [[20, 50, 80], [10, 40, 70],
                                                         [0, 30, 60]]
    rgb = Image.fromarray(np.zeros((2, 2, 3), np.uint8))
    assert np.array(ops.translate_x(rgb, 1, NEAREST, (1, 2, 3)))[0, 1].tolist() == [1, 2, 3]


def test_randaugment_levels_are_timms():
    """timm's _LEVEL_DENOM 10: at M = 10 and 5 (an 8 x 6 image)."""
    def level(name, m):
        return RAND_OPS[name].level(m, 8, 6)
    assert level("Rotate", 10) == 30 and level("Rotate", 5) == 15
    assert level("ShearX", 10) == pytest.approx(0.3)
    assert level("TranslateXRel", 10) == pytest.approx(0.45 * 8)
    assert level("TranslateYRel", 5) == pytest.approx(0.225 * 6)
    assert level("Color", 10) == pytest.approx(1.9) and level("Contrast", 0) == pytest.approx(0.1)
    assert level("Posterize", 10) == 4 and level("Posterize", 9) == 3 and level("Posterize", 2) == 0
    assert level("Solarize", 10) == 256 and level("Solarize", 5) == 128
    assert level("SolarizeAdd", 10) == 110 and level("SolarizeAdd", 9) == 99
    assert {n for n, op in RAND_OPS.items() if op.signed} == {
        "Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"}
    assert len(RAND_OPS) == 15 and "Identity" not in RAND_OPS


def test_trivialaugment_bins_are_the_wide_space():
    def level(name, b):
        return WIDE_OPS[name].level(b, 8, 6)
    assert [level("Posterize", b) for b in (0, 5, 15, 30)] == [8, 7, 5, 2]
    assert level("Solarize", 0) == 255 and level("Solarize", 30) == 0
    assert level("Rotate", 30) == 135 and level("ShearY", 30) == pytest.approx(0.99)
    assert level("TranslateX", 30) == 32 and level("TranslateY", 15) == 16
    assert level("Brightness", 30) == pytest.approx(0.99)
    # an enhancement's signed argument s is the factor 1 + s
    assert pixels(WIDE_OPS["Brightness"].fn(grey([[100]]), -0.5)) == [[50]]
    assert len(WIDE_OPS) == 14 and WIDE_OPS["Identity"].level is None
