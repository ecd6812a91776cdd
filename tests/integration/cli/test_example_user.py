# Compares against the imagenet example's main.py (pytorch/examples), emulated with plain torch.
"""The example's user both ways: fresh-run defaults and the image-size rule (train and eval),
a truthful best.pt after a foreign resume, a tandem checkpoint that main.py's SGD + StepLR
keep training, `-e --resume RUN/best.pt`, --no-accel/--dummy, and a visible --amp."""

import json

import pytest
import torch

from conftest import make_image_folder, ok, run_in_process, snapshot
from tandem import checkpoint
from tandem.cli.main import build_parser
from tandem.cli.train import config_from_namespace
from tandem.models import create_model
from tandem.train.schedule import epoch_state, example_lr

TINY = ("--data", "synthetic", "--synthetic-size", 24, "--image-size", 8, "--num-classes", 3,
        "-b", 8, "--devices", "cpu", "--no-progress")


def test_fresh_imagefolder_run_is_resnet18_at_224_and_lists_the_examples_defaults(tmp_path):
    data = make_image_folder(tmp_path / "imgs", size=40)
    out = tmp_path / "run"
    proc = ok("train", "-b", 8, "--lr", 0.1, "--epochs", 1, "--max-steps", 1,
              "--no-progress", "--out", out, data)
    lines = proc.stdout.splitlines()
    assert lines.pop(1).startswith("--decode auto: JPEGs decoded on the CPU")  # which decoder
    assert lines[1] == ("image size 224px (resnet18's native size: training crops 224px, "
                        "validation resized to 256 and centre-cropped to 224; --image-size "
                        "to change)")
    assert lines[2].startswith("tandem's defaults that differ from the imagenet example's")
    assert lines[3:10] == ["  --wd 0.0005 (the example: 0.0001)", "  -j 0 (the example: 4)",
                          "  --label-smoothing 0.1 (the example: 0)",
                          "  --lr-schedule cosine (the example: step)",
                          "  -p 0 (the example: 10)",
                          "  --seed 0, fixed (the example: unseeded)",
                          # main.py builds 1000 outputs: it could not continue this run
                          "  --num-classes 3, the data's (the example: always 1000; its main.py "
                          "cannot load a 3-class checkpoint)"]
    assert lines[10].startswith("epoch 1/1 (partial: 1/3 batches) step 1: ")
    assert "--lr " not in proc.stdout  # typed: the user chose it
    assert "val loss " in lines[10] and " (label-smoothed 0.1; plain cross-entropy " in lines[10]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["arch"] == "resnet18" and config["data"]["image_size"] == 224
    assert config["resolved"]["dataset"]["image_size"] == 224
    # eval of the run uses the run's size, not the photos' 40px
    result = json.loads(ok("eval", "--resume", out, "--json").stdout)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert result["image_size"] == 224 and result["loss"] == pytest.approx(row["val_loss"])


def test_typed_p_and_seed_leave_the_examples_defaults_block(tmp_path):
    from tandem.train.settings import example_block

    data = make_image_folder(tmp_path / "imgs", per_class=1)
    cfg = _parse("-p", "10", "--seed", "3", str(data))
    block = example_block(cfg, frozenset({"print_freq", "seed", "data"}))
    assert not any(line.startswith(("  -p ", "  --seed ")) for line in block)
    assert "  --seed 0, fixed (the example: unseeded)" in example_block(_parse(str(data)),
                                                                        frozenset({"data"}))


def test_a_factory_model_on_an_imagefolder_keeps_the_shorter_side_and_says_so(tmp_path):
    data = make_image_folder(tmp_path / "imgs", size=40)
    proc = ok("train", "-a", "own_model:make_net", "-b", 8, "--epochs", 1,
              "--max-steps", 1, "--label-smoothing", 0, "--no-progress",
              "--out", tmp_path / "run", data)
    assert ("image size 40px (the data's shorter side: own_model:make_net has no native size"
            in proc.stdout)
    assert "label-smoothed" not in proc.stdout


def test_fixed_size_data_keeps_its_size_in_train_and_in_eval_of_a_bare_state_dict(tmp_path):
    out = tmp_path / "run"
    proc = ok("train", "-a", "cifar_resnet20", "--data", "digits", "-b", 64,
              "--epochs", 1, "--max-steps", 4, "--no-progress", "--out", out)
    assert proc.stdout.splitlines()[0] == "image size 8px (the data's own; --image-size to change)"
    torch.save(torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"],
               tmp_path / "sd.pt")
    bare = ok("eval", "--resume", tmp_path / "sd.pt", "-a", "cifar_resnet20",
              "--data", "digits", "--label-smoothing", 0.1)
    assert "with the data's own size, 8px (--image-size to change)" in bare.stdout
    run = ok("eval", "--resume", out)
    assert bare.stdout.splitlines()[-1].split(": ", 1)[1] == run.stdout.splitlines()[-1].split(
        ": ", 1)[1]  # the same loss and accuracy as the run itself


def example_file(path, best=37.5):
    """A file as main.py saves it (resnet18 under DataParallel) with ``best_acc1`` ``best``."""
    model = torch.nn.DataParallel(create_model("resnet18"))
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    torch.save({"epoch": 1, "arch": "resnet18", "state_dict": model.state_dict(),
                "best_acc1": torch.tensor(best), "optimizer": optimizer.state_dict()}, path)


def test_best_pt_after_a_foreign_resume_is_this_runs_best(tmp_path):
    data = make_image_folder(tmp_path / "imgs")
    example_file(tmp_path / "checkpoint.pth.tar", best=99.0)
    out = tmp_path / "run"
    proc = ok("train", "--resume", tmp_path / "checkpoint.pth.tar", data,
              "-b", 8, "--epochs", 2, "--image-size", 32, "--no-progress",
              "--out", out)
    assert "best.pt starts afresh in --out" in proc.stdout and "99.00%" in proc.stdout
    best_line = proc.stdout.splitlines()[-1]
    claimed = float(best_line.split("best val acc ")[1].split("%")[0])
    assert claimed < 99.0
    evaluated = json.loads(ok("eval", "--resume", out / "best.pt",
                              "--json").stdout)
    assert evaluated["acc1"] == pytest.approx(claimed, abs=0.005)
    assert float(checkpoint.load(out / "best.pt")["best_acc1"]) == pytest.approx(claimed, abs=0.005)


def main_py_resume(path, model):
    """main.py's resume: SGD(args.lr), StepLR(30, 0.1), then the checkpoint's states."""
    ckpt = torch.load(path, weights_only=True)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    model.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    return ckpt, optimizer, scheduler


def test_main_py_continues_a_finished_tandem_run_at_the_examples_lr(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", 2, "--out", run)  # cosine ends at lr 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["tandem_scheduler"]["_last_lr"] == [0.0]
    model = create_model("cifar_resnet20", num_classes=3)
    ckpt, optimizer, scheduler = main_py_resume(run / "checkpoint.pt", model)
    assert optimizer.param_groups[0]["lr"] == 0.05  # tandem's --lr, epoch 2 // 30 decays: none
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)),
                                      torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == 0.05  # StepLR: no decay before epoch 30


def test_the_examples_lr_decays_every_30_epochs():
    assert [example_lr(0.1, e) for e in (0, 29, 30, 61)] == \
        pytest.approx([0.1, 0.1, 0.01, 0.001])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    state = epoch_state(optimizer, 31)
    assert state["_last_lr"] == pytest.approx([0.01]) and state["base_lrs"] == [0.1]


def test_tandems_own_resume_keeps_its_lr_and_is_bitwise(tmp_path):
    """Stopped mid-epoch 2 (cosine lr 0.025, where the file's optimizer holds the example's
    0.05), resumed: the same bits as the run that never stopped."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ok("train", *TINY, "--epochs", 2, "--out", straight)
    ok("train", *TINY, "--epochs", 2, "--max-steps", 4, "--out", stopped)
    saved = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.05
    assert saved["tandem_scheduler"]["_last_lr"][0] < 0.05
    ok("train", "--resume", stopped)
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (straight, stopped))
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


def _val_losses64(run):
    """Plain and label-smoothed (0.1) cross-entropy of the run's weights on its val set, in
    float64 with plain torch: the reference."""
    from tandem.data import load_dataset

    _, val, _ = load_dataset("synthetic", augment="none", seed=0, image_size=8,
                             synthetic_size=24, num_classes=3, splits=("val",))
    images = torch.stack([val[i][0] for i in range(len(val))]).double()
    labels = torch.tensor([val[i][1] for i in range(len(val))])
    model = create_model("cifar_resnet20", num_classes=3)
    model.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)["state_dict"])
    with torch.no_grad():
        logits = model.double().eval()(images)
    return (torch.nn.functional.cross_entropy(logits, labels).item(),
            torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1).item())


def test_every_loss_line_names_its_loss_and_gives_plain_cross_entropy(tmp_path):
    from exact import EPS32, EPS64, TOL64

    run = tmp_path / "run"
    trained = ok("train", *TINY, "--epochs", 1, "--out", run)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    words = f"(label-smoothed 0.1; plain cross-entropy {row['val_plain_ce']:.4f})"
    assert f"val loss {row['val_loss']:.4f} {words} acc " in trained.stdout
    plain64, smoothed64 = _val_losses64(run)

    def evaluated(*flags):
        return json.loads(ok("eval", "--resume", run, "--json", *flags).stdout)

    for flags in ((), ("--strategy", "balanced", "--devices", "cpu:2"),
                  ("--strategy", "dp", "--devices", "cpu:3")):
        result = evaluated("--dtype", "float64", *flags)
        assert result["label_smoothing"] == 0.1
        assert abs(result["plain_ce"] - plain64) < TOL64, flags
        assert abs(result["loss"] - smoothed64) < TOL64, flags
    # noise floor: float32's distance from float64 stays far below float32-sized differences
    f32 = evaluated()
    assert abs(f32["plain_ce"] - plain64) / EPS32 * EPS64 < TOL64 / 2
    assert f32["plain_ce"] == pytest.approx(row["val_plain_ce"], rel=1e-6)
    # negative control: the smoothed loss is far from plain cross-entropy
    assert abs(smoothed64 - plain64) > 1000 * TOL64
    plain = evaluated("--dtype", "float64", "--label-smoothing", 0)
    assert plain["plain_ce"] is None and abs(plain["loss"] - plain64) < TOL64

    line = f"loss {f32['loss']:.4f} (label-smoothed 0.1; plain cross-entropy {f32['plain_ce']:.4f})"
    shown = ok("eval", "--resume", run).stdout.splitlines()[-1]
    assert shown == f"{run}: cifar_resnet20 val {line} acc {f32['acc1']:.2f}% " \
                    f"acc5 {f32['acc5']:.2f}% ({f32['count']} images)"
    e = ok("train", "-e", "--resume", run / "best.pt", "--data", "synthetic")
    assert e.stdout.splitlines()[-1].startswith(f"val {line} acc ")
    zero = ok("eval", "--resume", run, "--label-smoothing", 0).stdout
    assert "label-smoothed" not in zero and "plain cross-entropy" not in zero


def test_dataparallel_conversion_in_the_readme_loads_under_main_pys_dataparallel(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", 1, "--max-steps", 1, "--out", run)
    # the README's one line
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True); torch.save(dict(ckpt, state_dict={"module." + k: v for k, v in ckpt["state_dict"].items()}), tmp_path / "checkpoint.module.pt")  # noqa: E501,E702
    model = torch.nn.DataParallel(create_model("cifar_resnet20", num_classes=3))
    model.load_state_dict(torch.load(tmp_path / "checkpoint.module.pt",
                                     weights_only=True)["state_dict"])


def test_e_resume_of_a_runs_best_pt_evaluates_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", 2, "--out", run)
    before = snapshot(run)
    proc = ok("train", "-e", "--resume", run / "best.pt", "--data", "synthetic")
    assert snapshot(run) == before
    line = proc.stdout.splitlines()[-1]
    evaluated = ok("eval", "--resume", run / "best.pt")
    assert evaluated.stdout.splitlines()[-1].endswith(line)
    assert "would roll" not in proc.stderr


def test_a_run_that_main_py_continued_in_place_says_so_and_how_to_use_its_file(tmp_path):
    import os

    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", 1, "--out", run)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)  # main.py's own save of it
    theirs = run / "checkpoint.pth.tar"
    torch.save({k: ckpt[k] for k in ("epoch", "arch", "state_dict", "best_acc1", "optimizer",
                                     "scheduler")}, theirs)
    latest = os.path.getmtime(run / "checkpoint.pt")
    os.utime(theirs, (latest - 60, latest - 60))  # older: nothing to say (negative control)
    assert "checkpoint.pth.tar" not in ok("eval", "--resume", run).stdout
    os.utime(theirs, (latest + 60, latest + 60))
    said = (f"run '{run}' also holds checkpoint.pth.tar, newer than its checkpoint.pt (the "
            f"imagenet example's main.py continued the run there): this {{}} checkpoint.pt; "
            f"for the example's file: `{{}}`")
    evaluated = ok("eval", "--resume", run).stdout.splitlines()
    use = f"tandem eval --resume {theirs} --data synthetic"
    assert said.format("evaluates", use) in evaluated
    e = ok("train", "-e", "--resume", run, "--data", "synthetic")
    assert said.format("evaluates", use) in e.stdout.splitlines()
    resumed = ok("train", "--resume", run, "--epochs", 2).stdout.splitlines()
    use = f"tandem train --resume {theirs} --data synthetic --out NEWDIR"
    assert "  " + said.format("continues", use) in resumed
    # the way it gives works (with the synthetic data's shape, which the file does not hold)
    ok("eval", "--resume", theirs, "--data", "synthetic", *TINY[2:8])


def _parse(*argv):
    return config_from_namespace(build_parser().parse_args(["train", *argv]))


def test_no_accel_and_dummy_mean_devices_cpu_and_data_synthetic():
    cfg = _parse("--no-accel", "--dummy", "-a", "resnet18")
    assert cfg.parallel.devices == "cpu" and cfg.data.data == "synthetic"
    for argv, words in ((("--dummy", "/data/imagenet"), "--dummy (same as --data synthetic)"),
                        (("--no-accel", "--gpu", "0"), "--no-accel (same as --devices cpu)")):
        proc = run_in_process("train", *argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert words in proc.stderr


def test_dummy_is_main_pys_random_imagenet_data_for_an_imagenet_arch(tmp_path):
    cfg = _parse("-a", "resnet18", "--dummy")
    assert (cfg.data.data, cfg.data.image_size, cfg.data.num_classes) == ("synthetic", 224, 1000)
    cfg = _parse("-a", "alexnet", "--dummy", "--image-size", "64", "--num-classes", "5")
    assert (cfg.data.image_size, cfg.data.num_classes) == (64, 5)  # typed: as typed
    cfg = _parse("-a", "cifar_resnet20", "--dummy")  # a CIFAR arch keeps tandem's synthetic
    assert (cfg.data.image_size, cfg.data.num_classes) == (None, None)
    out = tmp_path / "run"
    proc = ok("train", "-a", "resnet18", "--dummy", "-b", 4, "--synthetic-size", 4,
              "--epochs", 1, "--devices", "cpu", "--no-progress", "--out", out)
    assert proc.stdout.splitlines()[0] == (
        "--dummy: random 3x224x224 images of 1000 classes, as the imagenet example's "
        "(resnet18's native size; --image-size and --num-classes to change); 4 to train and 1 "
        "to validate (--synthetic-size to change)")
    assert "image size" not in proc.stdout
    dataset = json.loads((out / "config.json").read_text())["resolved"]["dataset"]
    assert (dataset["image_size"], dataset["num_classes"]) == (224, 1000)


def test_missing_resume_file_stays_an_error(tmp_path):
    proc = run_in_process("train", "--resume", tmp_path / "nope.pth.tar", "--data", "digits")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "nope.pth.tar" in proc.stderr


def test_amp_is_said_recorded_and_kept_by_eval(tmp_path):
    out = tmp_path / "run"
    proc = ok("train", *TINY, "--amp", "--epochs", 1, "--out", out)
    assert ("precision: bf16 autocast on cpu, no grad scaling (--amp); weights and "
            "checkpoints stay float32") in proc.stdout
    assert json.loads((out / "config.json").read_text())["parallel"]["amp_dtype"] == "bf16"
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    kept = ok("eval", "--resume", out, "--json")
    assert "(the run's --amp; --no-amp for float32)" in kept.stderr
    assert json.loads(kept.stdout)["loss"] == pytest.approx(row["val_loss"], rel=1e-6)
    fp32 = ok("eval", "--resume", out, "--json", "--no-amp")
    assert "precision" not in fp32.stderr
    assert json.loads(fp32.stdout)["loss"] != json.loads(kept.stdout)["loss"]
