"""The same command twice gives the same bits: a run's checkpoint (weights, buffers, optimizer,
schedule and RNG state) against the same command run again, for every strategy with and without
``--sync-bn``.

Replica threads finish in an order that depends on timing; reductions over replicas (parameter
gradients, SyncBN moments, averaged buffers, loss terms) must not. The threaded strategies run
twice in forced, opposite orders (``forced_order``): replicas start, and meet at every
rendezvous, in index order, then in reverse. `ddp` runs the second time beside two busy CPU
loops. The config is digits, batch 64, lr 0.05, 3 steps, where one different last bit grows
about 500x per step. Controls: the comparison sees a one-ulp change in one weight, and the two
orders tell apart a rendezvous that reduces in arrival order.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_process
from ddp_runs import launch_runs
from exact import same_bits
from forced_order import arrival_order_reductions, replicas_in_order

pytestmark = pytest.mark.slow

DIGITS = ["--data", "digits", "-a", "cifar_resnet20", "-b", "64", "--lr", "0.05",
          "--epochs", "1", "--max-steps", "3", "--no-progress", "--seed", "5"]
# AlexNet's layout with a 256-wide classifier (small_alexnet: hybrid splits it all the same,
# without 57M parameters to train and save): 2 steps at 64 px on synthetic data. No dropout:
# replica threads on the CPU draw masks from the one global generator in the order they run
ALEXNET = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "64",
           "--num-classes", "10", "-a", "small_alexnet:make", "-b", "8", "--epochs", "1",
           "--max-steps", "2", "--no-progress", "--seed", "5"]


def _checkpoint(out) -> dict:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    # wall-clock seconds of the partial epoch and the launch's id are not results (the run's
    # directory is not in its settings: --out is per call)
    if ckpt.get("epoch_progress"):
        ckpt["epoch_progress"].pop("seconds")
    ckpt["config"]["resolved"].pop("launch_id")
    return ckpt


def _in_both_orders(args, tmp_path, monkeypatch) -> list[str]:
    """Train ``args`` with the replicas in index order, then in reverse order; the keys whose
    bits differ between the two checkpoints."""
    for name, reverse in (("first", False), ("second", True)):
        with replicas_in_order(monkeypatch, reverse):
            result = run_in_process("train", *args, "--out", tmp_path / name)
        assert result.returncode == 0, result.stderr
    return same_bits(_checkpoint(tmp_path / "first"), _checkpoint(tmp_path / "second"))


THREADED = {
    "single": ["--strategy", "single", "--devices", "cpu"],
    "dp cpu:2": ["--strategy", "dp", "--devices", "cpu:2"],
    "dp cpu:3": ["--strategy", "dp", "--devices", "cpu:3"],
    "dp cpu:3 average": ["--strategy", "dp", "--devices", "cpu:3", "--buffers", "average"],
    "balanced cpu:3": ["--strategy", "balanced", "--devices", "cpu:3"],
}


@pytest.mark.parametrize("sync_bn", [False, True], ids=["", "sync-bn"])
@pytest.mark.parametrize("name", list(THREADED))
def test_threaded_strategies_give_the_same_bits_twice(name, sync_bn, tmp_path, monkeypatch):
    # replica threads need a thread each: with 1 intra-op thread per replica, as in the CLI
    args = [*DIGITS, *THREADED[name], *(["--sync-bn"] if sync_bn else [])]
    assert _in_both_orders(args, tmp_path, monkeypatch) == []


@pytest.mark.parametrize("sync_bn", [False, True], ids=["", "sync-bn"])
def test_hybrid_gives_the_same_bits_twice(sync_bn, tmp_path, monkeypatch):
    args = [*ALEXNET, "--strategy", "hybrid", "--devices", "cpu:2",
            *(["--sync-bn"] if sync_bn else [])]
    assert _in_both_orders(args, tmp_path, monkeypatch) == []


def test_the_two_orders_tell_apart_a_reduction_in_arrival_order(tmp_path, monkeypatch):
    """Negative control for the threaded tests: where SyncBN's rendezvous adds its replicas'
    moments in the order they arrive, the two forced orders give other bits."""
    args = [*DIGITS, *THREADED["dp cpu:3"], "--sync-bn", "--max-steps", "1"]
    with arrival_order_reductions(monkeypatch):
        differ = _in_both_orders(args, tmp_path, monkeypatch)
    assert "/state_dict/fc.weight" in differ, differ


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
