"""`tandem train` end to end on directory datasets: an ImageFolder tree and a CIFAR-10 dir.

In process (through ``tandem.cli.main.main``) to keep the suite fast. The tiny datasets are
written here with Pillow and pickle; a corrupt image in the tree must be skipped with a
warning, not crash the run.
"""

import json

import pytest
from conftest import write_cifar, write_image, write_truncated_png

from tandem.cli.main import main

pytestmark = pytest.mark.usefixtures("fresh_imagefolder_warnings")


def _train(data, out, *extra):
    return main(["train", "--data", str(data), "--out", str(out), "--arch", "cifar_resnet20",
                 "-b", "4", "--epochs", "1", "--max-steps", "2", "--no-progress",
                 "--devices", "cpu:2", "--strategy", "dp", *extra])


def _metrics(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_train_on_an_imagefolder_tree_with_a_corrupt_image(tmp_path, capsys, caplog):
    root = tmp_path / "shapes"
    for c, name in enumerate(["circle", "square", "star"]):
        for i in range(4):
            write_image(root / "train" / name / f"{i}.png", 40 * c + i, size=(20, 18))
        write_image(root / "val" / name / "v.png", 40 * c + 7, size=(20, 18))
    (root / "train" / "star" / "broken.png").write_bytes(b"\x89PNG not really")
    write_truncated_png(root / "train" / "circle" / "cut.png")

    # the whole epoch (14 images, batches of 4), so that every image is loaded
    assert _train(root, tmp_path / "run", "--image-size", "16", "--max-steps", "4") == 0
    (row,) = _metrics(tmp_path / "run")
    assert row["epoch"] == row["step"] // 4 == 1 and 0.0 <= row["val_acc"] <= 100.0
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [m for m in warned if "broken.png" in m] and [m for m in warned if "cut.png" in m]
    assert len(warned) == 2, warned  # once each
    assert "Traceback" not in capsys.readouterr().err


def test_train_on_a_cifar10_directory(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    write_cifar(root, n=6)
    assert _train(root, tmp_path / "run", "--augment", "standard") == 0
    (row,) = _metrics(tmp_path / "run")
    assert row["epoch"] == 1 and row["train_loss"] > 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert str(root) in json.dumps(config)


def test_a_flat_imagefolder_says_how_it_is_split_once_in_the_main_process(tmp_path, capsys,
                                                                          monkeypatch):
    """No train/ and val/: one line says the 80/20 split per class, its counts and its fixed
    seed, whatever --seed; a torchrun worker other than rank 0 does not repeat it."""
    from conftest import make_image_folder
    from tandem.cli.common import tandem_warnings
    from tandem.data import load_dataset

    root = make_image_folder(tmp_path / "flat", per_class=10, size=16)
    line = (f"ImageFolder '{root}' has no train/ and val/: each class is split 80/20, 24 "
            f"images to train and 6 to validate, by a shuffle with the fixed seed 0 (the same "
            f"split whatever --seed)")
    for seed in ("0", "7"):
        assert _train(root, tmp_path / f"run{seed}", "--seed", seed) == 0
        out = capsys.readouterr().out.splitlines()
        assert out.count(line) == 1 and out[0] == line, out
    assert main(["eval", "--resume", str(tmp_path / "run7" / "best.pt"), "--devices", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == line and out[-1].endswith("(6 images)"), out
    assert main(["eval", "--resume", str(tmp_path / "run7" / "best.pt"), "--devices", "cpu",
                 "--json"]) == 0
    said = capsys.readouterr()
    notes = [n for n in said.err.splitlines() if not n.startswith("--decode auto: ")]
    assert json.loads(said.out)["count"] == 6 and notes == [line]

    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with tandem_warnings():
            load_dataset(str(root))
        assert (capsys.readouterr().out == line + "\n") is said
    split = tmp_path / "split"
    make_image_folder(split / "train", per_class=4, size=16)
    make_image_folder(split / "val", per_class=1, size=16)
    with tandem_warnings():
        load_dataset(str(split))
    assert capsys.readouterr().out == ""  # its own train/ and val/: nothing to say


def test_eval_opens_no_training_image(tmp_path, capsys, caplog, monkeypatch):
    """`tandem eval --resume F --data DIR` and `train -e` read only DIR/val: a corrupt file in
    DIR/train gives no warning, and no path under DIR/train is opened or walked (a spy on
    ``open``, which Pillow opens files with too, and on ``os.walk``)."""
    import builtins
    import os

    root = tmp_path / "shapes"
    for c, name in enumerate(["circle", "square"]):
        for i in range(3):
            write_image(root / "train" / name / f"{i}.png", 40 * c + i, size=(20, 18))
        write_image(root / "val" / name / "v.png", 40 * c + 7, size=(20, 18))
    assert _train(root, tmp_path / "run", "--image-size", "16", "--max-steps", "1") == 0
    (root / "train" / "circle" / "0-broken.png").write_bytes(b"\x89PNG not really")
    capsys.readouterr()
    caplog.clear()

    opened, walked = [], []
    real_open, real_walk = builtins.open, os.walk

    def spy_open(file, *args, **kwargs):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else "")
        return real_open(file, *args, **kwargs)

    def spy_walk(top, *args, **kwargs):
        walked.append(os.fspath(top))
        return real_walk(top, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "walk", spy_walk)
    ckpt = str(tmp_path / "run" / "checkpoint.pt")
    assert main(["eval", "--resume", ckpt, "--data", str(root), "--devices", "cpu",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 2
    assert main(["train", "-e", "--resume", ckpt, "--data", str(root), "--devices", "cpu"]) == 0
    monkeypatch.undo()

    said = capsys.readouterr()
    assert said.out.strip().endswith("(2 images)"), said.out
    in_train = str(root / "train")
    assert not [p for p in opened + walked if p.startswith(in_train)]
    assert [p for p in opened if p.startswith(str(root / "val"))]  # the spy sees image opens
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "broken" not in said.err
