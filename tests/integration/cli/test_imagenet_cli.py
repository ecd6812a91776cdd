# Compares against the imagenet example's command line: the same words, typed the same way.
"""`tandem train` as `python main.py`: DIR, --gpu, -p, the refused distributed flags; day-one
fixes (--version, no progress-bar frames in logs, bench --help, ImageFolder size, --devices)."""

import json
import shlex

import pytest

from conftest import hint_of, make_image_folder, one_line_error, run_in_process
from tandem.cli.main import build_parser
from tandem.cli.train import config_from_namespace
from tandem.cli.common import given_fields
from tandem.cli.imagenet_flags import example_overrides
from tandem.parallel.devices import parse_device_spec


def test_example_command_line_on_jpegs(tmp_path):
    data = make_image_folder(tmp_path / "imgs", size=32)
    out = tmp_path / "run"
    proc = run_in_process("train", "-a", "resnet18", "-b", 8, "--lr", 0.01, "--momentum", 0.9,
                          "--wd", 1e-4, "-j", 0, "--epochs", 1, "-p", 1, "--seed", 0,
                          "--out", out, data)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr  # not a terminal: no bar frames
    assert "epoch 1/1 [1/3] loss" in proc.stdout and "acc5" in proc.stdout
    assert "epoch 1/1 step 3:" in proc.stdout
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= row["val_acc"] <= row["val_acc5"] <= 100
    config = json.loads((out / "config.json").read_text())
    # an ImageFolder is trained at the arch's native size (the example's 224), not the photos'
    assert config["data"]["data"] == str(data) and config["data"]["image_size"] == 224
    assert config["resolved"]["dataset"]["image_size"] == 224


def _parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_dir_and_gpu_map_onto_data_and_devices_and_count_as_given():
    args = _parse("-a", "resnet18", "--gpu", "1", "/data/imagenet")
    cfg = config_from_namespace(args)
    assert cfg.data.data == "/data/imagenet" and cfg.parallel.devices == "cuda:1"
    assert {"data", "devices", "arch"} <= given_fields(args) | example_overrides(args)[1]
    with pytest.raises(ValueError, match="two datasets"):
        config_from_namespace(_parse("--data", "digits", "/data/imagenet"))
    with pytest.raises(ValueError, match="disagree"):
        config_from_namespace(_parse("--gpu", "0", "--devices", "cpu"))


def test_distributed_flags_print_the_launch_command():
    """The command on the hint line, with the example's -b (each of the 2 machines' batch)
    carried over as tandem's global -b, and said."""
    proc = run_in_process("train", "-a", "resnet50", "--dist-url", "tcp://10.1.1.1:23456",
                          "--dist-backend", "nccl", "--multiprocessing-distributed",
                          "--world-size", 2, "--rank", 1, "-b", 256, "/data/imagenet")
    one_line_error(proc, "through `tandem launch`")
    hint = hint_of(proc)
    assert hint.startswith("run: tandem launch --nproc-per-node")
    assert "--nnodes 2 --node-rank 1 --master-addr 10.1.1.1 --master-port 23456" in hint
    assert "-- train -a resnet50 /data/imagenet -b 512 --strategy ddp" in hint
    assert hint.endswith("(-b 512: the example's -b 256 is each of the 2 machines' batch, and "
                         "tandem's -b the global one)")
    assert "--dist-url" not in hint


def test_the_launch_command_drops_the_flags_it_replaces_however_typed():
    """Abbreviated and ``--flag=value`` forms, as argparse reads them, are dropped too: the
    printed command runs, instead of being refused again."""
    proc = run_in_process("train", "-a", "resnet50", "--dist-ur", "tcp://10.1.1.1:23456",
                          "--multiproc", "--world-size=2", "--rank", 1, "--gpu=0", "--dev", "cpu",
                          "--strat", "dp", "-b", 256, "/data/imagenet")
    one_line_error(proc, "through `tandem launch`")
    command = shlex.split(hint_of(proc).removeprefix("run: ").split(" (-b ")[0])
    assert "--nnodes 2 --node-rank 1 --master-addr 10.1.1.1 --master-port 23456" in \
        shlex.join(command)
    train = command[command.index("--") + 1:]
    assert train[:7] == ["train", "-a", "resnet50", "/data/imagenet", "-b", "512", "--strategy"]
    args = build_parser().parse_args(train)  # the launch command's workers parse it so
    assert (args.dist_url, args.world_size, args.rank, args.gpu) == (None,) * 4
    assert not args.multiprocessing_distributed and args.strategy == "ddp"


def test_one_line_errors_and_version():
    proc = run_in_process("train", "--start-epoch", 5, "/data/imagenet")
    assert proc.returncode == 2 and "--start-epoch is not supported" in proc.stderr
    assert proc.stderr.count("\n") == 1
    proc = run_in_process("train", "-a", "resnet18", "--pretrained", "/")
    assert proc.returncode == 2 and "never downloads" in proc.stderr
    proc = run_in_process("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tandem ")


def test_bench_help_shows_defaults_and_no_bare_dest_names():
    text = " ".join(run_in_process("bench", "--help").stdout.split())  # wrapping aside
    assert "(default: 64)" in text and "(default: single,dp,balanced)" in text
    for dest in ("ARCH ARCH", "STRATEGIES", "BATCH_SIZE", "STEPS", "WARMUP", "IMAGE_SIZE",
                 "NUM_CLASSES", "BASELINES", "THREADS", "SEED", "DIST_TIMEOUT", "--json JSON"):
        assert dest not in text


def test_devices_refuses_mixed_types():
    with pytest.raises(ValueError, match="one device type, not cpu and cuda"):
        parse_device_spec("cpu:2,cuda", "--devices")
