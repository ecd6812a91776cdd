"""The one agreement across 2 gloo processes: every rank reads the same verdict at the same step
(a stop cast on one rank only, rank 0's saved step), settings that differ refuse on both ranks
naming the setting, rank 0's refusal reaches both; fp16's skipped step (an inf in one rank's
block of hybrid-ddp's split head) is skipped by every rank, and the weights equal single's run
with the same skip in float64; the race drops a candidate that one rank could not place, on
every rank, and frees each DDP reducer before any group goes; hybrid-ddp's forward asks the
other ranks nothing when it is told the batch's size.

This file is both the pytest module and the worker program (as test_hybrid_processes.py):
the fixture runs it under ``torch.distributed.run --standalone --nproc-per-node 2``, each rank
writes ``rank{R}.json``, the tests read them. Controls: without the agreed scaler the ranks
part ways (each its own GradScaler), and the reference with the same inf but no skip differs.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from torch import nn

TOL = 1e-9
STEPS, INF_STEP = 4, 2  # the inf lands in step 2's gradients


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _init():
    torch.manual_seed(0)
    return Net().double()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (6,), generator=g)) for _ in range(STEPS)]


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


def _single(poison):
    """The reference: one model, torch's own GradScaler on the CPU; ``poison(model, step)``
    puts the inf where the hybrid's rank 1 holds it."""
    model, scaler = _init(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(_batches(), start=1):
        opt.zero_grad()
        scaler.scale(criterion(model(x), y)).backward()
        poison(model, step)
        scaler.step(opt)
        scaler.update()
    return model.state_dict(), scaler.get_scale()


def _hybrid(rank, world, agreed: bool):
    """hybrid-ddp on 2 ranks with the strategy's agreed scaler (or, ``agreed`` false, each
    rank's own GradScaler); rank 1 finds an inf in its block of the head's first Linear.
    Returns the plain state, the scale, the scaler's kind and where rank 1's block starts in
    the plain weight (its dim and offset)."""
    from tandem.parallel.shares import shares
    from tandem.distributed.env import read_env
    from tandem.strategies.hybrid_ddp import HybridDDPStrategy

    strategy = HybridDDPStrategy([torch.device("cpu")], env=read_env(os.environ)).launch()
    try:
        wrapped = strategy.setup(_init())
        scaler = (strategy.agreement.grad_scaler("cpu", True) if agreed
                  else torch.amp.GradScaler("cpu"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
        criterion = nn.CrossEntropyLoss()
        block, dim, sizes = next((p, dim, sizes) for name, p, dim, sizes in wrapped.pieces()
                                 if name == "classifier.0.weight")
        cut = shares(6, [1] * world)
        for step, (x, y) in enumerate(_batches(), start=1):
            opt.zero_grad()
            out = strategy.forward_loss(wrapped, criterion, x.split(cut)[rank],
                                        y.split(cut)[rank], batch_size=6)
            scaler.scale(out.loss).backward()
            if step == INF_STEP and rank == 1:
                block.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return (strategy.state_dict(wrapped), scaler.get_scale(), type(scaler).__name__,
                (dim, sizes[0]))
    finally:
        strategy.close()


def _skips(rank, world) -> dict:
    agreed, scale, kind, (dim, offset) = _hybrid(rank, world, agreed=True)
    alone, *_ = _hybrid(rank, world, agreed=False)

    def poison(model, step):  # rank 1's block's first element, in the plain weight
        if step == INF_STEP:
            model.classifier[0].weight.grad[(offset, 0) if dim == 0 else (0, offset)] = \
                float("inf")

    ref, ref_scale = _single(poison)
    no_skip, _ = _single(lambda model, step: None)
    return {"agreed": _diff(agreed, ref), "scale": [scale, ref_scale], "kind": kind,
            "alone": _diff(alone, ref), "no_skip_control": _diff(no_skip, ref)}


def _vote(agreement, rank) -> dict:
    """Four steps' votes: rank 1 alone asks to stop at the third; rank 0 saved step 5 by the
    second."""
    verdicts = [agreement.vote(stop=rank == 1 and call == 3, save=False,
                               saved_step=5 if rank == 0 and call >= 2 else None)
                for call in range(1, 5)]
    settled = agreement.settle()
    return {"stops": [v.stop for v in verdicts], "saved": [v.saved_step for v in verdicts],
            "settled": [settled.stop, settled.saved_step]}


def _refusals(agreement, rank) -> dict:
    from tandem.distributed.agree import SettingsDiffer
    from tandem.errors import UsageError

    said = {}
    try:
        agreement.settings({"optim.lr": 0.01 if rank == 0 else 0.02, "optim.batch_size": 8})
    except SettingsDiffer as exc:
        said["settings"] = [str(exc), exc.quiet]
    agreement.settings({"optim.lr": 0.01, "optim.batch_size": 8})  # the same: nothing said

    def refuse():
        raise UsageError("runs/x already holds a run")

    try:
        agreement.rank0(refuse)
    except UsageError as exc:
        said["rank0"] = [str(exc), exc.quiet]
    said["all_of"] = agreement.all_of([True, rank == 0])
    said["rank0_value"] = agreement.rank0(lambda: f"from rank {rank}")
    return said


def _race(agreement, rank, events) -> dict:
    """``auto`` across the 2 processes twice: hybrid-ddp out of memory on rank 1 while placed,
    then both candidates; each DDP reducer freed (release_ddp) before its group goes
    (``events``, to which leaving the job's group adds the last word)."""
    import torch.distributed as dist

    from tandem.precision import amp_precision
    from tandem.strategies import auto, ddp, step_timer

    placed, release, destroy = step_timer.placed, ddp.release_ddp, dist.destroy_process_group

    def oom_on_rank1(name, *args, **kw):
        if name == "hybrid-ddp" and rank == 1 and not events:
            raise torch.OutOfMemoryError("injected")
        return placed(name, *args, **kw)

    def counted_release(wrapped):
        events.append("release")
        release(wrapped)

    def counted_destroy(group=None):
        events.append("leave the job's group" if group is None else "leave a group")
        destroy(group)

    step_timer.placed, ddp.release_ddp = oom_on_rank1, counted_release
    dist.destroy_process_group = counted_destroy
    batch = (torch.randn(6, 3, 4, 4), torch.randint(0, 5, (6,)))
    results = []
    try:
        for _ in range(2):
            result = auto.resolve([torch.device("cpu")], Net(), batch, rounds=3,
                                  agreement=agreement, amp=amp_precision("cpu", False), lr=0.1)
            results.append({"choice": result.choice, "rows": result.rows})
    finally:
        step_timer.placed, ddp.release_ddp = placed, release
    return {"dropped": results[0], "both": results[1], "events": events}


def _shares_asked(rank, world) -> dict:
    """hybrid-ddp's forward told the global batch's size asks the other ranks nothing."""
    from tandem.hybrid import across_processes
    from tandem.distributed.env import read_env
    from tandem.strategies.hybrid_ddp import HybridDDPStrategy

    asked = []
    all_shares = across_processes.all_shares
    across_processes.all_shares = lambda *a, **k: asked.append(1) or all_shares(*a, **k)
    strategy = HybridDDPStrategy([torch.device("cpu")], env=read_env(os.environ)).launch()
    try:
        wrapped = strategy.setup(_init())
        x, y = _batches()[0]
        mine = x[:3] if rank == 0 else x[3:], y[:3] if rank == 0 else y[3:]
        strategy.forward_loss(wrapped, nn.CrossEntropyLoss(), *mine, batch_size=6)
        told = len(asked)
        strategy.forward_loss(wrapped, nn.CrossEntropyLoss(), *mine)
        return {"told": told, "untold": len(asked) - told}
    finally:
        across_processes.all_shares = all_shares
        strategy.close()


def worker_main(out_dir: str) -> None:
    from tandem.distributed.env import read_env
    from tandem.distributed.process_group import Job

    events: list[str] = []
    with Job() as job:
        agreement = job.join(read_env(os.environ))
        rank, world = agreement.rank, agreement.world_size
        results = {"vote": _vote(agreement, rank), "refusals": _refusals(agreement, rank),
                   "race": _race(agreement, rank, events), "skips": _skips(rank, world),
                   "shares": _shares_asked(rank, world)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)  # events: the job's group left last


# ---------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import built_once

    return built_once(tmp_path_factory, "agreement", _ranks)


def _ranks(out):
    from conftest import SUPPORT, cli_env, run_bounded

    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join((str(SUPPORT), env["PYTHONPATH"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", os.path.abspath(__file__), str(out)]
    proc = run_bounded(cmd, 240, env)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


def test_every_rank_reads_the_same_verdict_one_step_after_the_vote(ranks):
    for r in ranks:
        assert r["vote"]["stops"] == [False, False, False, True]  # cast at 3, read at 4
        assert r["vote"]["saved"] == [None, None, 5, 5]  # rank 0's, one step late
        assert r["vote"]["settled"] == [False, 5]


def test_settings_that_differ_refuse_on_both_ranks_naming_the_setting(ranks):
    lines = {r["refusals"]["settings"][0] for r in ranks}
    assert len(lines) == 1  # the same line on every rank
    line = lines.pop()
    assert line.startswith("rank 1 (node ") and " has lr 0.02 where rank 0 (node " in line
    assert line.endswith("has 0.01: every node must run the same command (only --node-rank "
                         "differs)")
    for r in ranks:
        assert r["refusals"]["rank0"] == ["runs/x already holds a run", r is not ranks[0]]
        assert r["refusals"]["all_of"] == [True, False]
        assert r["refusals"]["rank0_value"] == "from rank 0"


def test_an_inf_in_one_rank_s_head_block_makes_every_rank_skip_the_step(ranks):
    for rank, r in enumerate(ranks):
        s = r["skips"]
        assert s["kind"] == "ShardedGradScaler"
        assert s["agreed"] < TOL, (rank, s)
        assert s["scale"][0] == s["scale"][1], (rank, s)  # backed off alike
        assert s["no_skip_control"] > 1000 * TOL, s  # the skip matters
        assert s["alone"] > 1000 * TOL, (rank, s)  # negative control: each rank's own scaler


def test_a_candidate_one_rank_cannot_place_drops_on_every_rank(ranks):
    for r in ranks:
        race = r["race"]["dropped"]
        assert race["choice"] == "ddp"
        notes = {row["name"]: row.get("note") for row in race["rows"]}
        assert notes["hybrid-ddp"] == "dropped: out of memory on another rank"  # rank 0's table
        assert "median_s" in next(row for row in race["rows"] if row["name"] == "ddp")
        assert all("median_s" in row for row in r["race"]["both"]["rows"])


def test_the_race_frees_every_ddp_reducer_before_its_group_goes(ranks):
    for r in ranks:
        events = r["race"]["events"]
        # the first race launched ddp alone; the second both (hybrid-ddp's activations group
        # goes after its reducer; the job's group, last of all, outlives every candidate)
        assert events[-1] == "leave the job's group", events
        assert events.count("release") == 3 and "leave a group" in events, events
        assert events.index("leave a group") > events.index("release", 1), events


def test_hybrid_ddp_told_the_batch_s_size_asks_the_other_ranks_nothing(ranks):
    for r in ranks:
        assert r["shares"] == {"told": 0, "untold": 1}


if __name__ == "__main__":
    worker_main(sys.argv[1])
