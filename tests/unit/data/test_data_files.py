"""load_dataset on directories: ImageFolder (both layouts, corrupt files) and CIFAR-10 pickles."""

import logging
import os
import pickle

import numpy as np
import pytest
import torch
from conftest import write_cifar, write_image, write_truncated_png

from tandem.data import batch_to_device, load_dataset, make_loader
from tandem.data import imagefolder

pytestmark = pytest.mark.usefixtures("fresh_imagefolder_warnings")


@pytest.fixture
def split_tree(tmp_path):
    root = tmp_path / "pets"
    for c, name in enumerate(["cat", "dog"]):
        for i in range(3):
            write_image(root / "train" / name / f"{i}.png", 10 * c + i)
        write_image(root / "val" / name / "v.jpg", 100 + c)
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    return root


# -- ImageFolder -------------------------------------------------------------------------------

def test_imagefolder_train_val_layout(split_tree):
    train, val, info = load_dataset(str(split_tree), image_size=8)
    assert (info.name, info.num_classes, info.in_channels, info.image_size) == ("pets", 2, 3, 8)
    assert info.classes == ["cat", "dog"]
    assert (len(train), len(val)) == (6, 2)
    assert [label for _, label in train.samples] == [0, 0, 0, 1, 1, 1]
    x, y = val[1]
    assert x.shape == (3, 8, 8) and x.dtype == torch.uint8 and y == 1
    assert (x[0].int() - 101).abs().max() <= 2  # a solid colour (the val image is a JPEG)
    # the device step normalises: decode -> resize -> crop -> uint8 -> float -> normalise
    x = batch_to_device(x[None], torch.device("cpu"), normalization=val.normalization)[0]
    red = x[0] * imagefolder.STD[0] + imagefolder.MEAN[0]
    assert torch.allclose(red, x.new_full((8, 8), 101 / 255), atol=1e-2)


def test_imagefolder_loads_through_workers(split_tree):
    train, _, _ = load_dataset(str(split_tree), image_size=8, augment="standard")
    a = [x for x, _ in make_loader(train, 4, shuffle=True, seed=0, epoch=1, workers=0)]
    b = [x for x, _ in make_loader(train, 4, shuffle=True, seed=0, epoch=1, workers=2)]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_imagefolder_single_dir_is_split_fixed(tmp_path):
    root = tmp_path / "flat"
    for c in range(3):
        for i in range(10):
            write_image(root / f"class{c}" / f"{i:02d}.png", c * 20 + i)
    train, val, info = load_dataset(str(root), image_size=4)
    assert info.classes == ["class0", "class1", "class2"]
    assert (len(train), len(val)) == (24, 6)
    assert sorted(label for _, label in val.samples) == [0, 0, 1, 1, 2, 2]
    assert not {p for p, _ in train.samples} & {p for p, _ in val.samples}
    _, val2, _ = load_dataset(str(root), image_size=4, seed=99)
    assert val2.samples == val.samples  # the split ignores the training seed


def test_imagefolder_corrupt_files_warned_once_when_loaded_and_substituted(split_tree, caplog):
    """Files that are not images are listed like the others, without being opened; loading one
    warns once, naming it, and gives the next sample that decodes, so every epoch runs to its
    end."""
    (split_tree / "train" / "dog" / "empty.png").write_bytes(b"")
    (split_tree / "train" / "dog" / "junk.jpg").write_bytes(b"\x00garbage" * 10)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        train, _, _ = load_dataset(str(split_tree), image_size=8)
        train, _, _ = load_dataset(str(split_tree), image_size=8)
        assert len(train) == 8 and not caplog.records  # listed, not opened
        for epoch in range(2):  # the second epoch: no new warnings
            loader = make_loader(train, 3, shuffle=True, seed=0, epoch=epoch)
            assert sum(len(y) for _, y in loader) == 8
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert any("empty.png" in m for m in warned) and any("junk.jpg" in m for m in warned)
    assert not any("BytesIO" in m for m in warned)  # the file named, not Pillow's buffer
    names = [os.path.basename(p) for p, _ in train.samples]
    assert names[6:] == ["empty.png", "junk.jpg"]  # the last two: the next good one is the first
    for bad in (6, 7):
        x, y = train[bad]
        assert torch.equal(x, train[0][0]) and y == train[0][1] == 0


def test_imagefolder_truncated_image_substituted_lazily(split_tree, caplog):
    write_truncated_png(split_tree / "train" / "cat" / "1.png")  # replaces a good one
    train, _, _ = load_dataset(str(split_tree), image_size=8)
    assert len(train) == 6  # listed like the others; the decode finds it
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        x1, y1 = train[1]  # cat/1.png -> the next decodable sample, cat/2.png
        x1b, _ = train[1]
    x2, y2 = train[2]
    assert torch.equal(x1, x2) and y1 == y2 == 0 and torch.equal(x1, x1b)
    assert len(caplog.records) == 1 and "1.png" in caplog.records[0].getMessage()
    xs = [x for x, _ in make_loader(train, 3, shuffle=True, seed=0, epoch=0)]
    assert sum(len(x) for x in xs) == 6  # the epoch still runs to the end


def _spy_on_open(monkeypatch) -> list[str]:
    """The paths ``open`` (which Pillow opens files with) is called on from now on."""
    import builtins

    opened, real_open = [], builtins.open

    def spy(file, *args, **kwargs):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else "")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    return opened


def test_imagefolder_val_split_alone_opens_no_training_file(split_tree, monkeypatch):
    """Eval's ``splits=("val",)``: no training set, the same validation set, and no file of
    train/ opened; the whole load opens one header per split, not every image."""
    (split_tree / "train" / "cat" / "0-junk.png").write_bytes(b"junk")  # first in train/
    _, val, info = load_dataset(str(split_tree), image_size=8)
    opened = _spy_on_open(monkeypatch)
    none, val_only, info_v = load_dataset(str(split_tree), image_size=8, splits=("val",))
    assert none is None and info_v == info and val_only.samples == val.samples
    assert opened == [str(split_tree / "val" / "cat" / "v.jpg")]  # its first header, alone
    opened.clear()
    train, _, _ = load_dataset(str(split_tree), image_size=8)  # training: one header each
    assert sorted(os.path.basename(p) for p in opened) == ["0-junk.png", "0.png", "v.jpg"]
    assert len(train) == 7


def test_flat_imagefolder_val_split_alone_opens_no_training_file(tmp_path, monkeypatch, caplog):
    """Without train/ and val/, eval lists the directory to split it, says the same split
    line as training, and opens only files of the validation split."""
    root = tmp_path / "flat"
    for c in range(2):
        for i in range(5):
            write_image(root / f"class{c}" / f"{i}.png", c * 20 + i)
    with caplog.at_level(logging.INFO, logger="tandem.data"):
        train, val, _ = load_dataset(str(root))
        opened = _spy_on_open(monkeypatch)
        none, val_only, _ = load_dataset(str(root), splits=("val",))
    assert none is None and val_only.samples == val.samples
    assert opened and set(opened) <= {p for p, _ in val.samples}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0] == lines[1] and "8 images to train and 2" in lines[0]


def test_imagefolder_own_size_is_the_first_val_images(split_tree):
    """Without --image-size the size is the shorter side of the first validation image, which
    training and eval both read (not a training image, which eval never opens)."""
    write_image(split_tree / "val" / "cat" / "v.jpg", 100, size=(14, 9))
    for splits in (("train", "val"), ("val",)):
        train, val, info = load_dataset(str(split_tree), splits=splits)
        assert info.image_size == 9 and val[0][0].shape == (3, 9, 9)


def test_imagefolder_no_readable_image_in_a_split(split_tree):
    for f in (split_tree / "val").rglob("*.jpg"):
        f.write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"'.*val' has no readable images: all 2 image files"):
        load_dataset(str(split_tree), splits=("val",))


def test_imagefolder_all_images_bad(tmp_path, caplog):
    root = tmp_path / "bad"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.png").write_bytes(b"nope")
    with pytest.raises(ValueError, match="no readable images"):
        load_dataset(str(root))


def test_imagefolder_empty_and_malformed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"ImageFolder '{empty}' is empty"):
        load_dataset(str(empty))
    no_val = tmp_path / "noval"
    write_image(no_val / "train" / "a" / "0.png", 1)
    with pytest.raises(ValueError, match="no val/"):
        load_dataset(str(no_val))
    extra = tmp_path / "extra"
    write_image(extra / "train" / "a" / "0.png", 1)
    write_image(extra / "val" / "b" / "0.png", 1)
    with pytest.raises(ValueError, match="classes not in train/: b"):
        load_dataset(str(extra))
    notes = tmp_path / "notes"
    (notes / "a").mkdir(parents=True)
    (notes / "a" / "readme.txt").write_text("no image here")
    with pytest.raises(ValueError, match=f"ImageFolder '{notes}' has no image files"):
        load_dataset(str(notes))
    tiny = tmp_path / "tiny"
    write_image(tiny / "a" / "0.png", 1)
    with pytest.raises(ValueError, match="too small"):
        load_dataset(str(tiny))


# -- CIFAR-10 ----------------------------------------------------------------------------------

def test_cifar10_dir(tmp_path):
    root = write_cifar(tmp_path / "cifar")
    train, val, info = load_dataset(str(root), augment="standard")
    assert (info.name, info.num_classes, info.in_channels, info.image_size) == \
        ("cifar10", 10, 3, 32)
    assert info.classes == [f"c{i}" for i in range(10)]
    assert (len(train), len(val)) == (30, 6)
    with open(root / "test_batch", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    x, y = val[2]
    assert y == batch[b"labels"][2]
    pixel = batch[b"data"][2].reshape(3, 32, 32)[1, 5, 7] / 255  # green plane, row 5, col 7
    assert abs(float(x[1, 5, 7]) * 0.2435 + 0.4822 - pixel) < 1e-4
    assert train.pad == 4 and train.flip
    xb, yb = next(iter(make_loader(train, 8, shuffle=True, seed=0, epoch=0)))
    assert xb.shape == (8, 3, 32, 32) and yb.dtype == torch.int64


def test_cifar10_parent_dir_and_resize(tmp_path):
    write_cifar(tmp_path / "dl" / "cifar-10-batches-py")
    train, _, info = load_dataset(str(tmp_path / "dl"), image_size=16)
    assert info.image_size == 16 and train[0][0].shape == (3, 16, 16)


def test_cifar10_missing_batch_names_it(tmp_path):
    root = write_cifar(tmp_path / "cifar")
    _, val, _ = load_dataset(str(root))
    os.remove(root / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_dataset(str(root))
    none, val_only, _ = load_dataset(str(root), splits=("val",))  # eval reads test_batch only
    assert none is None and torch.equal(val_only[5][0], val[5][0])


def test_cifar10_corrupt_or_wrong_shape_names_file(tmp_path):
    root = write_cifar(tmp_path / "cifar")
    good = (root / "data_batch_2").read_bytes()
    (root / "data_batch_2").write_bytes(good[:100])
    with pytest.raises(ValueError, match="data_batch_2.*corrupt"):
        load_dataset(str(root))
    with open(root / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(ValueError, match=r"data_batch_2.*\(N, 3072\)"):
        load_dataset(str(root))
    with open(root / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2]}, f)
    with pytest.raises(ValueError, match="data_batch_2.*4 images but 3 labels"):
        load_dataset(str(root))
    with open(root / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 12]}, f)
    with pytest.raises(ValueError, match="data_batch_2.*0..9"):
        load_dataset(str(root))


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_cifar10_pickle_cannot_run_code(tmp_path):
    root = write_cifar(tmp_path / "cifar")
    marker = tmp_path / "PWNED"
    with open(root / "test_batch", "wb") as f:
        pickle.dump({b"data": _Evil(str(marker)), b"labels": []}, f)
    with pytest.raises(ValueError, match="test_batch.*refusing to load .*open"):
        load_dataset(str(root))
    assert not marker.exists()
