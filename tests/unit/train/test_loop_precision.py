"""The loop under half precision against what a user expects: a validation loss that overflowed
is reported, not fatal and never "best"; a step fp16's GradScaler skips still advances the
schedule, and torch's warning about it never shows."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from conftest import run_in_process

from tandem.train.loop import optimizer_step

OWN = ["--data", "own_model:pairs", "-b", "7", "--no-progress", "--seed", "3", "--epochs", "2"]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_non_finite_val_loss_is_reported_and_does_not_stop_the_run(tmp_path):
    """Logits that overflow in validation only (a healthy fp16 run with early BatchNorm
    statistics): both epochs train, each row says ``val_finite: false`` and ``val loss inf``,
    and no best.pt is written. Control: the same net with finite logits is "best"."""
    out = tmp_path / "inf"
    result = run_in_process("train", "-a", "own_model:overflows_in_eval", *OWN, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    # metrics.jsonl writes a non-finite number as null
    assert all(r["val_finite"] is False and r["val_loss"] is None for r in rows), rows
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    assert "val loss inf" in result.stdout or "val loss nan" in result.stdout, result.stdout
    assert not (out / "best.pt").exists() and (out / "checkpoint.pt").exists()
    control = tmp_path / "finite"
    result = run_in_process("train", "-a", "own_model:make_net", *OWN, "--out", control)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(r["val_finite"] is True for r in _rows(control))
    assert (control / "best.pt").exists()


@pytest.mark.cuda
def test_fp16_on_cuda_with_eval_logits_past_65504_trains_on_and_warns_of_nothing(tmp_path):
    """The issue's fp16 case on a GPU: logits that overflow fp16 in validation only. The run
    finishes both epochs with finite train losses; a validation row that is not finite is
    flagged, never best; no lr_scheduler warning from the scaler's skipped steps."""
    out = tmp_path / "fp16"
    result = run_in_process("train", "-a", "own_model:huge_in_eval", *OWN, "--devices", "cuda",
                            "--amp", "--amp-dtype", "fp16", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    assert all(r["val_finite"] is (r["val_loss"] is not None) for r in rows), rows
    assert (out / "best.pt").exists() == any(r["val_finite"] for r in rows)
    assert "lr_scheduler" not in result.stderr, result.stderr[-3000:]


def _skipped_first_step(device="cpu"):
    """A model whose gradient is inf, an SGD, a per-step schedule and a GradScaler."""
    model = torch.nn.Linear(3, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16)
    scaler.scale(model(torch.ones(1, 3, device=device)).sum() * float("inf")).backward()
    return model, optimizer, schedule, scaler


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_step_the_scaler_skips_advances_the_schedule_without_torch_s_warning(device):
    """fp16's first steps are skipped while GradScaler finds its scale: the schedule counts
    steps attempted (the weights stay, the learning rate moves on) and torch's "Detected call
    of `lr_scheduler.step()` before `optimizer.step()`" is not shown. Control: stepping the
    schedule as torch's docs do shows it, so the test can see it."""
    model, optimizer, schedule, scaler = _skipped_first_step(device)
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        optimizer_step(optimizer, scaler, schedule)
    assert [str(w.message) for w in seen if "lr_scheduler" in str(w.message)] == []
    assert torch.equal(model.weight, before)  # skipped
    assert scaler.get_scale() == 2.0 ** 15  # the scaler saw the inf
    assert optimizer.param_groups[0]["lr"] == 0.5  # one step attempted
    model, optimizer, schedule, scaler = _skipped_first_step(device)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
