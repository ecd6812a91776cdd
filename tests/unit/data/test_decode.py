"""simplejpeg's training crops against Pillow's (the fallback decoder): the same boxes and flips,
pixels within stated bounds, at full and reduced DCT scale; the fallbacks to Pillow (non-JPEG,
CMYK, no simplejpeg) and corrupt files under both decoders."""

import numpy as np
import pytest
from PIL import Image

from tandem.data import decode
from tandem.data.decode import PillowImage, SimpleJpegImage, UnreadableImage, open_image, reduction
from tandem.data.imagenet_transforms import random_resized_box, train_crop
from tandem.data.transforms import SampleRandom

needs_simplejpeg = pytest.mark.skipif(decode.simplejpeg is None, reason="simplejpeg not installed")

# Bounds on |simplejpeg crop - Pillow crop| per pixel, uint8 levels: both run libjpeg-turbo's
# default (islow) IDCT and fancy upsampling, so the decodes agree but for rounding, and the
# resample is the same torch call. Measured here: identical (0 and 0); the bounds leave room for
# the two wheels bundling different libjpeg-turbo builds.
MEAN_BOUND, MAX_BOUND = 0.5, 8


def photo(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (9 + 5 * c) + y / (13 + 3 * c) + seed) for c in range(3)], -1)
    return Image.fromarray(np.clip(128 + 90 * base + rng.normal(0, 12, base.shape), 0, 255)
                           .astype(np.uint8))


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    paths = []
    kinds = [((500, 375), "RGB", {}), ((375, 500), "RGB", {"progressive": True}),
             ((333, 250), "RGB", {"subsampling": "4:4:4"}), ((1024, 768), "RGB", {}),
             ((300, 280), "L", {})]
    for i, ((w, h), mode, options) in enumerate(kinds):
        paths.append(root / f"{i}.jpg")
        photo(w, h, i).convert(mode).save(paths[-1], quality=90, **options)
    return paths


@needs_simplejpeg
@pytest.mark.parametrize("size", [224, 64])  # 64: most boxes are decoded at reduced scale
def test_simplejpeg_and_pillow_crops_agree(jpegs, size):
    """Baseline 4:2:0, progressive, 4:4:4, large, and greyscale JPEGs."""
    scales = set()
    for path in jpegs:
        assert isinstance(open_image(path, "simplejpeg"), SimpleJpegImage)  # no fallback
        for index in range(12):
            draws = {}
            for decoder in ("simplejpeg", "pillow"):
                img = open_image(path, decoder)
                rng = SampleRandom(3, 1, index)
                box = random_resized_box(img.width, img.height, rng)
                draws[decoder] = box, rng.coin(), img.decode(box, size, size)[1]
            assert draws["simplejpeg"] == draws["pillow"]  # box, flip, decode scale
            scales.add(draws["pillow"][2])
            a, b = (train_crop(path, size, SampleRandom(3, 1, index), decoder).astype(int)
                    for decoder in ("simplejpeg", "pillow"))
            diff = np.abs(a - b)
            assert diff.mean() < MEAN_BOUND and diff.max() <= MAX_BOUND, (path, index)
    assert 1 in scales and (size == 224 or len(scales) > 1)  # both paths ran


def test_reduction_is_pillows_draft_rule():
    assert reduction(500, 375, (0, 0, 500, 375), 224, 224) == 1  # 375 < 448
    assert reduction(1024, 768, (0, 0, 1000, 700), 224, 224) == 2
    assert reduction(1024, 768, (0, 0, 1000, 700), 64, 64) == 8
    assert reduction(1024, 768, (0, 0, 300, 700), 64, 64) == 4


@needs_simplejpeg
def test_non_jpeg_and_cmyk_fall_back_to_pillow(tmp_path):
    photo(40, 30, 0).save(tmp_path / "a.png")
    photo(40, 30, 0).convert("CMYK").save(tmp_path / "c.jpg")
    photo(40, 30, 0).save(tmp_path / "r.jpg")
    assert isinstance(open_image(tmp_path / "a.png", "simplejpeg"), PillowImage)
    assert isinstance(open_image(tmp_path / "c.jpg", "simplejpeg"), PillowImage)
    assert isinstance(open_image(tmp_path / "r.jpg", "simplejpeg"), SimpleJpegImage)
    assert isinstance(open_image(tmp_path / "r.jpg", "pillow"), PillowImage)


def test_without_simplejpeg_pillow_decodes_everything(tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "simplejpeg", None)
    photo(40, 30, 0).save(tmp_path / "r.jpg")
    assert decode.default_decoder() == "pillow"
    assert isinstance(open_image(tmp_path / "r.jpg"), PillowImage)
    with pytest.raises(ImportError, match="simplejpeg"):
        open_image(tmp_path / "r.jpg", "simplejpeg")
    with pytest.raises(ValueError, match="decoder must be one of"):
        open_image(tmp_path / "r.jpg", "turbo")


@pytest.mark.parametrize("decoder", ["pillow", pytest.param("simplejpeg", marks=needs_simplejpeg)])
@pytest.mark.parametrize("cut", ["pixels", "header"])
def test_a_cut_jpeg_raises_under_either_decoder(tmp_path, decoder, cut):
    path = tmp_path / "x.jpg"
    photo(200, 150, 1).save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if cut == "pixels" else data[:40])
    # the one error the dataset takes for a bad file (and substitutes the next for), named
    with pytest.raises(UnreadableImage, match="x.jpg"):
        train_crop(path, 16, SampleRandom(0, 0, 0), decoder)
