"""`tandem eval`: tandem checkpoints, torch DataParallel (``module.``) checkpoints, and a
malicious pickle that must be refused without running."""

import json
import os

import pytest
import torch
from torch import nn
from conftest import run_in_process

from tandem.cli.main import main
from tandem.models import create_model

pytestmark = pytest.mark.slow

DATA = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "8",
        "--num-classes", "3"]


def eval_json(path, *extra):
    result = run_in_process("eval", "--resume", str(path), "--devices", "cpu", "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_eval_matches_the_validation_of_training(tmp_path, capsys):
    run = run_in_process("train", *DATA, "-b", "8", "--epochs", "1", "--no-progress",
                         "--devices", "cpu", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    # data settings and seed come from the checkpoint's config
    result = eval_json(tmp_path / "checkpoint.pt")
    assert result["arch"] == "cifar_resnet20" and result["count"] == 6
    assert result["acc"] == pytest.approx(logged["val_acc"])
    assert result["loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    # and `train -e` validates the same way (in process: cli.main is what the process runs)
    assert main(["train", *DATA, "--devices", "cpu", "-e", "--resume",
                 str(tmp_path / "checkpoint.pt")]) == 0
    assert f"acc {logged['val_acc']:.2f}%" in capsys.readouterr().out


def _imagenet_style_checkpoint(path, model, wrap):
    """What the imagenet example saves: DataParallel's ``module.``-prefixed state dict."""
    wrapped = nn.DataParallel(model) if wrap else model
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    torch.save({"epoch": 3, "arch": "cifar_resnet20", "state_dict": wrapped.state_dict(),
                "best_acc1": torch.tensor(12.5), "optimizer": optimizer.state_dict()}, path)


def _val_loss(model, data="synthetic", **options) -> tuple[float, int]:
    """Mean cross-entropy of ``model`` over a validation set (default: DATA's), computed here
    as eval treats a file from elsewhere (seed 0, plain cross-entropy: no label smoothing)."""
    from tandem.data import batch_to_device, load_dataset

    options = options or {"synthetic_size": 24, "image_size": 8, "num_classes": 3}
    _, val, _ = load_dataset(data, seed=0, **options)
    images = torch.stack([val[i][0] for i in range(len(val))])
    targets = torch.tensor([int(val[i][1]) for i in range(len(val))])
    images = batch_to_device(images, torch.device("cpu"), normalization=val.normalization)
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(images), targets, reduction="sum").item()
    return loss / len(val), len(val)


def _perturbed_model(**kwargs) -> nn.Module:
    """cifar_resnet20 with weights and running stats far from any seeded initialisation."""
    torch.manual_seed(5)
    model = create_model("cifar_resnet20", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.5 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    return model


def test_torch_dataparallel_checkpoint_evaluates_and_resumes(tmp_path, capsys):
    """The weights of a ``module.``-keyed file are the ones evaluated: eval's loss is the one
    computed here from those weights, far from the loss of the seeded initialisation that eval
    would have evaluated had it loaded nothing."""
    from tandem.config import ModelConfig
    from tandem.data import load_dataset
    from tandem.train.build import build_model

    model = _perturbed_model(num_classes=3, in_channels=3)
    want, count = _val_loss(model)
    info = load_dataset("synthetic", synthetic_size=24, image_size=8, num_classes=3)[2]
    init, _ = _val_loss(build_model(ModelConfig(arch="cifar_resnet20"), info, seed=0))
    assert abs(want - init) > 0.1, (want, init)
    _imagenet_style_checkpoint(tmp_path / "dp.pt", model, wrap=True)
    assert next(iter(torch.load(tmp_path / "dp.pt")["state_dict"])).startswith("module.")
    _imagenet_style_checkpoint(tmp_path / "plain.pt", model, wrap=False)
    from_dp = eval_json(tmp_path / "dp.pt", *DATA)
    assert from_dp["count"] == count
    assert from_dp["loss"] == pytest.approx(want, rel=1e-5)
    assert main(["eval", "--resume", str(tmp_path / "plain.pt"), "--devices", "cpu", "--json",
                 *DATA]) == 0
    assert from_dp == json.loads(capsys.readouterr().out)
    # resuming starts at the saved epoch and writes a plain-keyed tandem checkpoint
    out = tmp_path / "resumed"
    run = run_in_process("train", *DATA, "-b", "8", "--epochs", "4", "--no-progress",
                         "--devices", "cpu", "--resume", str(tmp_path / "dp.pt"), "--out", str(out))
    assert run.returncode == 0, run.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [4]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 4 and not any(k.startswith("module.") for k in ckpt["state_dict"])


class _Evil:
    """Unpickling this would create a directory: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_pickle_is_refused_without_running(tmp_path, capsys):
    marker = tmp_path / "pwned"
    model = create_model("cifar_resnet20", num_classes=3, in_channels=3)
    torch.save({"arch": "cifar_resnet20", "state_dict": model.state_dict(),
                "payload": _Evil(str(marker))}, tmp_path / "evil.pt")
    result = run_in_process("eval", "--resume", str(tmp_path / "evil.pt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("tandem: error: ") and "evil.pt" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()
    # train --resume takes the same path (in process here)
    assert main(["train", *DATA, "--devices", "cpu", "--out", str(tmp_path / "o"),
                 "--resume", str(tmp_path / "evil.pt")]) == 2
    assert "evil.pt" in capsys.readouterr().err and not marker.exists()


def test_a_bare_state_dict_evaluates_with_a(tmp_path):
    """`torch.save(model.state_dict())` names no arch: eval says to give -a, and with -a it
    evaluates those weights (the loss computed here from them, at digits' own 8px by the size
    rule of training, far from the seeded initialisation's). An -a that contradicts a file's
    own arch is one line."""
    from tandem.config import ModelConfig
    from tandem.data import load_dataset
    from tandem.train.build import build_model

    model = _perturbed_model(num_classes=10, in_channels=1)
    path = tmp_path / "plain_state_dict.pt"
    torch.save(model.state_dict(), path)
    want, count = _val_loss(model, "digits", image_size=8)
    info = load_dataset("digits", image_size=8)[2]
    init, _ = _val_loss(build_model(ModelConfig(arch="cifar_resnet20"), info, seed=0),
                        "digits", image_size=8)
    assert abs(want - init) > 0.1, (want, init)

    proc = run_in_process("eval", "--resume", path, "--data", "digits")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert "names no architecture" in proc.stderr and "-a ARCH" in proc.stderr

    result = eval_json(path, "-a", "cifar_resnet20", "--data", "digits")
    assert result["arch"] == "cifar_resnet20" and result["count"] == count == 359
    assert result["loss"] == pytest.approx(want, rel=1e-5)

    _imagenet_style_checkpoint(tmp_path / "named.pt", _perturbed_model(num_classes=3),
                               wrap=False)  # names cifar_resnet20
    proc = run_in_process("eval", "--resume", tmp_path / "named.pt", "-a", "resnet18", *DATA)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "-a resnet18 does not match" in proc.stderr and "names cifar_resnet20" in proc.stderr
    assert eval_json(tmp_path / "named.pt", "-a", "cifar_resnet20", *DATA)["count"] == 6


def test_eval_under_ddp_without_torchrun_prints_the_eval_launch_command(tmp_path, monkeypatch):
    from conftest import DIST_VARS

    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "plain.pt"
    torch.save(create_model("cifar_resnet20", num_classes=3).state_dict(), path)
    proc = run_in_process("eval", "--resume", path, "-a", "cifar_resnet20", *DATA,
                          "--strategy", "ddp", "--devices", "cpu")
    error, hint = proc.stderr.splitlines()  # the error, and the command in its hint
    assert proc.returncode == 2 and error.endswith("runs one process per device"), proc.stderr
    assert hint.startswith("hint: ")
    assert (f"`tandem launch --nproc-per-node N -- eval --resume {path} -a cifar_resnet20 "
            f"{' '.join(DATA)} --strategy ddp --devices cpu`") in hint
    assert "-- train" not in proc.stderr


def test_a_gpu_fp16_run_is_scored_here_in_float32_and_not_resumed_here(tmp_path, capsys):
    """A run trained with --amp on CUDA (fp16, as its config records) is evaluated on a CPU
    in float32, saying so, with the loss of its float32 twin; resuming it on the CPU, which
    would change what it computes, is refused in one line that names the run's flags."""
    assert main(["train", *DATA, "-b", "8", "--epochs", "1", "--no-progress", "--devices",
                 "cpu", "--out", str(tmp_path / "run")]) == 0
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    ckpt["config"]["parallel"].update(amp=True, amp_dtype="fp16", devices="cuda")
    torch.save(ckpt, tmp_path / "gpu.pt")
    capsys.readouterr()
    assert main(["eval", "--resume", str(tmp_path / "gpu.pt"), "--devices", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "precision: float32 (the run's --amp --amp-dtype fp16 cannot run on cpu)"
    assert main(["eval", "--resume", str(tmp_path / "run" / "checkpoint.pt"), "--devices",
                 "cpu"]) == 0
    twin = capsys.readouterr().out.splitlines()
    assert out[-1].split(": ", 1)[1] == twin[-1].split(": ", 1)[1]  # the same scores
    assert main(["train", "--resume", str(tmp_path / "gpu.pt"), "--devices", "cpu",
                 "--epochs", "2", "--out", str(tmp_path / "more")]) == 2
    error, hint = capsys.readouterr().err.strip().splitlines()  # the error, then the remedy
    assert "trains with --amp --amp-dtype fp16, which cannot run on cpu" in error, error
    assert hint.startswith("hint: resume it on a device where it runs")
    assert not (tmp_path / "more").exists()
