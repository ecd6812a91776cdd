# Compares against the PyTorch imagenet example's own checkpoints, built here as it saves them.
"""The example's files load in checkpoint.load, `tandem eval --resume` and `train --resume`.

The example saves ``{"epoch", "arch", "state_dict", "best_acc1", "optimizer", "scheduler"}``
(older versions ``best_prec1`` and no scheduler), after wrapping AlexNet/VGG's ``features`` in
``torch.nn.DataParallel`` and any other model whole. tandem's models share torchvision's keys,
so these dicts are what the example writes for the same architecture.
"""

import json
import os
from dataclasses import replace
import shutil
import stat

import pytest
import torch

from conftest import make_image_folder, run_in_process
from tandem import checkpoint
from tandem.checkpoint.compat import final_layer, foreign_scheduler
from tandem.state_keys import strip_wrappers
from tandem.config import TrainConfig
from tandem.train.loop import Trainer
from tandem.train.plan import plan_train
from tandem.models import create_model


def example_checkpoint(path, arch, fmt="new", wrap=True, num_classes=1000):
    """Train one step as the example does, then ``torch.save`` its dict; return the plain model."""
    torch.manual_seed(1)
    plain = create_model(arch, num_classes=num_classes)
    model = plain
    if wrap and arch.startswith(("alexnet", "vgg")):
        model.features = torch.nn.DataParallel(model.features)
    elif wrap:
        model = torch.nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    scheduler.step()
    ckpt = {"epoch": 3, "arch": arch, "state_dict": model.state_dict(),
            "optimizer": optimizer.state_dict()}
    if fmt == "new":
        ckpt.update(best_acc1=torch.tensor(41.5), scheduler=scheduler.state_dict())
    else:
        ckpt.update(best_prec1=41.5)
    torch.save(ckpt, path)
    if wrap and arch.startswith(("alexnet", "vgg")):
        plain.features = plain.features.module
    return plain, optimizer


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_strip_wrappers_on_any_submodule():
    alexnet = {"features.module.0.weight": 1, "classifier.1.weight": 2}
    assert list(strip_wrappers(alexnet)) == ["features.0.weight", "classifier.1.weight"]
    resnet = {"module.conv1.weight": 1, "module.fc.bias": 2}
    assert list(strip_wrappers(resnet)) == ["conv1.weight", "fc.bias"]
    nested = {"module.module.a": 1, "module.module.b": 2}
    assert list(strip_wrappers(nested)) == ["a", "b"]
    real = {"module.weight": 1, "head.weight": 2}  # a real child called "module": left alone
    assert list(strip_wrappers(real)) == ["module.weight", "head.weight"]


def test_foreign_scheduler_is_named_and_tandems_own_is_not():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    multi = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3])
    assert foreign_scheduler({"scheduler": multi.state_dict()}) == "MultiStepLR"
    own = {"format": checkpoint.FORMAT, "scheduler": {"lr_lambdas": [None], "last_epoch": 1}}
    assert foreign_scheduler(own) is None
    assert foreign_scheduler({"scheduler": None}) is None


def test_alexnet_with_dataparallel_features_loads(tmp_path):
    path = tmp_path / "checkpoint.pth.tar"
    trained, _ = example_checkpoint(path, "alexnet", num_classes=10)
    assert any(k.startswith("features.module.") for k in torch.load(path)["state_dict"])
    model = create_model("alexnet", num_classes=10)
    ckpt = checkpoint.load(path, model=model)
    _same_weights(model, trained)
    assert ckpt["best_acc1"] == pytest.approx(41.5) and isinstance(ckpt["best_acc1"], float)
    assert ckpt["arch"] == "alexnet" and ckpt["epoch"] == 3


@pytest.mark.parametrize("fmt,wrap", [("new", True), ("old", True), ("new", False)])
def test_resnet18_checkpoints_load_with_optimizer(tmp_path, fmt, wrap):
    path = tmp_path / "checkpoint.pth.tar"
    trained, example_opt = example_checkpoint(path, "resnet18", fmt=fmt, wrap=wrap)
    model = create_model("resnet18")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = checkpoint.load(path, model=model, optimizer=optimizer)
    _same_weights(model, trained)
    assert ckpt["best_acc1"] == pytest.approx(41.5)
    mine = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    theirs = [example_opt.state[p]["momentum_buffer"] for p in example_opt.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert final_layer(ckpt["state_dict"]) == ("fc", 1000)


def test_train_resume_takes_arch_epoch_and_optimizer(tmp_path):
    """In process: the run built from the example's file, before it trains."""
    from tandem.train import build

    data = make_image_folder(tmp_path / "imgs")
    path = tmp_path / "checkpoint.pth.tar"
    _, example_opt = example_checkpoint(path, "resnet18")
    cfg = TrainConfig.from_dict({"data": {"data": str(data)}, "optim": {"batch_size": 8},
                                 "run": {"resume": str(path), "out": str(tmp_path / "out")}})
    plan = plan_train(cfg, frozenset({"data", "batch_size", "resume", "out"}))
    assert plan.cfg.model.arch == "resnet18"
    with plan.strategy:
        parts = build.build(plan)
        start, notes = build.restore(plan.checkpoint, plan.resume_path, parts["cfg"],
                                      parts["batches_per_epoch"], parts["optimizer"],
                                      parts["scheduler"], parts["scaler"])
        trainer = Trainer(**parts, **start)
    # the file's best_acc1 (41.5) is its own model_best's: best.pt starts afresh, and says so
    assert trainer.position.epoch == 3 and trainer.best_acc1 == 0.0
    assert len(notes) == 2 and notes[0] == "its StepLR goes on at epoch 4 (lr 0.1)"
    assert notes[1].startswith("best.pt starts afresh in --out") and "41.50%" in notes[1]
    params = example_opt.param_groups[0]["params"]
    for mine, theirs in zip(trainer.model.parameters(), params):
        assert torch.equal(trainer.optimizer.state[mine]["momentum_buffer"],
                           example_opt.state[theirs]["momentum_buffer"])


def test_cli_eval_and_train_resume_of_example_files(tmp_path):
    data = make_image_folder(tmp_path / "imgs")
    alex = tmp_path / "alexnet.pth.tar"
    example_checkpoint(alex, "alexnet")
    proc = run_in_process("eval", "--resume", alex, "--data", data, "--image-size", 64, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["arch"] == "alexnet" and result["count"] > 0
    assert {"acc1", "acc5"} <= set(result) and result["acc1"] <= result["acc5"]

    r18 = tmp_path / "resnet18.pth.tar"
    example_checkpoint(r18, "resnet18", fmt="new")
    out = tmp_path / "run"
    proc = run_in_process("train", "--resume", r18, data, "-b", 8, "--epochs", 4,
                          "--image-size", 64, "--out", out)  # 224px: the next test's
    assert proc.returncode == 0, proc.stderr
    assert "resuming" in proc.stdout and "at epoch 4/4" in proc.stdout
    assert "its StepLR goes on at epoch 4 (lr 0.1)" in proc.stdout
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["arch"] == "resnet18" and saved["epoch"] == 4


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_file_mode_follows_the_umask(tmp_path, umask):
    """As ``open()`` gives config.json: 0666 less the umask (mkstemp's 0600 hid files)."""
    old = os.umask(umask)
    try:
        path = checkpoint.save(tmp_path / "c.pt", create_model("cifar_resnet20"), epoch=1)
        with open(tmp_path / "config.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "config.json").stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "config.json"]  # no temporary file left


SYNTHETIC = ("--data", "synthetic", "--synthetic-size", 24, "--image-size", 8, "--num-classes", 3,
             "-b", 8, "--devices", "cpu", "--no-progress")


def test_tandem_checkpoint_keeps_the_examples_steplr_right(tmp_path):
    """main.py loads ``checkpoint['scheduler']`` into its StepLR(30, 0.1) unconditionally."""
    run = tmp_path / "run"
    proc = run_in_process("train", *SYNTHETIC, "--epochs", 2, "--out", run)
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    model = create_model("cifar_resnet20", num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    example = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    fields = set(example.state_dict())
    optimizer.load_state_dict(ckpt["optimizer"])
    example.load_state_dict(ckpt["scheduler"])
    assert ckpt["epoch"] == 2 and example.last_epoch == ckpt["epoch"]
    assert not hasattr(example, "lr_lambdas") and set(example.state_dict()) == fields
    assert (example.step_size, example.gamma) == (30, 0.1)
    lr = optimizer.param_groups[0]["lr"]
    example.step()  # epoch 3: no decay before epoch 30
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    assert "lr_lambdas" in ckpt["tandem_scheduler"]  # tandem's own per-step schedule
    # main.py's resume with --gpu N runs `best_acc1.to(N)`: a tensor, as the example saves it
    best = ckpt["best_acc1"]
    assert isinstance(best, torch.Tensor) and best.dim() == 0 and best.to("cpu").item() >= 0

    # a checkpoint written before `tandem_scheduler` (LambdaLR under `scheduler`) still resumes
    old = tmp_path / "old"
    shutil.copytree(run, old)
    legacy = dict(ckpt, scheduler=ckpt["tandem_scheduler"])
    del legacy["tandem_scheduler"]
    torch.save(legacy, old / "checkpoint.pt")
    for directory in (run, old):
        proc = run_in_process("train", "--resume", directory, "--epochs", 3)
        assert proc.returncode == 0, proc.stderr
        assert "not tandem's" not in proc.stdout
    new, legacy = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (run, old))
    assert new["tandem_scheduler"] == legacy["tandem_scheduler"]
    assert all(torch.equal(new["state_dict"][k], v) for k, v in legacy["state_dict"].items())


def _resume_in_process(tmp_path, path, given, **optim):
    """The run ``train --resume PATH DATA -b 8`` builds from an example file, before it trains."""
    from tandem.train import build

    data = make_image_folder(tmp_path / "imgs")
    cfg = TrainConfig.from_dict({"data": {"data": str(data)},
                                 "optim": {"batch_size": 8, **optim},
                                 "run": {"resume": str(path), "out": str(tmp_path / "out")}})
    plan = plan_train(cfg, frozenset({"data", "batch_size", "resume", "out", *given}))
    with plan.strategy:
        parts = build.build(plan)
        start, notes = build.resumed(plan, parts)
    return Trainer(**parts, **start), notes


def test_resume_keeps_the_files_lr_momentum_weight_decay_and_nesterov(tmp_path):
    path = tmp_path / "checkpoint.pth.tar"
    example_checkpoint(path, "resnet18")  # SGD lr 0.1, momentum 0.9, weight decay 1e-4
    saved = torch.load(path)
    saved["optimizer"]["param_groups"][0].update(nesterov=True, momentum=0.8)
    torch.save(saved, path)
    trainer, notes = _resume_in_process(tmp_path, path, given=())
    optim = trainer.cfg.optim
    assert (optim.lr, optim.momentum, optim.weight_decay, optim.nesterov) == (0.1, 0.8, 1e-4, True)
    group = trainer.optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.8, 1e-4, True)
    assert group["initial_lr"] == 0.1 and group["lr"] == 0.1  # its StepLR, at epoch 4 of 30
    assert trainer.config_dict["optim"]["lr"] == 0.1  # what config.json and checkpoints keep
    assert notes[0] == (f"'{path}' is not a tandem run; from it: arch resnet18, epoch 3, lr 0.1, "
                        f"momentum 0.8, weight decay 0.0001, nesterov on, lr schedule StepLR "
                        f"every 30 epochs x0.1")

    trainer, notes = _resume_in_process(tmp_path, path, given=("weight_decay", "lr"),
                                        weight_decay=5e-4, lr=0.1)
    assert trainer.cfg.optim.weight_decay == 5e-4 and trainer.cfg.optim.momentum == 0.8
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 5e-4
    assert notes[1] == "--wd 0.0005 overrides the file's weight decay 0.0001"
    assert not any("--lr" in n for n in notes[1:2])  # the same value is no override


def test_a_main_py_file_goes_on_with_its_own_steplr_and_plain_cross_entropy(tmp_path):
    """StepLR(step_size=2, gamma=0.5) after 3 epochs: epoch 4 runs at 0.1 * 0.5 ** (3 // 2),
    as main.py's own resume would, with plain cross-entropy; a flag still wins, and is said."""
    path = tmp_path / "checkpoint.pth.tar"
    example_checkpoint(path, "resnet18")
    saved = torch.load(path)
    saved["scheduler"].update(step_size=2, gamma=0.5, last_epoch=3)
    torch.save(saved, path)
    trainer, notes = _resume_in_process(tmp_path, path, given=())
    optim = trainer.cfg.optim
    assert (optim.lr_schedule, optim.lr_step, optim.lr_gamma) == ("step", 2.0, 0.5)
    assert optim.label_smoothing == 0.0 and trainer.criterion.label_smoothing == 0.0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05, rel=1e-12)
    assert notes[0].endswith(", lr schedule StepLR every 2 epochs x0.5")
    assert "its StepLR goes on at epoch 4 (lr 0.05)" in notes
    assert not any(line.lstrip().startswith("lr schedule") for line in notes[1:])
    assert "    label smoothing 0 (plain cross-entropy, as the imagenet example trains; " \
           "--label-smoothing to change)" in [f"  {n}" for n in notes]
    # main.py at epoch 6 would be at 0.1 * 0.5 ** 3: so is tandem's schedule there
    from tandem.train.schedule import lr_factor
    assert 0.1 * lr_factor(6 * 7, optim, 7) == pytest.approx(0.1 * 0.5 ** 3, rel=1e-12)

    trainer, notes = _resume_in_process(tmp_path, path, given=("lr_schedule", "label_smoothing"),
                                        lr_schedule="cosine", label_smoothing=0.1)
    assert trainer.cfg.optim.lr_schedule == "cosine" and trainer.criterion.label_smoothing == 0.1
    assert "--lr-schedule cosine overrides the file's StepLR every 2 epochs x0.5" in notes


def test_a_file_without_optimizer_state_says_so():
    from tandem.train.settings import file_settings

    cfg = TrainConfig.from_dict({"optim": {"lr": 0.2}})
    kept, said = file_settings(cfg, frozenset({"lr"}), {"arch": "resnet18", "epoch": 2,
                                                        "state_dict": {}}, "bare.pth")
    assert kept.optim == replace(cfg.optim, label_smoothing=0.0)  # the example's loss
    assert kept.model.arch == "resnet18"
    assert said == ["'bare.pth' is not a tandem run; from it: arch resnet18, epoch 2",
                    "it holds no optimizer state: lr, momentum, weight decay and nesterov are "
                    "this run's (--lr, --momentum, --wd, --nesterov)"]


def without_decode_line(text: str) -> list[str]:
    """``text``'s lines but the one saying where --decode auto decodes (tested elsewhere)."""
    return [line for line in text.splitlines() if not line.startswith("--decode auto: ")]


def test_resumed_example_file_says_what_it_took_and_reloads(tmp_path):
    """main.py's 1000-way file on a 3-class folder: the run keeps 1000 outputs and reloads."""
    data = make_image_folder(tmp_path / "imgs")
    path = tmp_path / "checkpoint.pth.tar"
    example_checkpoint(path, "resnet18")
    out = tmp_path / "run"
    proc = run_in_process("train", "--resume", path, data, "-b", 8, "--epochs", 4,
                          "--out", out)
    assert proc.returncode == 0, proc.stderr
    lines = without_decode_line(proc.stdout)
    assert lines[0].startswith("ImageFolder ") and lines[1].startswith("resuming ")
    assert "from it: arch resnet18, epoch 3, lr 0.1, momentum 0.9, weight decay 0.0001, " \
           "nesterov off" in lines[2]
    assert lines[2].endswith(", lr schedule StepLR every 30 epochs x0.1")
    assert "  its StepLR goes on at epoch 4 (lr 0.1)" in lines
    block = lines[lines.index("  not in the file, so this run takes:"):][:5]
    assert block[1:] == ["    global batch 8 (as given)", "    epochs 4 (as given)",
                         "    image size 224px (resnet18's native size; --image-size to "
                         "change)",
                         "    label smoothing 0 (plain cross-entropy, as the imagenet example "
                         "trains; --label-smoothing to change)"]
    assert "label-smoothed" not in proc.stdout
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["lr"] == 0.1  # main.py's lr for epoch 4 (no decay before epoch 30)
    config = json.loads((out / "config.json").read_text())
    assert (config["optim"]["lr_schedule"], config["optim"]["lr_step"],
            config["optim"]["label_smoothing"]) == ("step", 30.0, 0.0)
    assert config["data"]["num_classes"] == 1000  # the built model's, not the data's 3
    assert config["resolved"]["dataset"]["num_classes"] == 3
    proc = run_in_process("eval", "--resume", out / "best.pt", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["count"] == 6
    assert [ln[:12] for ln in without_decode_line(proc.stderr)] == ["ImageFolder "]  # no
    # foreign note
    proc = run_in_process("train", "--resume", out, "--epochs", 5)
    assert proc.returncode == 0, proc.stderr
    assert "at epoch 5/5" in proc.stdout and "not a tandem run" not in proc.stdout
    assert torch.load(out / "checkpoint.pt")["state_dict"]["fc.weight"].shape == (1000, 512)


def test_num_classes_for_real_data_keeps_a_larger_head(tmp_path):
    data = make_image_folder(tmp_path / "imgs")
    out = tmp_path / "run"
    proc = run_in_process("train", "-a", "cifar_resnet20", data, "--num-classes", 1000, "-b", 8,
                          "--epochs", 1, "--max-steps", 1, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert torch.load(out / "checkpoint.pt")["state_dict"]["fc.weight"].shape == (1000, 64)
    proc = run_in_process("train", "-a", "cifar_resnet20", data, "--num-classes", 2,
                          "--out", tmp_path / "other")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "has 3 classes, more than num_classes=2" in proc.stderr


def _val_images(root):
    """An ImageFolder with train/ and val/; val images 60x40, so resize 256 gives 384x256."""
    import numpy as np
    from PIL import Image

    make_image_folder(root / "train")
    rng = np.random.default_rng(1)
    for c, name in enumerate(("cat", "dog", "fox")):
        (root / "val" / name).mkdir(parents=True)
        for i in range(2):
            pixels = rng.random((40, 60, 3)) * 200 + c * 20
            Image.fromarray(pixels.astype(np.uint8)).save(root / "val" / name / f"{i}.png")
    return root


def _plain_ce_at_224(model, root):
    """The example's val transform (Resize 256, CenterCrop 224, Normalize) and plain CE."""
    import numpy as np
    from PIL import Image

    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    images, labels = [], []
    for c, name in enumerate(sorted(p.name for p in (root / "val").iterdir())):
        for file in sorted((root / "val" / name).iterdir()):
            img = Image.open(file).convert("RGB").resize((384, 256), Image.BILINEAR)
            img = img.crop((80, 16, 304, 240))  # centre 224x224 of 384x256
            x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255
            images.append((x - mean[:, None, None]) / std[:, None, None])
            labels.append(c)
    with torch.no_grad():
        logits = model.eval()(torch.stack(images))
    return torch.nn.functional.cross_entropy(logits, torch.tensor(labels)).item()


def test_example_file_evaluates_with_plain_cross_entropy_at_224(tmp_path):
    root = _val_images(tmp_path / "imgs")
    torch.manual_seed(4)
    model = create_model("resnet18")
    wrapped = torch.nn.DataParallel(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    torch.save({"epoch": 1, "arch": "resnet18", "state_dict": wrapped.state_dict(),
                "best_acc1": torch.tensor(0.0), "optimizer": optimizer.state_dict()},
               tmp_path / "model_best.pth.tar")
    proc = run_in_process("eval", "--resume", tmp_path / "model_best.pth.tar", "--data", root,
                          "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["count"] == 6
    expected = _plain_ce_at_224(model, root)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert without_decode_line(proc.stderr) == [
        f"'{tmp_path / 'model_best.pth.tar'}' is not a tandem run: evaluated as its source "
        f"would, with plain cross-entropy at resnet18's native 224px (--label-smoothing and "
        f"--image-size to change)"]
    proc = run_in_process("eval", "--resume", tmp_path / "model_best.pth.tar", "--data", root,
                          "--json", "--label-smoothing", 0.1, "--image-size", 224)
    assert proc.returncode == 0 and without_decode_line(proc.stderr) == []
    assert abs(json.loads(proc.stdout)["loss"] - result["loss"]) > 0.01  # smoothing counted
    # typed as for main.py: `-e --resume FILE DIR` evaluates the same way
    proc = run_in_process("train", "-a", "resnet18", "-e", "--resume",
                          tmp_path / "model_best.pth.tar", root)
    assert proc.returncode == 0, proc.stderr
    assert "is not a tandem run: evaluated as its source would" in proc.stdout
    assert f"val loss {expected:.4f} " in proc.stdout
