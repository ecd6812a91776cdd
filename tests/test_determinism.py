"""The same command twice gives the same bits: a run's checkpoint (weights, buffers, optimizer,
schedule and RNG state) against the same command run again beside two busy CPU loops, for every
strategy with and without ``--sync-bn``.

Replica threads finish in an order that depends on timing; reductions over replicas (parameter
gradients, SyncBN moments, averaged buffers, loss terms) must not. The config is digits, batch
64, lr 0.05, 6 steps, where one different last bit grows about 500x per step. Control: the
comparison sees a one-ulp change in one weight.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from conftest import run_in_process
from ddp_runs import launch_runs
from exact import same_bits

pytestmark = pytest.mark.slow

DIGITS = ["--data", "digits", "-a", "cifar_resnet20", "-b", "64", "--lr", "0.05",
          "--epochs", "1", "--max-steps", "3", "--no-progress", "--seed", "5"]
# AlexNet's layout with a 256-wide classifier (small_alexnet: hybrid splits it all the same,
# without 57M parameters to train and save): 2 steps at 64 px on synthetic data. No dropout:
# replica threads on the CPU draw masks from the one global generator in the order they run
ALEXNET = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "64",
           "--num-classes", "10", "-a", "small_alexnet:make", "-b", "8", "--epochs", "1",
           "--max-steps", "2", "--no-progress", "--seed", "5"]


@contextlib.contextmanager
def busy_loops(n: int = 2):
    """``n`` processes spinning on the CPU for the duration (this machine has 2 cores)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def _checkpoint(out) -> dict:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    # wall-clock seconds of the partial epoch and the launch's id are not results (the run's
    # directory is not in its settings: --out is per call)
    if ckpt.get("epoch_progress"):
        ckpt["epoch_progress"].pop("seconds")
    ckpt["config"]["resolved"].pop("launch_id")
    return ckpt


def _twice(run, tmp_path) -> list[str]:
    run(tmp_path / "first")
    first = _checkpoint(tmp_path / "first")
    with busy_loops():
        run(tmp_path / "second")
    return same_bits(first, _checkpoint(tmp_path / "second"))


THREADED = {
    "single": ["--strategy", "single", "--devices", "cpu"],
    "dp cpu:2": ["--strategy", "dp", "--devices", "cpu:2"],
    "dp cpu:3": ["--strategy", "dp", "--devices", "cpu:3"],
    "dp cpu:3 average": ["--strategy", "dp", "--devices", "cpu:3", "--buffers", "average"],
    "balanced cpu:3": ["--strategy", "balanced", "--devices", "cpu:3"],
}


@pytest.mark.parametrize("sync_bn", [False, True], ids=["", "sync-bn"])
@pytest.mark.parametrize("name", list(THREADED))
def test_threaded_strategies_give_the_same_bits_twice(name, sync_bn, tmp_path):
    args = [*DIGITS, *THREADED[name], *(["--sync-bn"] if sync_bn else [])]

    def run(out):
        result = run_in_process("train", *args, "--out", out)
        assert result.returncode == 0, result.stderr

    # replica threads need a thread each: with 1 intra-op thread per replica, as in the CLI
    assert _twice(run, tmp_path) == []


@pytest.mark.parametrize("sync_bn", [False, True], ids=["", "sync-bn"])
def test_hybrid_gives_the_same_bits_twice(sync_bn, tmp_path):
    args = [*ALEXNET, "--strategy", "hybrid", "--devices", "cpu:2",
            *(["--sync-bn"] if sync_bn else [])]

    def run(out):
        result = run_in_process("train", *args, "--out", out)
        assert result.returncode == 0, result.stderr

    assert _twice(run, tmp_path) == []


@pytest.fixture(scope="module")
def ddp_twice(tmp_path_factory):
    """Both variants, each trained twice (the second beside two busy CPU loops), in one
    2-process launch: each training joins and leaves its own process group."""
    root = tmp_path_factory.mktemp("ddp")
    runs = []
    for sync_bn in (False, True):
        args = [*DIGITS, "--strategy", "ddp", "--devices", "cpu",
                *(["--sync-bn"] if sync_bn else [])]
        for name, busy in (("first", False), ("second", True)):
            runs.append((["train", *args, "--out", root / str(sync_bn) / name], busy))
    result = launch_runs(runs, timeout=480, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.distributed
@pytest.mark.parametrize("sync_bn", [False, True], ids=["", "sync-bn"])
def test_two_process_ddp_gives_the_same_bits_twice(sync_bn, ddp_twice):
    run = ddp_twice / str(sync_bn)
    assert same_bits(_checkpoint(run / "first"), _checkpoint(run / "second")) == []


def test_the_comparison_sees_one_ulp(tmp_path):
    """Negative control for the tests above: one weight one ulp off is a difference."""
    result = run_in_process("train", *DIGITS, "--max-steps", "1", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    a, b = _checkpoint(tmp_path), _checkpoint(tmp_path)
    assert same_bits(a, b) == []
    w = b["state_dict"]["fc.weight"]
    w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
    assert same_bits(a, b) == ["/state_dict/fc.weight"]
    b["optimizer"]["param_groups"][0]["lr"] *= 1 + 1e-16 * 10
    assert "/optimizer/param_groups[0]/lr" in same_bits(a, b)
