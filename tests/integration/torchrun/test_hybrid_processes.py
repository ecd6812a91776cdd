"""The hybrid across 2 and 3 gloo processes (hybrid-ddp) equals single on the global batch (float64).

This file is both the pytest module and the worker program: the fixture starts it under
``python -m torch.distributed.run --standalone --nproc-per-node W`` (127.0.0.1, a free port),
every rank runs the cases below against a single-device reference it computes itself (float64,
``--sync-bn``), writes its figures to ``rank{R}.json``, and the tests read them. Covered:
outputs, losses, first-step gradients, weights, BN buffers and optimizer state after a few
steps, with uneven shares, a batch smaller than the process count, accumulation (no_sync), a
head BatchNorm and a split layer narrower than the process count; checkpoints in the plain
layout (hybrid -> single, single -> hybrid, hybrid -> hybrid bit for bit); and the bytes each
rank sends against :func:`tandem.hybrid.cost.step_bytes`. Controls: the float32 noise
floor, and two wrong hybrids (gradients averaged over ranks; gathered rows' gradients not
returned to their owners) that must differ.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

import pytest
import torch
from torch import nn

from tandem.distributed.env import read_env

TOL = 1e-9
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
# name: (global batch sizes of each step's micro-batches by world size, classes, head BN);
# a BatchNorm1d needs 2 samples, so a batch of 1 goes without it (3 processes: 2 = 1+1+0 with it)
CASES = {
    "uneven": ({2: [[7], [5], [6]], 3: [[7], [2], [8]]}, 5, True),
    "batch_below_processes": ({2: [[1], [1]], 3: [[2], [2]]}, 2, False),
    "accumulate": ({2: [[5, 3], [4]], 3: [[5, 2], [4]]}, 5, False),
}


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
class Net(nn.Module):
    """AlexNet's layout in miniature: the head splits into a column/row pair, local layers
    (a BatchNorm1d with parameters, a ReLU) and a gathered column."""

    def __init__(self, classes: int, head_bn: bool):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(0.0), nn.Linear(16, 12), nn.ReLU(), nn.Dropout(0.0), nn.Linear(12, 10),
            *([nn.BatchNorm1d(10)] if head_bn else []), nn.ReLU(), nn.Linear(10, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _init(classes, head_bn, dtype=torch.float64):
    torch.manual_seed(0)
    return Net(classes, head_bn).double().to(dtype)  # float32: float64's weights, rounded


def _batches(steps, classes, dtype=torch.float64):
    g = torch.Generator().manual_seed(1234)  # drawn in float64 whatever ``dtype``
    return [[(torch.randn(b, 3, 6, 6, generator=g, dtype=torch.float64).to(dtype),
              torch.randint(0, classes, (b,), generator=g)) for b in micro] for micro in steps]


def _shard(t, rank, world):
    from tandem.parallel.shares import shares  # the loader's own split rule

    return t.split(shares(t.shape[0], [1] * world))[rank]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _diff(a, b) -> float:
    """Largest absolute difference over floating tensors of two equal-keyed dicts."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a
                if a[k].is_floating_point() and a[k].numel()), default=0.0)


def _momenta(state) -> dict:
    return {str(k): v["momentum_buffer"] for k, v in state["state"].items()}


def _single(init, steps, upto=None, start=None):
    """The reference: one model on whole global batches. ``start``: (state, optimizer state)
    to begin from; ``upto``: how many steps to take. Returns the first forward's logits, the
    first step's gradients, the losses, the model and its optimizer."""
    model = copy.deepcopy(init).train()
    opt = _sgd(model.parameters())
    if start is not None:  # a copy: a loaded optimizer may keep the given tensors and step them
        model.load_state_dict(start[0])
        opt.load_state_dict(copy.deepcopy(start[1]))
    criterion = nn.CrossEntropyLoss()
    logits, grads, losses = None, None, []
    todo = steps if upto is None else steps[:upto] if start is None else steps[upto:]
    for micro in todo:
        opt.zero_grad()
        for x, y in micro:
            out = model(x)
            logits = out.detach() if logits is None else logits
            loss = criterion(out, y)
            (loss / len(micro)).backward()
            losses.append(float(loss))
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return logits, grads, losses, model, opt


def _train(strategy, wrapped, opt, steps, rank, world):
    """Steps of the hybrid on this rank's shares; returns its losses, logits of the first
    forward, and the first step's gradients in the plain layout (this rank's blocks)."""
    criterion = nn.CrossEntropyLoss()
    seen = []
    hook = wrapped.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    losses, grads = [], None
    for micro in steps:
        opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else strategy.no_sync(wrapped):
                out = strategy.forward_loss(wrapped, criterion, _shard(x, rank, world),
                                            _shard(y, rank, world))
                (out.loss / len(micro)).backward()
            losses.append(float(out.loss))
        if grads is None:
            grads = {name: (p.grad.clone(), dim, sizes) for name, p, dim, sizes in
                     wrapped.pieces()}
        opt.step()
    hook.remove()
    return losses, seen[0], grads


def _block(t, dim, sizes, rank):
    return t if dim is None else t.split(sizes, dim)[rank]


def _case(strategy_cls, case, rank, world, dtype=torch.float64) -> dict:
    sizes, classes, head_bn = CASES[case]
    init = _init(classes, head_bn, dtype)
    steps = _batches(sizes[world], classes, dtype)
    strategy = strategy_cls([torch.device("cpu")], sync_bn=True, env=read_env(os.environ)).launch()
    try:
        wrapped = strategy.setup(copy.deepcopy(init))
        opt = _sgd(wrapped.parameters())
        losses, logits, grads = _train(strategy, wrapped, opt, steps, rank, world)
        state = strategy.state_dict(wrapped)
        opt_state = strategy.optimizer_state_dict(wrapped, opt)
    finally:
        strategy.close()
    ref_logits, ref_grads, ref_losses, ref, ref_opt = _single(_init(classes, head_bn), _batches(
        sizes[world], classes))
    first = steps[0][0][0].shape[0]
    return {
        "state": _diff(state, ref.state_dict()),
        "optimizer": _diff(_momenta(opt_state), _momenta(ref_opt.state_dict())),
        "losses": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "logits": _diff({"x": logits}, {"x": _shard(ref_logits, rank, world)}),
        "grads": max(_diff({"g": g}, {"g": _block(ref_grads[n], dim, s, rank)})
                     for n, (g, dim, s) in grads.items()),
        "tracked": [int(v) for k, v in state.items() if k.endswith("num_batches_tracked")],
        "ref_tracked": [int(v) for k, v in ref.state_dict().items()
                        if k.endswith("num_batches_tracked")],
        "rows": int(_shard(torch.empty(first), rank, world).shape[0]),
    }


def _floor(case, world) -> float:
    """How much this config amplifies float32 rounding (single float32 vs float64)."""
    sizes, classes, head_bn = CASES[case]
    *_, ref64, _ = _single(_init(classes, head_bn), _batches(sizes[world], classes))
    *_, ref32, _ = _single(_init(classes, head_bn, torch.float32),
                           _batches(sizes[world], classes, torch.float32))
    return _diff(ref32.state_dict(), ref64.state_dict()) / EPS32


def _checkpoints(rank, world) -> dict:
    """Plain-layout checkpoints across strategies, at the strategy level: 2 steps under one,
    the third under the other (float64), and hybrid's own resume bit for bit."""
    from exact import same_bits
    from tandem.strategies.hybrid_ddp import HybridDDPStrategy

    sizes, classes, head_bn = CASES["uneven"]
    init, steps = _init(classes, head_bn), _batches(sizes[world], classes)
    *_, straight, _ = _single(init, steps)
    *_, ref2, ref2_opt = _single(init, steps, upto=2)
    strategy = HybridDDPStrategy([torch.device("cpu")], sync_bn=True, env=read_env(os.environ)).launch()
    try:
        wrapped = strategy.setup(copy.deepcopy(init))
        opt = _sgd(wrapped.parameters())
        _train(strategy, wrapped, opt, steps[:2], rank, world)
        # copies: whole modules' tensors are the live ones, as state_dict() returns them
        saved = copy.deepcopy((strategy.state_dict(wrapped),
                               strategy.optimizer_state_dict(wrapped, opt)))
        _train(strategy, wrapped, opt, steps[2:], rank, world)  # the straight hybrid run
        straight_h = strategy.state_dict(wrapped), strategy.optimizer_state_dict(wrapped, opt)
        resumed = []
        for start in (saved, (ref2.state_dict(), ref2_opt.state_dict())):
            again = strategy.setup(copy.deepcopy(init))
            again_opt = _sgd(again.parameters())
            strategy.load_state_dict(again, start[0])
            strategy.load_optimizer_state_dict(again, again_opt, copy.deepcopy(start[1]))
            _train(strategy, again, again_opt, steps[2:], rank, world)
            resumed.append((strategy.state_dict(again),
                            strategy.optimizer_state_dict(again, again_opt)))
    finally:
        strategy.close()
    *_, h2s, _ = _single(init, steps, upto=2, start=saved)
    lost = (saved[0], dict(saved[1], state={}))  # negative control: the momentum dropped
    *_, h2s_lost, _ = _single(init, steps, upto=2, start=lost)
    plain_shapes = [list(p.shape) for p in init.parameters()]
    return {
        "hybrid_to_single": _diff(h2s.state_dict(), straight.state_dict()),
        "single_to_hybrid": _diff(resumed[1][0], straight.state_dict()),
        "lost_momentum": _diff(h2s_lost.state_dict(), straight.state_dict()),
        "own_resume_bits": same_bits(resumed[0][0], straight_h[0]) + same_bits(
            resumed[0][1]["state"], straight_h[1]["state"]),
        "own_resume": max(_diff(resumed[0][0], straight_h[0]),
                          _diff(_momenta(resumed[0][1]), _momenta(straight_h[1]))),
        "optimizer_layout": [list(saved[1]["state"][k]["momentum_buffer"].shape)
                             for k in range(len(plain_shapes))] == plain_shapes,
        "keys": list(saved[0]) == list(init.state_dict()),
    }


def _bytes(rank, world) -> dict:
    """One step's recorded traffic per kind, hybrid-ddp and ddp, and what step_bytes says."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from tandem.hybrid.across_processes import GRADIENTS
    from tandem.hybrid.cost import step_bytes
    from tandem.parallel import traffic
    from tandem.strategies.ddp import DDPStrategy
    from tandem.strategies.hybrid_ddp import HybridDDPStrategy

    def counted_average(group, bucket):  # ddp's own average, its bytes counted as ours are
        buffer = bucket.buffer()
        traffic.record(GRADIENTS, 2 * (world - 1) / world * buffer.numel() * 8)
        return allreduce_hook(group, bucket)

    init = _init(5, True)
    (x, y), = _batches([[7]], 5)[0]
    recorded = {}
    for cls in (HybridDDPStrategy, DDPStrategy):
        strategy = cls([torch.device("cpu")], sync_bn=True, env=read_env(os.environ)).launch()
        try:
            wrapped = strategy.setup(copy.deepcopy(init))
            if cls is DDPStrategy:
                wrapped.register_comm_hook(None, counted_average)
            with traffic.TrafficMeter() as meter:
                out = strategy.forward_loss(wrapped, nn.CrossEntropyLoss(), _shard(x, rank, world),
                                            _shard(y, rank, world))
                out.loss.backward()
            recorded[cls.name] = dict(meter.by_kind)
        finally:
            strategy.close()
    planned = step_bytes(init, 7, world, backend="gloo")  # the run is over gloo
    return {"recorded": recorded, "planned": {"hybrid-ddp": planned.hybrid[rank],
                                              "ddp": planned.ddp[rank]}}


def worker_main(out_dir: str) -> None:
    import torch.distributed as dist

    from tandem.hybrid.across_processes import DistributedHybrid
    from tandem.hybrid.rank_collectives import gather_rows
    from tandem.strategies.hybrid_ddp import HybridDDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    class _NoReturn(torch.autograd.Function):
        """Wrong on purpose: the gathered rows' gradients stay where they were used."""

        @staticmethod
        def forward(ctx, x, shares, rank, group):
            ctx.shares, ctx.rank = shares, rank
            with torch.no_grad():
                return gather_rows(x, shares, rank, group)

        @staticmethod
        def backward(ctx, grad):
            return grad.split(ctx.shares)[ctx.rank], None, None, None

    class Averaging(DistributedHybrid):  # wrong: DDP's average where a sum is due
        grad_hook = staticmethod(allreduce_hook)

    class NoReturn(DistributedHybrid):
        gather = staticmethod(lambda x, shares, rank, group: _NoReturn.apply(x, shares, rank,
                                                                             group))

    def strategy_with(engine):
        class Wrong(HybridDDPStrategy):
            def setup(self, model):
                from tandem.parallel.sync_batchnorm import convert_sync_batchnorm

                model = convert_sync_batchnorm(model).to(self.device)
                return engine(model, self.device, group=self.activations,
                              ddp_options=self.ddp_options())
        return Wrong

    dist.init_process_group("gloo")  # torchrun's env://; the strategies reuse it
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {name: _case(HybridDDPStrategy, name, rank, world) for name in CASES}
    results["floor"] = {name: _floor(name, world) for name in CASES}
    results["float32_gap"] = _case(HybridDDPStrategy, "uneven", rank, world, torch.float32)
    results["negative"] = {label: _case(strategy_with(engine), "uneven", rank, world)
                           for label, engine in (("averaged", Averaging),
                                                 ("not_returned", NoReturn))}
    results["checkpoints"] = _checkpoints(rank, world)
    results["bytes"] = _bytes(rank, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[2, 3], ids=["2_processes", "3_processes"])
def ranks(request, tmp_path_factory):
    from conftest import SUPPORT, cli_env, run_bounded

    world = request.param
    out = tmp_path_factory.mktemp(f"hybrid_{world}")
    env = cli_env()  # one intra-op thread, TANDEM_DIST_TIMEOUT=60, the test hooks
    # exact.py, for the workers
    env["PYTHONPATH"] = os.pathsep.join((str(SUPPORT), env["PYTHONPATH"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), os.path.abspath(__file__), str(out)]
    proc = run_bounded(cmd, 240, env)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.load(open(out / f"rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_across_processes_equals_single(ranks, case):
    world = len(ranks)
    floor = ranks[0]["floor"][case] * EPS64
    assert floor < TOL / 2, f"ill-posed: float64 noise {floor:.3g} is not far below {TOL}"
    for rank, results in enumerate(ranks):
        r = results[case]
        for figure in ("state", "optimizer", "losses", "logits", "grads"):
            assert r[figure] < TOL, (world, rank, figure, r)
        assert r["tracked"] == r["ref_tracked"], (rank, r)
    rows = [results[case]["rows"] for results in ranks]
    assert sum(rows) == CASES[case][0][world][0][0]
    if case == "batch_below_processes":
        assert rows[-1] == 0  # a rank with no sample still stepped


def test_float32_gap_is_far_above_the_tolerance(ranks):
    """The noise-floor control: the same hybrid in float32 is visibly off the float64
    reference, so agreeing to 1e-9 in float64 says more than float32 could."""
    for results in ranks:
        assert results["float32_gap"]["state"] > 1000 * TOL, results["float32_gap"]


@pytest.mark.parametrize("wrong", ["averaged", "not_returned"])
def test_wrong_hybrids_are_caught(ranks, wrong):
    for results in ranks:
        r = results["negative"][wrong]
        assert max(r["state"], r["grads"]) > 1000 * TOL, r


def test_checkpoints_move_between_hybrid_and_single_and_resume_bit_for_bit(ranks):
    """Plain layout both ways (float64, momentum-lost negative control). hybrid-ddp's own
    resume keeps every bit over 2 processes; over 3, DDP's ring sums 3 terms in an order that
    its bucket layout sets, and DDP lays its buckets out anew after a model's first step, so a
    resumed step may round differently (as ddp's does): equal to float64 rounding there."""
    for results in ranks:
        c = results["checkpoints"]
        assert c["keys"] and c["optimizer_layout"], c
        assert c["hybrid_to_single"] < TOL and c["single_to_hybrid"] < TOL, c
        assert c["lost_momentum"] > 1000 * TOL, c  # negative control
        if len(ranks) == 2:
            assert c["own_resume_bits"] == [], c
        assert c["own_resume"] < TOL, c


def test_step_bytes_match_the_collectives_of_a_run(ranks):
    for rank, results in enumerate(ranks):
        b = results["bytes"]
        for name in ("hybrid-ddp", "ddp"):
            recorded, planned = b["recorded"][name], b["planned"][name]
            for kind in ("gradients", "activations", "activation_grads"):
                assert recorded.get(kind, 0) == pytest.approx(planned.get(kind, 0), rel=1e-12), \
                    (rank, name, kind, recorded, planned)
        assert b["recorded"]["hybrid-ddp"]["activations"] > 0


# by hand, one rank's bytes (float32): the published parameter counts (torchvision: AlexNet
# 61,100,840, its convs 2,469,696; VGG11 132,863,336, its convs 9,220,480), the ring's 2 (W-1)/W;
# the head Linear 9216 (25088) -> 4096 -> 4096 -> 1000 as pair, ReLU, column: (W-1) m rows of
# its 9216 (25088), 4096 and 4096 features each way (m the largest share, 4 of 8, 32 of 128),
# and the last layer's blocks of 500 (250) columns: (N - m) rows out, m rows' other columns back
@pytest.mark.parametrize("arch, batch, processes, params, convs, first", [
    ("alexnet", 8, 2, 61_100_840, 2_469_696, 9216),
    ("vgg11", 128, 4, 132_863_336, 9_220_480, 25088)])
def test_step_bytes_of_alexnet_and_vgg11_by_hand(arch, batch, processes, params, convs, first):
    from tandem.hybrid.cost import step_bytes
    from tandem.models import create_model

    with torch.device("meta"):
        model = create_model(arch, num_classes=1000)
    w, m, e = processes, batch // processes, 4
    ours = step_bytes(model, batch, processes)
    ring = 2 * (w - 1) / w
    each_way = (w - 1) * m * (first + 4096 + 4096) * e + (batch - m) * (1000 // w) * e
    assert ours.ddp == [{"gradients": ring * params * e, "buffers": 0}] * w
    assert ours.hybrid == [{"gradients": ring * convs * e, "buffers": 0, "activations": each_way,
                            "activation_grads": each_way}] * w
    assert ours.most(ours.hybrid) < ours.most(ours.ddp) / 5  # the trick pays for these heads


@pytest.mark.slow
def test_launch_trains_hybrid_ddp_and_ddp_resumes_it(tmp_path):
    """End to end: `tandem launch -- train --strategy hybrid` trains hybrid-ddp (float64, 3
    steps), ddp finishes the run; the result is single's straight run (float64)."""
    from conftest import ok
    from ddp_runs import launch_runs, outputs
    from exact import TOL64, max_diff, state

    args = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "64",
            "--num-classes", "10", "-a", "small_alexnet:make", "-b", "8", "--epochs", "2",
            "--no-progress", "--seed", "5", "--lr-schedule", "constant", "--dtype", "float64"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    proc = launch_runs([(["train", *args, "--strategy", "hybrid", "--max-steps", "3",
                          "--out", run], False),
                        (["train", "--resume", run, "--strategy", "ddp"], False)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    first, second = outputs(proc.stdout)
    assert "--strategy hybrid: under tandem launch it runs as hybrid-ddp" in first
    assert "the run had hybrid-ddp" in second
    ok("train", *args, "--strategy", "single", "--out", ref)
    assert max_diff(state(run / "checkpoint.pt"), state(ref / "checkpoint.pt")) < TOL64



@pytest.mark.slow
def test_auto_under_launch_races_the_processes_once_and_a_resume_keeps_the_choice(tmp_path):
    """`--strategy auto` under `tandem launch` races ddp and hybrid-ddp on the real processes:
    one block (rank 0's), the choice is the run's strategy, the table, the planned bytes and
    the measured link are in config.json; the resume goes on with the choice, no race."""
    from ddp_runs import launch_runs, outputs

    args = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "64",
            "--num-classes", "10", "-a", "small_alexnet:make", "-b", "8", "--epochs", "2",
            "--no-progress", "--auto-steps", "3"]
    run = tmp_path / "run"
    proc = launch_runs([(["train", *args, "--strategy", "auto", "--max-steps", "2",
                          "--out", run], False),
                        (["train", "--resume", run, "--strategy", "auto"], False)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    first, second = outputs(proc.stdout)
    assert proc.stdout.count("strategy auto: ddp, hybrid-ddp on 2 processes") == 1
    # no time budget bounds a race across processes: what it takes is said before it starts
    said = ("strategy auto: racing across 2 processes, 3 timed rounds of each candidate after "
            "one warm-up, however long they take (no time budget across processes")
    assert first.index(said) < first.index("strategy auto: ddp, hybrid-ddp on 2 processes")
    assert "link: " in first and "chosen: " in first
    config = json.loads((run / "config.json").read_text())
    record = config["resolved"]["auto"]
    assert config["parallel"]["strategy"] == record["choice"] in ("ddp", "hybrid-ddp")
    assert [row["name"] for row in record["table"]] == ["ddp", "hybrid-ddp"]
    assert all(row["median_s"] > 0 for row in record["table"])
    planned = record["planned_bytes"]
    assert planned["hybrid-ddp"] < planned["ddp"] and record["link_bytes_per_s"] > 0
    assert "strategy auto: ddp, hybrid-ddp" not in second  # no race block
    assert f"already has --strategy {record['choice']} (chosen by its race)" in second


if __name__ == "__main__":
    import tandem

    worker_main(sys.argv[1])
    tandem.exit(0)  # a process that joined a gloo group: no finalization racing its threads
