"""The first day, third pass (issue 46, "The new user"): what a new user met, through the CLI
and tandem.fit, against the one-line errors and the lines the README promises."""

import os
import sys

import torch
from conftest import run_in_process

import tandem

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from own_model import Pairs  # noqa: E402


def one_line_error(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# -- a: the resume hints of a tandem.fit run agree ---------------------------------------------
def _sequential():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))


def test_the_fit_call_a_resume_suggests_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # own_model:pairs
    run = tmp_path / "fit1"
    tandem.fit(_sequential(), Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10, epochs=2,
               max_steps=2, no_progress=True, out=str(run))  # stopped in its first epoch
    line = one_line_error(run_in_process("train", "--resume", run, "--data", "own_model:pairs"),
                          "tandem.fit")
    call = line.split("continue it with ", 1)[1].split(", or with `")[0]
    assert call.startswith("tandem.fit(")
    row = eval(call, {"tandem": tandem, "model": _sequential(), "train_data": Pairs(30, seed=0),
                      "val_data": Pairs(11, seed=1)})  # the call the line suggests, as typed
    assert row["epoch"] == 2
