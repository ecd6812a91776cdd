"""Which files are "unreadable", through `tandem train`/`tandem bench` and the datasets: only a
file the decoders refuse is warned about and replaced (tandem's loader and bench's Pillow
reference alike); a valid photo never is, a bug of tandem's keeps its traceback, and a split
of nothing but bad files is one line."""

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_tandem
from tandem_bench.loader_bench import ReferenceDataset
from tandem.cli.main import main
from tandem.data import imagenet_transforms, load_dataset
from tandem.data.decode import reduction
from tandem.data.imagenet_transforms import random_resized_box
from tandem.data.transforms import SampleRandom


pytestmark = pytest.mark.usefixtures("fresh_imagefolder_warnings")


def photos(root, per_class=4, size=(500, 375)):
    """``root/train|val/c{0,1}/{i}.jpg``: 500x375 JPEGs (ImageNet's commonest size), the
    first ``per_class - 1`` of each class to train, the last to validate."""
    rng = np.random.default_rng(0)
    for c in range(2):
        for i in range(per_class):
            split = "val" if i == per_class - 1 else "train"
            path = root / split / f"c{c}" / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path, quality=90)
    return root


def _unreadable(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]


def test_train_and_bench_at_image_size_32_on_500x375_jpegs(tmp_path, caplog, capsys):
    """Issue 36: at 32 px these decode at 1/8 (63x47), and a box down to the bottom rows was
    refused, then every other 500x375 file with the same draws. Seed 2 draws such a box among
    the 6 training samples in epochs 0 and 1; every training image is read (one batch)."""
    root = photos(tmp_path / "photos")
    for epoch in (0, 1):
        boxes = [random_resized_box(500, 375, SampleRandom(2, epoch, i)) for i in range(6)]
        assert any(reduction(500, 375, b, 32, 32) == 8 and b[3] > 47 * 500 / 63 for b in boxes)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        assert main(["bench", "--data", str(root), "--image-size", "32", "-j", "0", "-b", "6",
                     "--steps", "1", "--warmup", "0", "--seed", "2"]) == 0
        assert main(["train", "--data", str(root), "--image-size", "32", "-a", "cifar_resnet20",
                     "-b", "6", "--epochs", "1", "--max-steps", "1", "--seed", "2",
                     "--no-progress", "--out", str(tmp_path / "run")]) == 0
    assert not _unreadable(caplog)
    assert "unreadable" not in capsys.readouterr().err


def test_a_tandem_error_in_the_decode_path_is_not_taken_for_a_bad_file(tmp_path, monkeypatch,
                                                                      caplog):
    """A ValueError of tandem's own (the resample here) propagates, from the dataset and out of
    the CLI with its traceback; no file is warned about or marked bad."""
    root = photos(tmp_path / "photos", per_class=2, size=(40, 30))

    def broken(*args, **kwargs):
        raise ValueError("a bug in the resample")

    monkeypatch.setattr(imagenet_transforms, "resized_crop", broken)
    train, _, _ = load_dataset(str(root), image_size=16, augment="imagenet")
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        with pytest.raises(ValueError, match="a bug in the resample"):
            train[(0, 0, 0)]
        with pytest.raises(ValueError, match="a bug in the resample"):
            main(["bench", "--data", str(root), "--image-size", "16", "-j", "0", "-b", "2",
                  "--steps", "1", "--warmup", "0"])
    assert not train._bad and not _unreadable(caplog)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header parses; the pixels stop short


def test_a_split_with_no_decodable_image_is_one_line_from_the_cli(tmp_path, capsys):
    """Every training file cut short (headers intact, so loading lists and sizes them): `train`
    in process and `bench` in a subprocess whose DataLoader worker raises it (torch re-raises
    a worker's error with the worker's whole traceback as its message) end in one line."""
    root = photos(tmp_path / "photos", per_class=3, size=(64, 48))
    for path in (root / "train").rglob("*.jpg"):
        _truncate(path)
    code = main(["train", "--data", str(root), "--image-size", "16", "-a", "cifar_resnet20",
                 "-b", "4", "--epochs", "1", "--max-steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "no image in this ImageFolder split can be decoded" in err, err
    done = run_tandem("bench", "--data", root, "--image-size", "16", "-j", "1", "-b", "4",
                      "--steps", "1", "--warmup", "0", timeout=240)
    lines = [line for line in done.stderr.splitlines() if line.startswith("tandem: error")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == ["tandem: error: no image in this ImageFolder split can be decoded "
                     f"(all 4, first: '{root / 'train' / 'c0' / '0.jpg'}')"], done.stderr


def test_bench_data_with_corrupt_jpegs_warns_and_goes_on_in_the_reference_too(tmp_path, caplog):
    """Issue 32, bad 4: a file that is no image and a cut one, in the training split. The
    Pillow reference replaces each by the next file, with the draws of the sample asked for,
    as tandem's loader does, and the race runs to its end."""
    root = photos(tmp_path / "photos", per_class=3, size=(64, 48))
    (root / "train" / "c0" / "0.jpg").write_bytes(b"\x00 not a JPEG at all" * 20)
    _truncate(root / "train" / "c1" / "1.jpg")
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        assert main(["bench", "--data", str(root), "--image-size", "16", "-j", "0", "-b", "4",
                     "--steps", "1", "--warmup", "0"]) == 0
    warned = _unreadable(caplog)
    assert len(warned) == 2 and any("0.jpg" in m for m in warned), warned
    train, _, _ = load_dataset(str(root), image_size=16, augment="imagenet")
    reference = ReferenceDataset(train.samples, 16)
    x, label = reference[(0, 3, 1)]  # c0/0.jpg: the next file, c0/1.jpg, with sample 0's draws
    assert torch.equal(x, reference._transform(1, SampleRandom(3, 1, 0)))
    assert label == train.samples[1][1] and reference._bad == {0}
