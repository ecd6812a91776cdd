"""The ImageNet input pipeline against references written here: crop boxes against their ranges,
the val crop against torchvision's Resize + CenterCrop definitions, uint8-then-device against
float on the CPU, and loaders against each other across worker counts and ranks. No timing
here."""

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from tandem import config
from tandem.data import LoaderCache, batch_to_device, load_dataset, make_loader
from tandem.data import imagefolder
from tandem.data.imagenet_transforms import (
    RATIO, SCALE, random_resized_box, resized_crop, train_crop, val_crop, val_resize)
from tandem.data.decode import open_image, simplejpeg
from tandem.data.load import AUGMENT_FORMS
from tandem.data.transforms import SampleRandom, center_offset, shorter_side_size

S = 16  # output side in these tests
DECODERS_HERE = ["pillow"] + (["simplejpeg"] if simplejpeg is not None else [])


pytestmark = pytest.mark.usefixtures("fresh_imagefolder_warnings")


def photo(w, h, seed=0, mode="RGB"):
    """A smooth random image (JPEG-friendly) with some texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (5 + 7 * c) + y / (9 + 3 * c) + seed) for c in range(3)], -1)
    arr = np.clip(128 + 90 * base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr).convert(mode)


def write_tree(root, sizes=((40, 30), (30, 44), (64, 48), (50, 50)), per_class=3):
    for c in range(2):
        for i in range(per_class):
            w, h = sizes[(c + i) % len(sizes)]
            path = root / "train" / f"c{c}" / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            photo(w, h, seed=10 * c + i).save(path, quality=90)
        (root / "val" / f"c{c}").mkdir(parents=True, exist_ok=True)
        photo(48, 36, seed=100 + c).save(root / "val" / f"c{c}" / "v.png")
    return root


def _batches(ds, **kw):
    kw = dict(dict(shuffle=True, seed=3, epoch=1), **kw)
    return [x for x, _ in make_loader(ds, 5, **kw)]


# -- crop boxes ------------------------------------------------------------------------------

def _can_round_into(lo_val, hi_val, lo, hi):
    """True when [lo_val, hi_val] (a quantity's range over +-0.5 px rounding) meets [lo, hi]."""
    return hi_val >= lo and lo_val <= hi


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000), st.integers(0, 2**31), st.integers(0, 99))
def test_random_resized_box_inside_the_image_and_in_its_ranges(w, h, seed, index):
    left, top, right, bottom = random_resized_box(w, h, SampleRandom(seed, 0, index))
    assert 0 <= left < right <= w and 0 <= top < bottom <= h
    bw, bh = right - left, bottom - top
    # an integer box is a real-valued draw rounded to whole pixels
    assert _can_round_into((bw - .5) / (bh + .5), (bw + .5) / max(bh - .5, 1e-9), *RATIO) \
        or bw == 1 or bh == 1
    area = (bw - .5) * (bh - .5) / (w * h), (bw + .5) * (bh + .5) / (w * h)
    if RATIO[0] <= w / h <= RATIO[1]:
        assert _can_round_into(*area, *SCALE)
    elif not _can_round_into(*area, *SCALE):  # after 10 misses: the centred fallback box
        assert (bw == w and top == (h - bh) // 2) or (bh == h and left == (w - bw) // 2)


def test_random_resized_box_is_keyed_by_the_sample():
    a = [random_resized_box(500, 375, SampleRandom(1, 2, i)) for i in range(50)]
    assert a == [random_resized_box(500, 375, SampleRandom(1, 2, i)) for i in range(50)]
    assert len(set(a)) > 40  # and differs from sample to sample


@pytest.mark.parametrize("decoder", DECODERS_HERE)
def test_jpeg_draft_keeps_the_crop_where_it_was(tmp_path, decoder):
    """A big JPEG is decoded at reduced scale; the box must be rescaled to match."""
    img = photo(800, 640, seed=4)
    img.save(tmp_path / "big.jpg", quality=95)
    img.save(tmp_path / "big.png")
    box = (100, 120, 500, 440)  # >= 4x the output: decoded at 1/4
    image, scale = open_image(tmp_path / "big.jpg", decoder).decode(box, 64, 64)
    assert image.shape == (160, 200, 3) and scale == 4  # the reduced decode did apply
    drafted = resized_crop(image, box, scale, 64, False).astype(np.float32)
    image, scale = open_image(tmp_path / "big.png", decoder).decode(box, 64, 64)
    assert scale == 1
    exact = resized_crop(image, box, scale, 64, False).astype(np.float32)
    assert np.abs(drafted - exact).mean() < 4  # same content; a shifted box differs by ~40


@pytest.mark.parametrize("box", [(0, 0, 80, 60), (7, 3, 50, 41), (20, 10, 29, 22), (1, 1, 17, 17)])
@pytest.mark.parametrize("flip", [False, True])
def test_full_scale_resample_is_pillows_crop_then_resize(box, flip):
    """torch's uint8 antialiased bilinear against ``img.crop(box).resize(...)`` (torchvision's
    PIL RandomResizedCrop), down- and upsampling: within 1 per pixel (rounding)."""
    img = photo(80, 60, seed=5)
    expect = img.crop(box).resize((S, S), Image.BILINEAR)
    if flip:
        expect = expect.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out = resized_crop(np.array(img), box, 1, S, flip)
    assert out.shape == (S, S, 3) and out.dtype == np.uint8 and out.flags.writeable
    assert np.abs(out.astype(int) - np.asarray(expect, dtype=int)).max() <= 1


# -- determinism across workers, ranks and persistent loaders -------------------------------

def test_same_crops_whatever_the_workers_and_the_rank(tmp_path):
    train, _, _ = load_dataset(str(write_tree(tmp_path / "d")), image_size=S, augment="auto")
    assert train.augment == "imagenet"
    ref = _batches(train)
    for got in (_batches(train, workers=2), _batches(train, workers=1)):
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    ranks = [_batches(train, world_size=2, rank=r, workers=r) for r in range(2)]
    joined = [torch.cat(parts) for parts in zip(*ranks, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(ref, joined, strict=True))
    other_epoch = _batches(train, epoch=2)
    assert not all(torch.equal(a, b) for a, b in zip(ref, other_epoch))


def test_a_persistent_loader_gives_a_fresh_loaders_batches(tmp_path):
    train, _, _ = load_dataset(str(write_tree(tmp_path / "d")), image_size=S, augment="auto")
    cache = LoaderCache()
    for epoch, start in ((0, 0), (1, 1), (2, 0)):
        loader = cache.get(train, 5, shuffle=True, seed=3, epoch=epoch, start_batch=start,
                           workers=1)
        fresh = make_loader(train, 5, shuffle=True, seed=3, epoch=epoch, start_batch=start)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(loader, fresh, strict=True))
    assert cache.get(train, 5, shuffle=True, seed=3, epoch=0, workers=1) is loader


# -- odd inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"),
                                      ("P", "PNG"), ("RGB", "PNG"), ("LA", "PNG")])
def test_grey_cmyk_and_png_inputs_become_rgb(tmp_path, mode, fmt):
    img = photo(40, 30, seed=7, mode=mode)
    path = tmp_path / f"x.{fmt.lower()}"
    img.save(path, format=fmt)
    out = train_crop(path, S, SampleRandom(0, 0, 0))
    assert out.shape == (S, S, 3) and out.dtype == np.uint8
    if mode in ("L", "LA"):
        assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()
    # the same box cut from Pillow's own RGB conversion and resized (torchvision's PIL
    # RandomResizedCrop): equal up to JPEG/CMYK rounding and torch's against Pillow's (1)
    with Image.open(path) as src:
        rgb = src.convert("RGB")
    box = random_resized_box(40, 30, SampleRandom(0, 0, 0))
    flip = SampleRandom(0, 0, 0)
    random_resized_box(40, 30, flip)
    expect = rgb.crop(box).resize((S, S), Image.BILINEAR)
    if flip.coin():
        expect = expect.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert np.abs(out.astype(int) - np.asarray(expect, dtype=int)).max() <= 3


def test_a_corrupt_jpeg_among_good_ones_is_warned_and_substituted(tmp_path, caplog):
    root = write_tree(tmp_path / "d")
    bad = root / "train" / "c0" / "1.jpg"
    photo(200, 150, seed=9).save(bad, quality=90)  # big enough that half keeps the header
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # header intact, pixels cut off
    train, _, _ = load_dataset(str(root), image_size=S, augment="imagenet")
    assert len(train) == 6  # listed like the others; the decode finds it
    index = [p for p, _ in train.samples].index(str(bad))
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        x, y = train[(index, 5, 1)]
        x_again, _ = train[(index, 5, 1)]
    assert len(caplog.records) == 1 and "1.jpg" in caplog.records[0].getMessage()
    # the next file in index order, with the draws of the sample asked for
    path, label = train.samples[index + 1]
    expect = train_crop(path, S, SampleRandom(5, 1, index))
    assert torch.equal(x.permute(1, 2, 0), torch.from_numpy(expect)) and y == label
    assert torch.equal(x, x_again)
    assert sum(len(b) for b in _batches(train, workers=2)) == 6


# -- uint8 through the loader, float on the device ---------------------------------------------

def _cpu_float_reference(ds, keys):
    """The old CPU path: float32 in [0, 1], then (x - mean) * (1 / std), in numpy."""
    mean = np.asarray(imagefolder.MEAN, dtype=np.float32).reshape(-1, 1, 1)
    inv_std = 1.0 / np.asarray(imagefolder.STD, dtype=np.float32).reshape(-1, 1, 1)
    out = []
    for key in keys:
        chw = ds.decode_key(key)[0].transpose(2, 0, 1).astype(np.float32) / 255.0
        out.append(torch.from_numpy((chw - mean) * inv_std))
    return torch.stack(out)


@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_loader_then_device_equals_float_on_the_cpu(tmp_path, channels_last):
    train, _, _ = load_dataset(str(write_tree(tmp_path / "d")), image_size=S, augment="auto")
    loader = make_loader(train, 4, shuffle=True, seed=0, epoch=0, workers=2)
    for keys, (images, _) in zip(loader.batch_sampler, loader, strict=True):
        assert images.dtype == torch.uint8 and images.shape == (len(keys), 3, S, S)
        got = batch_to_device(images, torch.device("cpu"), normalization=train.normalization,
                              channels_last=channels_last)
        assert got.dtype == torch.float32
        assert got.is_contiguous(memory_format=torch.channels_last if channels_last
                                 else torch.contiguous_format)
        assert torch.equal(got, _cpu_float_reference(train, keys))


@pytest.mark.cuda
def test_uint8_normalised_on_cuda_matches_the_cpu(tmp_path):
    train, _, _ = load_dataset(str(write_tree(tmp_path / "d")), image_size=S, augment="auto")
    images, _ = next(iter(make_loader(train, 6, shuffle=False, seed=0, epoch=0)))
    cpu = batch_to_device(images, torch.device("cpu"), normalization=train.normalization)
    for cl in (False, True):
        gpu = batch_to_device(images.pin_memory(), torch.device("cuda"),
                              normalization=train.normalization, channels_last=cl)
        assert torch.equal(gpu.cpu(), cpu)  # bit for bit: true division on both


def test_float_batches_pass_through_the_device_step():
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(batch_to_device(x, torch.device("cpu")), x)
    with pytest.raises(ValueError, match="normalization"):
        batch_to_device(x.to(torch.uint8), torch.device("cpu"))


# -- the val crop, pixel for pixel -------------------------------------------------------------

def _torchvision_val(path, size, resize_to):
    """``Resize(resize_to)`` + ``CenterCrop(size)`` on torchvision's loader's image, written here
    from torchvision's definitions (torchvision itself is not a dependency):
    - ``pil_loader``: ``Image.open(f).convert("RGB")``, the full decode;
    - ``Resize(int)``: the shorter side to ``resize_to``, the longer side to
      ``int(resize_to * long / short)``; the image is returned as is when that is its size,
      else ``img.resize((w, h), BILINEAR)``;
    - ``CenterCrop``: top ``int(round((h - size) / 2.0))``, left ``int(round((w - size) / 2.0))``.
    """
    with Image.open(path) as f:
        img = f.convert("RGB")
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = resize_to, int(resize_to * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)))


@pytest.mark.parametrize("name,w,h,mode", [
    ("a.png", 48, 36, "RGB"), ("b.png", 30, 57, "RGB"), ("c.jpg", 300, 200, "RGB"),
    ("d.jpg", 45, 40, "RGB"), ("e.jpg", 200, 330, "L"), ("f.png", 16, 16, "RGB"),
    ("g.jpg", 640, 427, "RGB"), ("h.jpg", 35, 18, "CMYK")])
def test_val_crop_equals_torchvisions_resize_and_center_crop(tmp_path, name, w, h, mode):
    """The val crop is torchvision's ``Resize`` + ``CenterCrop`` pixel for pixel, against the
    definitions written in ``_torchvision_val``. tandem used to round the longer side, centre
    with a floor and decode big JPEGs at reduced scale (``draft``): a 640x427 photo became 384
    columns, not torchvision's 383, and an odd excess put the crop one pixel left of
    torchvision's. tandem now follows the definitions instead of listing deviations: users
    from the imagenet example compare validation accuracy with its main.py, which must then
    see the same pixels; the val pass is one per epoch, and at 224 px ``draft`` would apply
    only to photos with a shorter side of 512 or more."""
    root = tmp_path / "d"
    (root / "k").mkdir(parents=True)
    img = photo(w, h, seed=w, mode=mode if mode != "CMYK" else "RGB")
    (img.convert(mode) if mode == "CMYK" else img).save(root / "k" / name)
    photo(20, 20).save(root / "k" / "other.png")
    train, val, _ = load_dataset(str(root), image_size=S)  # augment "none": the val crop
    assert val_resize(S) == 18
    for ds in (train, val):
        for i, (path, _) in enumerate(ds.samples):
            got = ds[i][0].permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(got, _torchvision_val(path, S, 18), err_msg=path)
    # ... and at ImageNet's 224 (resize 256), where these photos are upsampled.
    path = root / "k" / name
    np.testing.assert_array_equal(val_crop(path, 224), _torchvision_val(path, 224, 256))


def test_val_crop_sizes_and_offsets_are_torchvisions():
    """The cases where tandem's old choices and torchvision's definitions part, spelled out."""
    assert val_resize(224) == 256
    # 640x427 at 256: 256 * 640 / 427 = 383.7, truncated (round() gave 384)
    assert shorter_side_size(640, 427, 256) == (383, 256)
    assert shorter_side_size(427, 640, 256) == (256, 383)
    # 16 px (resize 18) of the same photo: 26.98 -> 26 (round() gave 27)
    assert shorter_side_size(640, 427, 18) == (26, 18)
    # The excess 383 - 224 = 159 halves to 79.5: rounded half to even, 80 (a floor gave 79);
    # 381 - 224 = 157 halves to 78.5: 78; 26 - 16 = 10: 5.
    assert [center_offset(n, 224) for n in (383, 381, 256, 224)] == [80, 78, 16, 0]
    assert center_offset(26, 16) == 5 and center_offset(27, 16) == 6


# -- --augment ----------------------------------------------------------------------------------

def test_augment_choices_and_defaults(tmp_path):
    assert AUGMENT_FORMS == ("auto", "none", "standard", "imagenet", "randaugment:N:M",
                             "trivialaugment")
    root = write_tree(tmp_path / "d")
    assert load_dataset(str(root), augment="auto")[0].augment == "imagenet"
    assert load_dataset(str(root), augment="standard")[0].augment == "standard"
    assert load_dataset("digits", augment="auto")[0].augment == "standard"
    with pytest.raises(ValueError, match="ImageFolder"):
        load_dataset("synthetic", augment="imagenet")
    help_text = config.DataConfig.__dataclass_fields__["augment"].metadata["help"]
    assert "imagenet for an ImageFolder" in help_text and "standard for digits" in help_text


def _shifted(chw, dy, dx):
    """``chw`` moved so that output (y, x) shows source (y + dy, x + dx); zeros uncovered."""
    h, w = chw.shape[-2:]
    p = max(abs(dy), abs(dx))
    padded = torch.nn.functional.pad(chw, (p, p, p, p))
    return padded[:, p + dy:p + dy + h, p + dx:p + dx + w]


def test_standard_augment_on_an_imagefolder_shifts_and_flips_uint8(tmp_path):
    """Each augmented sample is the plain val crop, maybe mirrored, moved by at most
    ``S // 8`` pixels (zeros uncovered); over 18 draws, both a mirrored sample and a moved one
    are seen, each found on its own, so the test fails if either transform is missing."""
    train, val, _ = load_dataset(str(write_tree(tmp_path / "d")), image_size=S,
                                 augment="standard")
    plain = val.__class__(train.samples, image_size=S, augment="none")
    pad = S // 8
    moves = [(dy, dx) for dy in range(-pad, pad + 1) for dx in range(-pad, pad + 1)]
    seen = []
    for i in range(len(train)):
        still = plain[i][0]
        for epoch in range(3):
            got = train[(i, 0, epoch)][0]
            assert got.dtype == torch.uint8
            found = [(flip, move) for flip in (False, True) for move in moves
                     if torch.equal(got, _shifted(still.flip(-1) if flip else still, *move))]
            assert len(found) == 1, (i, epoch, found)  # exactly one explanation
            seen.append(found[0])
    assert any(flip for flip, _ in seen) and not all(flip for flip, _ in seen), seen
    assert any(move != (0, 0) for _, move in seen), seen
    assert len({move for _, move in seen}) >= 5, seen  # moves of several sizes and ways


# -- strategies see the same augmented batches ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.distributed
def test_strategies_and_workers_reach_the_same_weights_on_imagefolder_data(tmp_path):
    """--augment auto on JPEGs of several sizes, small smooth photos included: single with
    -j 0 against dp cpu:2 (-j 2, persistent workers over 2 epochs), balanced cpu:3 and 2-process
    ddp (-j 2), all with --sync-bn. Compared in float64 with the controls of tests/support/exact.py:
    in float32 this tree amplifies rounding up to 1e4x per step on some CPUs (AVX-512/AMX)."""
    from conftest import run_in_process, run_tandem
    from exact import check_invariance

    root = write_tree(tmp_path / "d")
    common = ["train", "--data", str(root), "--image-size", str(S), "-a", "cifar_resnet20",
              "-b", "4", "--lr", "0.01", "--epochs", "2", "--no-progress", "--seed", "1"]
    f64 = ["--dtype", "float64"]
    runs = {
        "single": [*f64, "-j", "0"],
        "single32": ["-j", "0"],
        "dp": [*f64, "-j", "2", "--strategy", "dp", "--devices", "cpu:2", "--sync-bn"],
        "balanced": [*f64, "-j", "0", "--strategy", "balanced", "--devices", "cpu:3", "--sync-bn"],
        "negative": [*f64, "-j", "0", "--strategy", "dp", "--devices", "cpu:2"],
    }
    for name, extra in runs.items():
        result = run_in_process(*common, *extra, "--out", tmp_path / name)
        assert result.returncode == 0, result.stderr
    result = run_tandem("launch", "--nproc-per-node", "2", "--", *common, *f64, "-j", "2",
                        "--strategy", "ddp", "--devices", "cpu", "--sync-bn",
                        "--out", tmp_path / "ddp", timeout=240, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = {name: tmp_path / name / "checkpoint.pt" for name in [*runs, "ddp"]}
    assert torch.load(ckpt["single"], weights_only=True)["config"]["data"]["augment"] == "auto"
    check_invariance(ckpt["single"], {k: ckpt[k] for k in ("dp", "balanced", "ddp")},
                     reference32=ckpt["single32"], negative64=ckpt["negative"])
