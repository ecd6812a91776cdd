"""`tandem train` end to end on directory datasets: an ImageFolder tree and a CIFAR-10 dir.

In process (through ``tandem.cli.main.main``) to keep the suite fast. The tiny datasets are
written here with Pillow and pickle; a corrupt image in the tree must be skipped with a
warning, not crash the run.
"""

import json

import pytest

from tandem.cli.main import main
from tandem.data import imagefolder

from test_data_files import write_cifar, write_image, write_truncated_png


@pytest.fixture(autouse=True)
def _fresh_warnings():
    imagefolder._warned.clear()


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

    assert _train(root, tmp_path / "run", "--image-size", "16") == 0
    (row,) = _metrics(tmp_path / "run")
    assert row["epoch"] == 1 and 0.0 <= row["val_acc"] <= 100.0
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("broken.png" in m for m in warned) and any("cut.png" in m for m in warned)
    assert "Traceback" not in capsys.readouterr().err


def test_train_on_a_cifar10_directory(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    write_cifar(root, n=6)
    assert _train(root, tmp_path / "run", "--augment", "standard") == 0
    (row,) = _metrics(tmp_path / "run")
    assert row["epoch"] == 1 and row["train_loss"] > 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert str(root) in json.dumps(config)
