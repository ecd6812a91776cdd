"""examples/own_classifier.py, run as a user would: its fit-then-resume ends on the weights of
one straight fit (bit for bit) and classifies digits; its model and data load from the
repository root as `-a examples.own_classifier:SmallCNN --data examples.own_classifier:digits`."""

import json
import sys

import pytest
import torch
from conftest import ROOT, cli_env, run_bounded, run_tandem
from exact import same_bits

pytestmark = pytest.mark.slow


def test_own_classifier_example(tmp_path):
    result = run_bounded([sys.executable, "examples/own_classifier.py", str(tmp_path / "ex")],
                         120, cli_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stdout and "epoch 8/8 step 184:" in result.stdout
    rows = [json.loads(r) for r in (tmp_path / "ex" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 9)) and rows[-1]["val_acc"] > 90

    sys.path.insert(0, str(ROOT))
    try:
        from examples.own_classifier import SmallCNN, digits
    finally:
        sys.path.remove(str(ROOT))
    import tandem

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example's process ran (cli_env)
    try:
        train, val, classes = digits()
        torch.manual_seed(0)
        tandem.fit(SmallCNN(), train, val, classes=classes, strategy="dp", devices="cpu:2",
                   sync_bn=True, batch_size=64, epochs=8, lr=0.02, no_progress=True,
                   out=str(tmp_path / "straight"))
    finally:
        torch.set_num_threads(threads)
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)
            for d in ("ex", "straight"))
    assert not same_bits(a["state_dict"], b["state_dict"])
    assert not same_bits(a["optimizer"], b["optimizer"])


def test_examples_factories_from_the_repository_root(tmp_path):
    result = run_tandem("train", "-a", "examples.own_classifier:SmallCNN",
                        "--data", "examples.own_classifier:digits", "--epochs", "1",
                        "--max-steps", "2", "--no-progress", "--out", tmp_path, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["resolved"]["dataset"]["num_classes"] == 10
    assert config["model"]["arch"] == "examples.own_classifier:SmallCNN"
