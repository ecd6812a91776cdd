"""The first day, third pass (issue 46, "The new user"): what a new user met, through the CLI
and tandem.fit, against the one-line errors and the lines the README promises."""

import importlib
import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, SUPPORT, hint_of, make_image_folder, one_line_error, run_in_process
from own_model import Pairs

import tandem
from tandem.data.decode import default_decoder
from tandem.errors import UsageError


# -- a: the resume hints of a tandem.fit run agree ---------------------------------------------
def _sequential():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))


def test_the_fit_call_a_resume_suggests_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(SUPPORT)  # own_model:pairs
    run = tmp_path / "fit1"
    tandem.fit(_sequential(), Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10, epochs=2,
               max_steps=2, no_progress=True, out=str(run))  # stopped in its first epoch
    with_data = run_in_process("train", "--resume", run, "--data", "own_model:pairs")
    one_line_error(with_data, "tandem.fit")
    call = hint_of(with_data).split("continue it with ", 1)[1].split(", or with `")[0]
    assert call.startswith("tandem.fit(")
    # the command it offers keeps the flag given, and so does the one typing -a instead gets:
    # following one hint does not lead to the other
    assert f"`tandem train --resume {run} -a package.module:function --data own_model:pairs`" \
        in hint_of(with_data)
    with_arch = run_in_process("train", "--resume", run, "-a", "own_model:make_net")
    one_line_error(with_arch, "tandem.fit on the data sets handed to it")
    assert f"`tandem train --resume {run} -a own_model:make_net --data package.module:function`" \
        in hint_of(with_arch)
    row = eval(call, {"tandem": tandem, "model": _sequential(), "train_data": Pairs(30, seed=0),
                      "val_data": Pairs(11, seed=1)})  # the call the line suggests, as typed
    assert row["epoch"] == 2


# -- b: a data set's `classes` (torchvision's convention) gives the class count -----------------
CLASSES = '''
import torch

def listed(*labels):
    data = torch.utils.data.TensorDataset(torch.randn(len(labels), 1, 8, 8),
                                          torch.tensor(labels))
    data.classes = ["a", "b", "c", "d"]  # as ImageFolder and CIFAR10 carry them
    return data

def seven():
    return listed(0, 1, 2, 3, 7, 1), listed(0, 1, 2, 3)

def below():  # the labels stop at 2, the classes do not
    return listed(0, 1, 2, 0, 1, 2), listed(0, 1, 2, 1)
'''


@pytest.fixture
def classes_module(tmp_path, monkeypatch):
    name = f"classes_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(CLASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_a_label_beyond_the_classes_attribute_is_one_line(classes_module, tmp_path):
    with pytest.raises(UsageError, match=r"tandem.fit\(\) train data\[4\] has target 7, but "
                                         r"there are 4 classes"):
        tandem.fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4)),
                   *classes_module.seven(), out=str(tmp_path / "fit"), no_progress=True)
    result = run_in_process("train", "-a", "own_model:make_net", "--data",
                            f"{classes_module.__name__}:seven", "--out", tmp_path / "cli")
    one_line_error(result, f"{classes_module.__name__}:seven train data[4] has target 7",
                   "4 classes")


def test_the_classes_attribute_sets_the_model_s_class_count(classes_module, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(SUPPORT)  # own_model:make_net
    result = run_in_process("train", "-a", "own_model:make_net", "--data",
                            f"{classes_module.__name__}:below", "-b", "2", "--max-steps", "1",
                            "--no-progress", "--out", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["state_dict"]
    assert state["classifier.3.weight"].shape[0] == len(classes_module.listed().classes)


# -- e: --decode auto says which decoder ran, and config.json records it ------------------------
def test_decode_auto_says_which_decoder_ran_and_records_it(tmp_path):
    folder = make_image_folder(tmp_path / "photos", per_class=5, size=20)
    out = tmp_path / "run"
    result = run_in_process("train", "--data", folder, "-a", "cifar_resnet20", "--image-size",
                            "16", "-b", "4", "--max-steps", "1", "--no-progress", "--out", out)
    assert result.returncode == 0, result.stderr
    opening = result.stdout.split("epoch 1/")[0]
    decoder = default_decoder()
    assert f"--decode auto: JPEGs decoded on the CPU ({decoder}, in the loader" in opening, \
        result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["resolved"]["decode"] == "cpu" and config["data"]["decode"] == "auto"
    raced = run_in_process("train", "--data", folder, "-a", "cifar_resnet20", "--image-size",
                           "16", "-b", "4", "--max-steps", "1", "--no-progress", "--devices",
                           "cpu:2", "--strategy", "auto", "--out", tmp_path / "raced")
    assert raced.returncode == 0, raced.stderr
    assert raced.stdout.count("--decode auto: ") == 1  # the race reads no JPEG


# -- f: --resume of a run another live process holds and has not saved yet ---------------------
def test_resuming_a_run_in_use_before_its_first_save_names_the_process(tmp_path):
    run = tmp_path / "lock"
    run.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        host = socket.gethostname()
        (run / "run.lock").write_text(json.dumps({"pid": owner.pid, "host": host}))
        for command in ("train", "eval"):
            line = one_line_error(run_in_process(command, "--resume", run),
                                  f"run '{run}' is in use by process {owner.pid} on {host}",
                                  "no checkpoint yet")
            assert "is a directory" not in line
    finally:
        owner.kill()
        owner.wait()


# -- g: mistyped flags -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (("train", "--epohcs", "2"), ("tandem train: error: unrecognized arguments: --epohcs",
                                  "did you mean --epochs?", "(see tandem train --help)")),
    (("eval", "--resume", "x", "--batchsize=4"), ("did you mean --batch-size?",
                                                  "(see tandem eval --help)")),
    (("models", "-a", "resnt50"), ("tandem models: error: models takes model names, not -a",
                                   "tandem models resnet50", "(see tandem models --help)")),
])
def test_a_mistyped_flag_gets_a_did_you_mean_and_its_subcommand_s_help(argv, words):
    result = run_in_process(*argv)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]


# -- h: make's set-up reads no "Error" when some file of a package does not compile ------------
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_set_up_compiles_bytecode_without_an_error_line(tmp_path):
    """The repository's Makefile with a stand-in .venv whose python logs its calls and fails
    compileall, as torch's own Python-3.12-only test file makes it fail on 3.11."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
                      '[ "$2" = compileall ] && exit 1\nexit 0\n')
    python.chmod(0o755)
    result = subprocess.run(["make", "install"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "Error" not in said and "ignored" not in said, said
    assert "-m compileall" in (tmp_path / ".venv" / "bin" / "calls").read_text()
    assert (tmp_path / ".venv" / ".tandem-installed").exists()


# -- i: a run whose every validation was non-finite names no best.pt ---------------------------
class NanInEval(torch.nn.Module):
    """Finite in training, nan in validation (as resnet18's eval overflowed on 6 photos)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 3)

    def forward(self, x):
        out = self.linear(x.flatten(1))  # [N, 3]
        return out if self.training else out * float("nan")


def test_a_run_with_no_finite_validation_says_no_best_pt_was_written(tmp_path, capsys):
    run = tmp_path / "nan"
    tandem.fit(NanInEval(), Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10, epochs=1,
               no_progress=True, out=str(run))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert not (run / "best.pt").exists() and (run / "checkpoint.pt").exists()
    assert "best val acc" not in last and str(run / "best.pt") not in last, last
    assert "no validation was finite" in last and str(run / "checkpoint.pt") in last, last


# -- j: curves.png draws the lr each step used, across resumes that changed the schedule -------
def test_the_lr_curve_is_the_lr_each_step_used_across_a_resume_that_changed_the_schedule(
        tmp_path, monkeypatch):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from tandem.train import curves

    used, figures = [], []  # the optimizer's own lr at each step; each figure drawn
    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    real = curves.build_figure
    monkeypatch.setattr(curves, "build_figure",
                        lambda *a, **kw: figures.append(real(*a, **kw)) or figures[-1])
    run = str(tmp_path / "run")
    try:
        for epochs, steps in ((2, 2), (2, 4), (3, None)):  # stopped, resumed, then longer
            tandem.fit(_sequential(), Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10,
                       epochs=epochs, max_steps=steps, no_progress=True, out=run,
                       **({"resume": run} if steps != 2 else {}))
    finally:
        hook.remove()
    assert len(used) == 9  # 3 epochs of 3 steps
    ax_lr = figures[-1].axes[2]
    drawn = [list(line.get_ydata()) for line in ax_lr.get_lines()]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert [*used, last["lr"]] == pytest.approx(drawn[0], abs=1e-12), (drawn, used)
