"""The threaded backward's contract: the path is decided once (at construction, or by the run
plan and kept in config.json), not by the thread count at forward time; the join's two walks
over the outputs agree; SyncBatchNorm's replicas meet through the group they were handed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel, DataParallelModel, threaded_backward


class _TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x)}


def test_join_refuses_outputs_walked_in_another_order(monkeypatch):
    model = _TwoOut()
    x = torch.randn(6, 4)
    out = DataParallelModel(model, ["cpu"] * 2, backward_threads=True)(x)
    assert sum(o["a"].sum() + o["b"].sum() for o in out).requires_grad  # the order agrees
    walk = threaded_backward.tensors_in
    monkeypatch.setattr(threaded_backward, "tensors_in", lambda obj: reversed(list(walk(obj))))
    with pytest.raises(RuntimeError, match="another order"):
        DataParallelModel(model, ["cpu"] * 2, backward_threads=True)(x)


def test_replica_moments_meet_in_the_group_they_were_handed():
    # two replicas' backward, each in a plain thread with no replica context: the group handed
    # to ReplicaMoments (not thread-local state) is where they meet
    import threading

    from tandem.parallel.context import ReplicaGroup
    from tandem.parallel.sync_functions import (LocalMoments, ReplicaMoments, SharedMoments,
                                                merge_moments)

    xs = [torch.randn(n, 3, 2, dtype=torch.float64, requires_grad=True) for n in (4, 2)]
    parts = [LocalMoments.apply(x) for x in xs]
    group = ReplicaGroup([torch.device("cpu")] * 2, timeout=30)
    shared = SharedMoments(None, [p.detach() for p in parts])
    stats = [ReplicaMoments.apply(shared, group, i, ("bn", 0), None, p)
             for i, p in enumerate(parts)]
    errors = []

    def back(i):
        try:
            stats[i][1].sum().backward()  # the mean
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=back, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # d(sum of the global mean, counted once per replica)/dx = 2 / n for every sample
    total = sum(x.shape[0] * x.shape[2] for x in xs)
    for x in xs:
        torch.testing.assert_close(x.grad, torch.full_like(x, 2 / total))
    assert merge_moments(torch.stack([p.detach() for p in parts]))[0, 0] == total


def _joined(out: torch.Tensor) -> bool:
    """Whether ``out``'s graph goes through the threaded backward's one join node."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "_JoinBackward":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


@pytest.mark.parametrize("built, forward", [(1, 4), (4, 1)])
def test_library_path_is_decided_when_built_not_at_forward(built, forward):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(built)
        dp = DataParallel(nn.Linear(4, 2), ["cpu"] * 2)  # default: decided here
        torch.set_num_threads(forward)
        out = dp(torch.randn(6, 4))
    finally:
        torch.set_num_threads(before)
    threaded = built < 2  # one intra-op thread for two CPU replicas: the threads add a core
    assert dp.backward_threads is threaded
    assert _joined(out) is threaded  # the path actually taken
    assert threaded_backward.decide(["cpu"] * 2, threads=built) is threaded


def test_explicit_choice_and_split_decide_the_path_whatever_the_threads():
    assert DataParallel(nn.Linear(4, 2), ["cpu"] * 2, backward_threads=False).backward_threads \
        is False
    assert _joined(DataParallel(nn.Linear(4, 2), ["cpu"] * 2, split=(1, 1))(torch.randn(4, 4)))
    assert DataParallel(nn.Linear(4, 2), ["cpu"]).backward_threads is False  # one replica


def _train(threads: int, *argv):
    """`tandem train ARGV` in this process with ``threads`` intra-op threads, counting the
    forwards that took the threaded backward (its join)."""
    from tandem.cli.main import main

    joins = []
    join = threaded_backward.join
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    threaded_backward.join = lambda *a: joins.append(1) or join(*a)
    try:
        code = main([str(a) for a in argv])
    finally:
        threaded_backward.join = join
        torch.set_num_threads(before)
    assert code == 0
    return len(joins)


TINY = ["-a", "cifar_resnet20", "--data", "synthetic", "--synthetic-size", "16",
        "--image-size", "8", "--num-classes", "3", "-b", "8", "--strategy", "dp",
        "--devices", "cpu:2", "--no-progress", "--max-steps", "1"]


def _recorded(run) -> str | None:
    import json

    return json.loads((run / "config.json").read_text())["parallel"]["backward_threads"]


def test_run_records_its_path_and_resume_keeps_it(tmp_path, capsys):
    run = tmp_path / "run"
    # one thread for two CPU replicas: the plan picks the threads, and config.json says so
    assert _train(1, "train", *TINY, "--epochs", "1", "--out", run) > 0
    assert _recorded(run) == "on"
    # resumed with 4 threads, where a fresh run would pick autograd's one thread: kept
    assert _train(4, "train", "--resume", run, "--epochs", "2", "--no-progress") > 0
    assert _recorded(run) == "on"
    fresh = tmp_path / "fresh"
    assert _train(4, "train", *TINY, "--epochs", "1", "--out", fresh) == 0
    assert _recorded(fresh) == "off"
    off = tmp_path / "off"
    assert _train(1, "train", *TINY, "--epochs", "1", "--out", off,
                  "--backward-threads", "off") == 0
    assert _recorded(off) == "off"


def test_a_config_from_before_the_field_loads_and_is_decided_by_the_plan():
    from tandem.config import TrainConfig

    saved = TrainConfig().to_dict()
    del saved["parallel"]["backward_threads"]
    assert TrainConfig.from_dict(saved).parallel.backward_threads is None


@pytest.mark.parametrize("threads", [1, 4])
def test_bench_explain_says_the_path_a_replica_wrapper_built_then_takes(threads, monkeypatch):
    from tandem_bench import run_setup

    monkeypatch.delenv("TANDEM_MALLOC", raising=False)
    text = run_setup(["cpu", "cpu"], threads)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # as run_bench sets the race's threads
        built = DataParallel(nn.Linear(4, 2), ["cpu"] * 2).backward_threads
    finally:
        torch.set_num_threads(before)
    assert ("in its own thread" in text) is built is (threads == 1)
    assert "autograd's one thread" in text or built
    assert "tandem.cpu_malloc" in text.splitlines()[-1]
    monkeypatch.setenv("TANDEM_MALLOC", "default")
    assert "glibc's own" in run_setup(["cpu"], None)
