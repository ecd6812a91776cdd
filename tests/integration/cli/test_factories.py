"""`-a package.module:function` and `--data package.module:function` (tests/support/own_model.py)
run as the zoo does: train, eval in a fresh process, resume, and a 2-process launch import them
again from the run's config; a reference that fails is one line naming it (exit 2, no traceback)."""

import json
import os
import sys

import pytest
import torch
from conftest import SUPPORT, ok, one_line_error, run_in_process, run_tandem, succeeded
from own_model_ddp import ddp_run

from tandem.factory import resolve
from tandem.errors import UsageError

pytestmark = pytest.mark.slow

OWN = ["-a", "own_model:make_net", "--data", "own_model:pairs", "-b", "7", "--no-progress",
       "--seed", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("own") / "run"
    ok("train", *OWN, "--epochs", "2", "--max-steps", "3", "--out", out)
    return out


def test_train_records_both_references(run):
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["arch"] == "own_model:make_net"
    assert config["data"]["data"] == "own_model:pairs"
    assert config["resolved"]["dataset"] == {"name": "own_model:pairs", "num_classes": 3,
                                             "in_channels": 1, "image_size": 8}
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["arch"] == "own_model:make_net"
    assert state["state_dict"]["classifier.3.weight"].shape == (3, 12)  # num_classes=3 given


def test_eval_and_resume_import_them_again(run, tmp_path):
    # a fresh interpreter, in own_model.py's folder
    result = succeeded(run_tandem("eval", "--resume", run, cwd=SUPPORT))
    assert f"{run}: own_model:make_net val loss" in result.stdout and "(11 images)" in result.stdout
    # the resume reads both references from the run's config (this process: no flag names them)
    result = ok("train", "--resume", run, "--out", tmp_path / "more")
    assert "step 5:" in result.stdout and "epoch 2/2 step 10:" in result.stdout


@pytest.mark.distributed
def test_launch_imports_them_on_every_rank(tmp_path_factory):
    """The 2-process launch of tests/support/own_model_ddp.py (shared with
    test_float32_accuracy.py): it trains, so both ranks imported the factories named in the command,
    with no PYTHONPATH."""
    result, out = ddp_run(tmp_path_factory)
    succeeded(result)
    assert "epoch 1/1 (partial: 3/5 batches) step 3:" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["resolved"]["world_size"] == 2
    assert config["model"]["arch"] == "own_model:smooth_net"
    assert config["data"]["data"] == "own_model:pairs"


@pytest.mark.parametrize("flags, line", [
    (["-a", "no_such_module:make"], "tandem: error: model factory 'no_such_module:make': "
                                    "importing no_such_module failed: ModuleNotFoundError"),
    (["-a", "own_model:make_nett"], "tandem: error: model factory 'own_model:make_nett': "
                                    "own_model has no 'make_nett': did you mean make_net"),
    (["-a", "own_model:not_a_model"], "tandem: error: model factory 'own_model:not_a_model' "
                                      "returned a str, not a torch.nn.Module"),
    (["-a", "own_model:needs_depth"], "tandem: error: model factory 'own_model:needs_depth' "
                                      "cannot be called with num_classes=3"),
    (["-a", "own_model:Pairs.nothing"], "tandem: error: model factory "
                                        "'own_model:Pairs.nothing': Pairs has no 'nothing'"),
    (["--data", "own_model:not_data"], "tandem: error: data factory 'own_model:not_data' "
                                       "returned an int, not (train, val)"),
    (["--data", "own_model:nope"], "tandem: error: data factory 'own_model:nope': own_model "
                                   "has no 'nope'"),
])
def test_a_reference_that_fails_is_one_line(flags, line, tmp_path):
    args = ["-a", "own_model:make_net", "--data", "own_model:pairs", *flags]
    result = run_in_process("train", *args, "--epochs", "1", "--out", tmp_path / "r")
    assert one_line_error(result).startswith(line), result.stderr  # maybe a hint under it
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()


def test_eval_of_a_reference_that_no_longer_imports_is_one_line(run, tmp_path, monkeypatch):
    """In this process, as a fresh one in ``tmp_path`` would be: own_model neither imported
    nor on sys.path (monkeypatch restores both)."""
    monkeypatch.chdir(tmp_path)  # own_model.py is not here
    # every entry that holds an own_model.py: the support folder, and a folder another test in
    # this worker ran from (tandem puts the working directory on sys.path, as python -m does)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(SUPPORT)) and
                                      not os.path.isfile(os.path.join(p, "own_model.py"))])
    monkeypatch.delitem(sys.modules, "own_model", raising=False)
    result = run_in_process("eval", "--resume", run)
    assert one_line_error(result, "PYTHONPATH").startswith(
        "tandem: error: data factory 'own_model:pairs': importing own_model failed: "
        "ModuleNotFoundError")
    assert "Traceback" not in result.stderr


def test_the_working_directory_goes_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "cwd_only_module.py").write_text("def make():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_only_module", raising=False)
    assert resolve("cwd_only_module:make", "model factory")() == 1
    assert sys.path[0] == str(tmp_path)
    with pytest.raises(UsageError, match="not of the form package.module:function"):
        resolve("digits", "data factory")
