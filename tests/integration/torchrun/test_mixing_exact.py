"""With mixup and cutmix on (``--mixup 0.2 --cutmix 1.0``), every strategy equals `single` on the
global batch (float64, 1e-9 on weights and buffers after 4 steps): dp and balanced over 3 CPU
replicas and hybrid in one process, ddp and hybrid-ddp over 2 gloo processes.

16 samples in batches of 7: 7, 7, 2 in the first epoch (chunks 3+2+2 and, for the batch of 2,
a replica with none; under 2 ranks 4+3 and 1+1), then 7. At seed 3 the four batches draw
cutmix three times and mixup once (checked below), and most partners of a rank's samples sit
on the other rank. Controls (tests/support/exact.py): the float32 run's distance (noise
floor); mixing changes the run (against no mixing, by more than 1e-4); and the negative
control, partners drawn per rank (each of 2 ranks pairing its own share, as a per-process mix
such as timm's does under DDP), which must differ. A run stopped after 2 steps and resumed on 3
replicas is the straight run, and ``tandem.fit`` mixes a user's data set alike.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ok
from ddp_runs import launch_runs
from exact import check_invariance, max_diff, state

from tandem.data import loader as loader_module
from tandem.data.mixing import Mixing, Pairing
from tandem.parallel.shares import shares

pytestmark = pytest.mark.slow

MIX = ["--mixup", "0.2", "--cutmix", "1.0"]
BASE = ["train", "--data", "synthetic", "--synthetic-size", "16", "--image-size", "8",
        "--num-classes", "4", "-a", "cifar_resnet20", "-b", "7", "--epochs", "2",
        "--no-progress", "--seed", "3", "--lr-schedule", "constant", *MIX]
RUN = [*BASE, "--max-steps", "4"]
F64 = ["--dtype", "float64"]


def per_rank_pair(draw, lo: int, hi: int, num_classes: int) -> Pairing:
    """The negative control's pairing: each of 2 ranks pairs its own share of the batch by a
    permutation of its own, with the batch's lam (partners never cross a rank)."""
    gather = []
    for rank, n in enumerate(shares(hi - lo, [1, 1])):
        start = len(gather)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(rank))
        gather += [start + int(i) for i in order]
    return Pairing(draw, tuple(gather), (), num_classes)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """single in float64 (the reference), in float32 (the noise floor), without mixing (the
    mixing control), and with partners drawn per rank (the negative control)."""
    out = tmp_path_factory.mktemp("single")
    ok(*RUN, *F64, "--out", out / "f64")
    ok(*RUN, "--out", out / "f32")
    ok(*RUN, *F64, "--mixup", "0", "--cutmix", "0", "--out", out / "unmixed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader_module, "pair", per_rank_pair)
        ok(*RUN, *F64, "--out", out / "per_rank")
    return out


def _matches_single(single, candidate) -> dict:
    return check_invariance(single / "f64" / "checkpoint.pt", {"candidate": candidate},
                            reference32=single / "f32" / "checkpoint.pt",
                            negative64=single / "per_rank" / "checkpoint.pt")


def test_the_run_draws_both_mixes_and_mixing_changes_it(single):
    mixing = Mixing(0.2, 1.0, num_classes=4)
    kinds = [mixing.draw(3, e, b, n).kind for e, b, n in ((0, 0, 7), (0, 1, 7), (0, 2, 2),
                                                          (1, 0, 7))]
    assert set(kinds) == {"mixup", "cutmix"}, kinds
    unmixed = max_diff(state(single / "unmixed" / "checkpoint.pt"),
                       state(single / "f64" / "checkpoint.pt"))
    print(f"mixing moves the run by {unmixed:.3g} (float64)")  # pytest -s
    assert unmixed > 1e-4, unmixed


@pytest.mark.parametrize("strategy", [
    ["--strategy", "dp", "--devices", "cpu:3", "--sync-bn"],
    ["--strategy", "balanced", "--devices", "cpu:3", "--sync-bn"],
    ["--strategy", "hybrid", "--devices", "cpu:3", "--sync-bn"],
], ids=["dp", "balanced", "hybrid"])
def test_replica_strategies_equal_single(single, strategy, tmp_path):
    result = ok(*RUN, *F64, *strategy, "--out", tmp_path)
    assert "(mixed targets)" in result.stdout and "(dominant label)" in result.stdout
    _matches_single(single, tmp_path / "checkpoint.pt")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """ddp and hybrid-ddp (`--strategy hybrid` under the launch), each 2 gloo processes, in one
    launch."""
    root = tmp_path_factory.mktemp("launched")
    runs = [(["train", *RUN[1:], *F64, "--strategy", name, "--devices", "cpu", "--sync-bn",
              "--out", root / name], False) for name in ("ddp", "hybrid")]
    result = launch_runs(runs, timeout=400, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    return root


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ddp", "hybrid"], ids=["ddp", "hybrid-ddp"])
def test_two_processes_equal_single(single, launched, name):
    _matches_single(single, launched / name / "checkpoint.pt")


def test_a_mixed_run_resumed_on_three_replicas_is_the_straight_run(single, tmp_path):
    """2 steps on one device, the next 2 (mid-epoch) on 3 replicas: the draws are the batch's,
    so the resumed run mixes as the straight one did."""
    ok(*BASE, *F64, "--sync-bn", "--max-steps", "2", "--out", tmp_path)
    ok("train", "--resume", tmp_path, "--strategy", "dp", "--devices", "cpu:3",
       "--max-steps", "4")
    diff = max_diff(state(tmp_path / "checkpoint.pt"), state(single / "f64" / "checkpoint.pt"))
    assert diff < 1e-9, diff


def test_fit_mixes_a_users_data_set_alike_on_three_replicas(tmp_path):
    import copy

    import tandem
    from torch import nn

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(11, 2, 4, 4, generator=g),
                                          torch.randint(0, 3, (11,), generator=g))
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 3))
    settings = dict(batch_size=5, epochs=1, dtype="float64", mixup=0.4, cutmix=1.0,
                    no_progress=True, seed=1)
    models = {}
    for name, extra in {"single": {}, "balanced": dict(strategy="balanced", devices="cpu:3"),
                        "unmixed": dict(mixup=0.0, cutmix=0.0)}.items():
        models[name] = copy.deepcopy(net)
        tandem.fit(models[name], data, out=str(tmp_path / name), **{**settings, **extra})
    ref = models["single"].state_dict()
    assert max_diff(models["balanced"].state_dict(), ref) < 1e-12
    assert max_diff(models["unmixed"].state_dict(), ref) > 1e-4
