# Compares against the weights file itself: every tensor loaded but a re-sized classifier.
"""``--pretrained FILE`` / ``--weights FILE``: torchvision-format state dicts and checkpoints."""

import pytest
import torch

from conftest import run_in_process
from tandem import checkpoint
from tandem.models import create_model
from tandem.pretrained import PretrainedError, load_pretrained


@pytest.fixture
def weights(tmp_path):
    torch.manual_seed(3)
    model = create_model("cifar_resnet20", num_classes=100)
    path = tmp_path / "cifar_resnet20-100.pth"
    torch.save(model.state_dict(), path)  # what torchvision publishes: a bare state dict
    return path, model.state_dict()


def test_same_classes_loads_everything(weights):
    path, state = weights
    model = create_model("cifar_resnet20", num_classes=100)
    line = load_pretrained(model, str(path), "cifar_resnet20")
    assert "left out" not in line and str(path) in line
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_other_classes_reinitialise_only_the_classifier(weights):
    path, state = weights
    torch.manual_seed(0)
    model = create_model("cifar_resnet20", num_classes=10)
    fresh_fc = model.fc.weight.detach().clone()
    line = load_pretrained(model, str(path), "cifar_resnet20")
    assert "left out fc.weight, fc.bias" in line and "100 classes in the file, 10 here" in line
    assert torch.equal(model.fc.weight, fresh_fc)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items() if not k.startswith("fc."))


def test_dataparallel_checkpoint_is_a_source(tmp_path, weights):
    _, state = weights
    wrapped = torch.nn.DataParallel(create_model("cifar_resnet20", num_classes=100))
    wrapped.module.load_state_dict(state)
    torch.save({"epoch": 1, "arch": "cifar_resnet20", "state_dict": wrapped.state_dict()},
               tmp_path / "example.pth.tar")
    model = create_model("cifar_resnet20", num_classes=100)
    load_pretrained(model, str(tmp_path / "example.pth.tar"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_other_mismatches_are_one_line_errors(tmp_path, weights):
    path, state = weights
    with pytest.raises(PretrainedError, match="does not fit arch cifar_resnet32: .*missing"):
        load_pretrained(create_model("cifar_resnet32"), str(path), "cifar_resnet32")
    bad = dict(state, **{"conv1.weight": torch.zeros(16, 3, 5, 5)})
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(PretrainedError, match=r"conv1.weight is 16x3x5x5 in the file"):
        load_pretrained(create_model("cifar_resnet20"), str(tmp_path / "bad.pth"))
    with pytest.raises(PretrainedError, match="is a directory"):
        load_pretrained(create_model("cifar_resnet20"), str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        load_pretrained(create_model("cifar_resnet20"), str(tmp_path / "nope.pth"))


def test_cli_fine_tune_and_refusals(tmp_path):
    path = tmp_path / "gray.pth"  # digits are 1-channel images
    torch.save(create_model("cifar_resnet20", num_classes=100, in_channels=1).state_dict(), path)
    out = tmp_path / "run"
    proc = run_in_process("train", "-a", "cifar_resnet20", "--data", "digits", "--weights",
                          path, "--epochs", 1, "--max-steps", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "left out fc.weight, fc.bias (100 classes in the file, 10 here" in proc.stdout
    proc = run_in_process("train", "--resume", out, "--pretrained", path)
    assert proc.returncode == 2 and "give one of them" in proc.stderr
    proc = run_in_process("train", "-a", "cifar_resnet20", "--pretrained")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "never downloads" in proc.stderr and "--pretrained FILE" in proc.stderr


@pytest.mark.parametrize("mistake", ["another_arch", "channels"])
def test_cli_pretrained_mistakes_are_one_line_and_exit_2(tmp_path, mistake):
    """Through the CLI: a file of another arch, and a 3-channel file on 1-channel digits."""
    path = tmp_path / "weights.pth"
    if mistake == "another_arch":  # a cifar_resnet20 file for --arch cifar_resnet32
        torch.save(create_model("cifar_resnet20", in_channels=1).state_dict(), path)
        arch, expect = "cifar_resnet32", "missing key"
    else:  # a 3-channel file for 1-channel digits
        torch.save(create_model("cifar_resnet20", in_channels=3).state_dict(), path)
        arch, expect = "cifar_resnet20", "conv1.weight is 16x3x3x3 in the file but 16x1x3x3"
    proc = run_in_process("train", "-a", arch, "--data", "digits", "--pretrained", path,
                          "--epochs", 1, "--max-steps", 1, "--out", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("tandem: error: --pretrained") and expect in proc.stderr
    assert str(path) in proc.stderr and not (tmp_path / "run").exists()
