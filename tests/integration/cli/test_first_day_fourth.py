"""The first day, fourth pass (issue 55, "The new user and the imagenet example's user"): what
a new user and main.py's user met, through the CLI and tandem.fit, against the one-line errors
(with their ``hint:`` line) and the lines the docs promise."""

import importlib
import json
import shutil

import pytest
import torch
from conftest import (SUPPORT, hint_of, make_image_folder, ok, one_line_error,
                      run_in_process)
from own_model import Pairs

import tandem
from tandem_bench import BenchConfig, format_table, run_bench
from tandem_bench.timing import summarize
from tandem.errors import UsageError

TINY = ["--data", "synthetic", "--synthetic-size", "12", "--image-size", "8", "--num-classes",
        "3", "-a", "cifar_resnet20", "-b", "6", "--no-progress", "--devices", "cpu"]

# A user's module: data sets and models wrong in the ways a first day meets.
MINE = '''
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

class Mixed(Dataset):  # 3x8x8 and 1x8x8 in turn
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.randn(3 if i % 2 == 0 else 1, 8, 8), i % 4

def mixed():
    return Mixed(), Mixed()

def eight():  # 8 classes, targets 0..7
    x, y = torch.randn(32, 1, 8, 8), torch.arange(32) % 8
    return TensorDataset(x[:24], y[:24]), TensorDataset(x[24:], y[24:])

def four(num_classes=10, in_channels=1):  # always 4 outputs, whatever num_classes says
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 4))

COUNT = 3  # not a function
'''


@pytest.fixture
def mine(tmp_path, monkeypatch):
    name = f"mine_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(MINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


# -- bad 2: a data factory whose items differ in shape ------------------------------------------
def test_items_of_two_shapes_are_one_line_naming_both_before_training(mine, tmp_path):
    out = tmp_path / "cli"
    result = run_in_process("train", "-a", f"{mine.__name__}:four", "--data",
                            f"{mine.__name__}:mixed", "--out", out)
    one_line_error(result, f"{mine.__name__}:mixed train data[1] has an input of shape 1x8x8",
                   "train data[0] 3x8x8")
    assert "the same shape" in hint_of(result)
    assert not out.exists()  # refused before anything was written
    with pytest.raises(UsageError, match=r"tandem.fit\(\) train data\[1\] has an input of shape "
                                         r"1x8x8, but tandem.fit\(\) train data\[0\] 3x8x8"):
        tandem.fit(mine.four(), *mine.mixed(), out=str(tmp_path / "fit"), no_progress=True)
    assert not (tmp_path / "fit").exists()


# -- bad 3: a model that gives fewer outputs than there are classes -----------------------------
def test_a_model_narrower_than_the_classes_is_one_line_before_training(mine, tmp_path):
    out = tmp_path / "cli"
    for race in ((), ("--strategy", "auto", "--devices", "cpu:2")):  # auto: before its race
        result = run_in_process("train", "-a", f"{mine.__name__}:four", "--data",
                                f"{mine.__name__}:eight", "--out", out, *race)
        one_line_error(result, "the model gives 4 outputs per sample",
                       "8 classes (targets 0 to 7)")
        assert "num_classes=8" in hint_of(result)
        assert not out.exists()
    with pytest.raises(UsageError, match="the model gives 4 outputs per sample, but "
                                         r"tandem.fit\(\) has 8 classes") as caught:
        tandem.fit(mine.four(), *mine.eight(), out=str(tmp_path / "fit"), no_progress=True)
    assert "hint: hand tandem.fit a model with 8 outputs" in str(caught.value)
    assert not (tmp_path / "fit").exists()


# -- bad 4: --dummy is main.py's --dummy, resnet18 included --------------------------------------
def test_dummy_without_arch_trains_main_pys_resnet18_at_224_on_1000_classes(tmp_path):
    out = tmp_path / "run"
    proc = ok("train", "--dummy", "-b", 2, "--synthetic-size", 3, "--max-steps", 1, "--devices",
              "cpu", "--no-progress", "--out", out)
    assert proc.stdout.splitlines()[0].startswith(
        "--dummy: resnet18 (the imagenet example's default -a), on random 3x224x224 images of "
        "1000 classes")
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["arch"] == "resnet18"
    assert (config["resolved"]["dataset"]["image_size"],
            config["resolved"]["dataset"]["num_classes"]) == (224, 1000)


# -- messages ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run"
    ok("train", *TINY, "--epochs", 1, "--out", run)
    return run


def test_a_bad_flag_is_named_before_the_run_in_out(done_run):
    line = one_line_error(run_in_process("train", *TINY, "--devices", "cpu:0", "--out",
                                         done_run), "bad --devices 'cpu:0'")
    assert "already holds a run" not in line
    result = run_in_process("train", *TINY, "--strategy", "dpp", "--out", done_run)
    assert one_line_error(result) == "tandem: error: unknown --strategy 'dpp': did you mean dp?"
    assert hint_of(result).endswith("ddp, hybrid-ddp or auto")


def test_a_resume_that_changes_several_settings_names_them_all_at_once(done_run):
    result = run_in_process("train", "--resume", done_run, "-b", 4, "--seed", 9, "--lr", 0.5)
    line = one_line_error(result)
    assert line.startswith("tandem: error: --batch-size 4, --lr 0.5 and --seed 9 would change "
                           "the run of")
    assert line.endswith("which has --batch-size 6, --lr 0.05 and --seed 0")
    assert hint_of(result) == "resume without them, or start a new run with another --out"


def test_an_int_is_an_int(mine, tmp_path):
    one_line_error(run_in_process("train", "--data", f"{mine.__name__}:COUNT", "--out",
                                  tmp_path / "x"), f"'{mine.__name__}:COUNT' is an int, not a "
                                                   f"function")


# -- a run directory with its config.json and no checkpoint ---------------------------------------
def test_a_run_that_never_saved_says_so_and_how_to_start_it_again(done_run, tmp_path):
    run = tmp_path / "unsaved"
    run.mkdir()
    shutil.copy(done_run / "config.json", run / "config.json")  # as a run killed before a save
    for command in ("train", "eval"):
        result = run_in_process(command, "--resume", run)
        line = one_line_error(result, f"run '{run}' has no checkpoint yet")
        assert "is a directory" not in line
        assert hint_of(result).startswith("start it again with the command that started it")


# -- tandem eval ----------------------------------------------------------------------------------
def test_eval_says_no_decoder_line_and_its_json_takes_a_path(tmp_path):
    folder = make_image_folder(tmp_path / "photos", per_class=5, size=20)
    run = tmp_path / "run"
    trained = ok("train", "--data", folder, "-a", "cifar_resnet20", "--image-size", "16", "-b",
                 "4", "--max-steps", "1", "--no-progress", "--out", run)
    assert "--decode auto: " in trained.stdout  # a run says which decoder it uses
    for argv in (("eval", "--resume", run), ("train", "-e", "--resume", run)):
        said = ok(*argv)
        assert "--decode" not in said.stdout + said.stderr  # a validation pass is no run
    evaluated = ok("eval", "--resume", run, "--json", tmp_path / "scores.json")
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert evaluated.stdout.strip().endswith(f"({scores['count']} images)")
    assert json.loads(ok("eval", "--resume", run, "--json").stdout) == scores


# -- data -----------------------------------------------------------------------------------------
def test_an_empty_class_folder_is_refused_as_torchvision_refuses_it(tmp_path):
    folder = make_image_folder(tmp_path / "photos", per_class=4, size=20)
    (folder / "emu").mkdir()
    result = run_in_process("train", "--data", folder, "--out", tmp_path / "run")
    one_line_error(result, f"ImageFolder '{folder}': class folder 'emu' holds no image files")


# -- bench's figures with their doubt ---------------------------------------------------------
def test_bench_marks_a_speed_up_beyond_the_devices_and_a_split_beyond_its_handicap():
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp", devices="cpu:2",
                         baselines="none", batch_size=4, steps=1, warmup=0, image_size=8,
                         num_classes=5, handicap="1:2")
    report = run_bench(config)
    times = {"single": 3.8, "dp": 1.0, "dp/auto": 0.9, "dp/ideal": 0.4}  # a loaded single
    for r in report["results"]:
        r["step_time_s"] = summarize([times[r["name"]]] * 5).as_dict()
        r["speedup_vs_single"] = 3.8 / times[r["name"]]
    lines = format_table(report).splitlines()
    rows = {line.split()[0]: line for line in lines if line.split()[0] in times}
    assert " 3.80x ?" in rows["dp"] and "?" not in rows["single"]
    [doubt] = [line for line in lines if line.startswith("? vs single beyond")]
    assert "dp 3.80x on 2 device(s)" in doubt
    [split] = [line for line in lines if line.startswith("split vs even split")]
    assert "dp/auto 1.11x, dp/ideal 2.50x ?" in split and "a split gains 1.33x at most" in split  # 3+1 of 4
    assert any(line.startswith("? beyond what the handicap allows: dp/ideal 2.50x")
               for line in lines)


def test_the_hybrid_verdict_says_about_the_same_rather_than_1_0x_fewer():
    from tandem.hybrid import plan
    from tandem.models import create_model

    verdict = plan(create_model("cifar_resnet20"), ["cpu", "cpu"], batch_size=32,
                   input_size=16).verdict
    assert "1.0x" not in verdict
    assert verdict.startswith("hybrid and data parallel move about the same bytes (")


# -- one-machine launches: the err=-3 note ---------------------------------------------------
def test_a_one_machine_launch_notes_the_err_3_warnings_where_loopback_has_no_name(monkeypatch):
    import torch.distributed.run as torchrun_module

    from tandem.distributed import network

    monkeypatch.setattr(network, "has_reverse_name", lambda address: False)
    monkeypatch.setattr(torchrun_module, "run", lambda args: None)  # no workers started
    for name in ("TANDEM_LAUNCH", "TANDEM_LAUNCH_ID", "TANDEM_NODE"):
        monkeypatch.delenv(name, raising=False)
    proc = run_in_process("launch", "--nproc-per-node", "1", "--", "models")
    assert proc.returncode == 0, proc.stderr
    assert ("tandem launch: note: 127.0.0.1 has no host name here (no DNS answer): torch's "
            "err=-3 warnings are harmless") in proc.stdout
    assert "'The hostname of the client socket cannot be retrieved. err=-3'" in proc.stdout
