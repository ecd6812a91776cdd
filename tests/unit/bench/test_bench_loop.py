"""tandem bench --loop: each loop twin against its bench step (same update) and the Trainer.

No test here times anything: the twins must exist, report a ratio, and step the real
``Trainer`` to the same weights as the bench step's own SGD step.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from torch import nn

from conftest import run_bounded, with_hooks

from tandem_bench.contestants import strategy_contestant, synthetic_batch
from tandem_bench.loop_twin import loop_contestant
from tandem.precision import amp_precision
from tandem.train.loop import Trainer

IN_PROCESS = ["single", "dp", "balanced", "hybrid"]


def _bench(args, timeout=300):
    env = with_hooks(dict(os.environ, PYTHONWARNINGS="ignore"))
    return run_bounded([sys.executable, "-m", "tandem", "bench", *args], timeout, env)


def _check_twins(results: dict, names: list[str]) -> None:
    for name in names:
        step, loop = results[name], results[name + "/loop"]
        assert step["status"] == loop["status"] == "ok", (step["reason"], loop["reason"])
        assert loop["kind"] == "strategy" and loop["devices"] == step["devices"]
        assert loop["loop_over_step"] == pytest.approx(
            loop["step_time_s"]["median"] / step["step_time_s"]["median"])
        assert step["loop_over_step"] is None
        # same model, batch and update: the same loss after the same number of steps
        assert loop["last_loss"] == pytest.approx(step["last_loss"], rel=1e-4)


def test_cli_bench_loop_races_a_twin_of_every_strategy_with_its_ratio(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(["--arch", "cifar_resnet20", "--strategies", ",".join(IN_PROCESS),
                   "--devices", "cpu:2", "--baselines", "bare", "--batch-size", "4",
                   "--steps", "2", "--warmup", "1", "--image-size", "16", "--loop",
                   "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["loop"] is True
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["bare", *(n + t for n in IN_PROCESS for t in ("", "/loop"))]
    _check_twins(results, IN_PROCESS)
    assert results["bare"]["loop_over_step"] is None
    assert "train loop step vs bench step" in proc.stdout
    for name in IN_PROCESS:
        assert f"{name}/loop: " in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_bench_loop_twin_of_ddp_runs_under_torchrun(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(["--arch", "cifar_resnet20", "--strategies", "ddp", "--devices", "cpu:2",
                   "--baselines", "torch_ddp", "--batch-size", "4", "--steps", "2",
                   "--warmup", "1", "--image-size", "16", "--loop", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    # hybrid-ddp joins ddp, twins and all; no twin of a baseline
    assert list(results) == ["ddp", "ddp/loop", "hybrid-ddp", "hybrid-ddp/loop", "torch_ddp"]
    _check_twins(results, ["ddp", "hybrid-ddp"])
    assert results["ddp/loop"]["phase"] == "torchrun"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))


@pytest.mark.parametrize("name, devices", [("single", ["cpu"]), ("dp", ["cpu", "cpu"])])
def test_a_loop_twin_steps_the_trainer_to_the_bench_steps_weights(monkeypatch, name, devices):
    """Every step of the twin is one ``Trainer.train_batch`` + ``after_step``: the meter
    counts the batch, the position moves on, and the weights are those of the bench step
    after as many steps (and not the starting ones)."""
    seen = {"train_batch": [], "after_step": []}
    for method in seen:
        original = getattr(Trainer, method)

        def spy(self, *args, _original=original, _calls=seen[method]):
            _calls.append((self, args[0]))  # the trainer and its EpochRun
            return _original(self, *args)

        monkeypatch.setattr(Trainer, method, spy)
    devices = [torch.device(d) for d in devices]
    batch = synthetic_batch(6, 8, 5, seed=0)
    start = _model()
    loop_model, step_model = copy.deepcopy(start), copy.deepcopy(start)
    kw = dict(amp=amp_precision("cpu", False), lr=0.1)
    loop = loop_contestant(name, loop_model, devices, batch, **kw)
    step = strategy_contestant(name, step_model, devices, batch, **kw)
    try:
        for _ in range(3):
            loop_loss, step_loss = loop.step(), step.step()
    finally:
        loop.close()
        step.close()
    assert len(seen["train_batch"]) == len(seen["after_step"]) == 3
    trainer, run = seen["train_batch"][0]
    assert {(id(t), id(r)) for t, r in seen["train_batch"] + seen["after_step"]} == {
        (id(trainer), id(run))}
    assert trainer.position.step == trainer.position.batch == 3
    assert run.meter.count == 3 * 6  # every sample of every step, counted on the device
    assert loop_loss.item() == pytest.approx(step_loss.item(), rel=1e-5)
    after = dict(loop_model.named_parameters())
    for key, param in step_model.named_parameters():
        torch.testing.assert_close(after[key], param, rtol=1e-5, atol=1e-6)
    assert not torch.equal(after["5.weight"], dict(start.named_parameters())["5.weight"])
