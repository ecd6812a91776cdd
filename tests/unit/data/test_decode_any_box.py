"""Reduced-scale JPEG decodes (simplejpeg's scaled decode, Pillow's ``draft``) against a full-size
decode of the same file: for any image size, crop box and output size, neither decoder raises,
and the crop agrees with the full-size one within the decoder parity test's bounds."""

import io

import numpy as np
import pytest
from hypothesis import event, example, given, settings, strategies as st
from PIL import Image

from tandem.data.decode import open_image, reduction, simplejpeg
from tandem.data.imagenet_transforms import decode_crop, random_resized_box, resized_crop
from tandem.data.transforms import SampleRandom

from test_decode import MAX_BOUND, MEAN_BOUND

DECODERS_HERE = ["pillow"] + (["simplejpeg"] if simplejpeg is not None else [])
MAX_AREA = 2**19  # pixels per image: sides up to 4096, kept cheap to encode and decode


def smooth_jpeg(w: int, h: int, period: float, seed: int, quality: int = 95) -> bytes:
    """A JPEG of two colour waves with periods of ``period`` to ``2 * period`` pixels at
    random angles. A decode at 1/k keeps only what varies over more than k pixels, so the
    property compares on content of that kind (``period`` = 32k)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    pixels = np.full((h, w, 3), 128, np.float32)
    for _ in range(2):
        angle, p = rng.uniform(0, 2 * np.pi), period * rng.uniform(1, 2)
        wave = np.sin(2 * np.pi * (x * np.cos(angle) + y * np.sin(angle)) / p
                      + rng.uniform(0, 2 * np.pi))
        pixels += 30 * wave[..., None] * rng.uniform(-1, 1, 3).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@st.composite
def crops(draw):
    """``(width, height, box, out, flip)``: a box as tandem's RandomResizedCrop draws it, or
    any box touching the left or right border (the whole image among them); two outputs in three
    small enough for the box to allow a reduced decode."""
    w = draw(st.integers(1, 4096) | st.integers(128, 4096))  # hypothesis favours small ints
    cap = min(4096, MAX_AREA // w)
    h = draw(st.integers(1, cap) | st.integers(min(128, cap), cap))
    if draw(st.booleans()):
        rng = SampleRandom(draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 99)),
                           draw(st.integers(0, 10**6)))
        box = random_resized_box(w, h, rng)
    else:
        bw, bh = draw(st.integers(1, w)), draw(st.integers(1, h))
        left = draw(st.sampled_from([0, w - bw]))
        top = draw(st.sampled_from([0, h - bh]) | st.integers(0, h - bh))
        box = (left, top, left + bw, top + bh)
    if draw(st.integers(0, 2)) == 0:
        out = draw(st.integers(8, 512))
    else:  # a fraction of the box's shorter side: mostly a reduced decode
        out = max(8, min(box[2] - box[0], box[3] - box[1]) // draw(st.integers(2, 24)))
    return w, h, box, out, draw(st.booleans())


@settings(max_examples=80, deadline=None, derandomize=True)
@given(crops())
@example((500, 375, (0, 0, 500, 375), 32, False))  # issue 36: refused at 1/8
@example((500, 375, (13, 120, 396, 375), 24, True))
@example((501, 377, (1, 1, 501, 377), 8, False))
@example((4096, 128, (3968, 0, 4096, 128), 8, False))
def test_reduced_decode_never_refuses_and_matches_a_full_decode(case):
    """Both decoders give the crop, the same as cutting it from a full-size decode within
    the parity bounds; derandomized, so that a tolerance test gives the same verdict on
    every run."""
    w, h, box, out, flip = case
    k = reduction(w, h, box, out, out)
    event(f"decoded at 1/{k}")
    data = smooth_jpeg(w, h, 32 * k, seed=w * 4099 + h)
    full = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    expect = resized_crop(full, box, 1, out, flip).astype(int)
    for decoder in DECODERS_HERE:
        image, scale = open_image(io.BytesIO(data), decoder).decode(box, out, out)
        assert scale == k, decoder  # the reduced path did run where the box allows it
        got = resized_crop(image, box, scale, out, flip)  # what decode_crop does
        assert got.shape == (out, out, 3) and got.dtype == np.uint8
        diff = np.abs(got.astype(int) - expect)
        # an 8x8 crop's mean over 192 values swings more than a large one's (seen: 0.505 at
        # 1/2 on this avx2 EPYC), so crops under 32 px get half as much again
        mean_bound = MEAN_BOUND if out >= 32 else 1.5 * MEAN_BOUND
        assert diff.mean() < mean_bound and diff.max() <= MAX_BOUND, (decoder, k)


def test_a_1_8_decode_maps_boxes_by_8_on_both_axes():
    """500x375 decodes at 1/8 to 63x47, which 500/63 = 7.94 (the old divisor, from the width)
    would overshoot at the bottom: a box's corners are at x/8 and y/8."""
    data = smooth_jpeg(500, 375, 256, seed=1)
    for decoder in DECODERS_HERE:
        image, scale = open_image(io.BytesIO(data), decoder).decode((0, 0, 500, 375), 32, 32)
        assert image.shape == (47, 63, 3) and scale == 8


@pytest.mark.skipif(simplejpeg is None, reason="simplejpeg not installed")
def test_images_under_one_dct_block_decode_whole_under_both_decoders():
    """Under 8 pixels both ways libjpeg-turbo's N/8 scales give equal sizes (3x3 is 2x2 at 1/2
    and at 3/8), so a scale picked by size is ambiguous: such images decode at full size,
    and the two decoders agree, even for outputs of 1 to 3 pixels."""
    rng = np.random.default_rng(0)
    for w in range(1, 8):
        for h in range(1, 8):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
            for out in (1, 2, 3):
                crops = [decode_crop(open_image(io.BytesIO(buf.getvalue()), decoder),
                                     (0, 0, w, h), out, False).astype(int)
                         for decoder in ("simplejpeg", "pillow")]
                assert np.abs(crops[0] - crops[1]).max() <= MAX_BOUND, (w, h, out)
