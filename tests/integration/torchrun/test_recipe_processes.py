"""The recipe under ddp and hybrid-ddp (2 gloo processes, one `tandem launch`) against single on
the whole batch (float64, at 1e-9: weights, buffers, optimizer state and EMA): sgd, adamw,
lars and lamb, each with --clip-grad and --model-ema, shares 4+3, hybrid-ddp's head split over
the two ranks (its last bias on rank 0 only).

Controls (tests/support/recipe_runs.py, recipe_controls.py): the float32 noise floor, and
negative controls that must differ by more than 1000x the tolerance, each a wrong norm or EMA
patched into the workers: under ddp every parameter's squares summed over the ranks (a
replicated gradient counted once per rank: the clip's total and lars's and lamb's ratios
wrong); under hybrid-ddp the norms of each rank's blocks alone (each rank clips by its own
norm, the trust ratios are blocks'); and, once, hybrid-ddp's EMA updated on rank 0 only
(rank 1's blocks of the head keep the average of the initial weights). Under ddp every rank
holds the same weights, so an EMA of one rank is the EMA of all: that control is hybrid-ddp's.
"""

from pathlib import Path

import pytest
from conftest import built_once, ok
from ddp_runs import launch_runs
from recipe_runs import OPTS, check_recipe, clipped_steps, recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

F64 = ["--dtype", "float64"]
SINGLE = ["--strategy", "single", "--devices", "cpu"]
DDP = ["--strategy", "ddp", "--devices", "cpu"]
HYBRID_DDP = ["--strategy", "hybrid-ddp", "--devices", "cpu"]
#: (strategy's flags, the patch of a negative control or None)
RUNS = {"ddp": (DDP, None), "hybrid-ddp": (HYBRID_DDP, None),
        "ddp, norms summed over ranks": (DDP, "recipe_controls:norms_summed_over_ranks"),
        "hybrid-ddp, norms per rank": (HYBRID_DDP, "recipe_controls:norms_per_block")}
EMA_OF_RANK_0 = "hybrid-ddp, EMA of rank 0 only"


def _dir(name: str) -> str:
    return name.replace(", ", "_").replace(" ", "_")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every optimizer's runs of RUNS, and the EMA control, in one 2-process launch; the
    single-device references (float64 and float32) in this process. Once for all workers."""
    return Path(built_once(tmp_path_factory, "recipe_processes", _build))


def _build(root):
    commands = []
    for opt in OPTS:
        for name, (flags, patch) in RUNS.items():
            argv = ["train", *recipe(opt, *flags, *F64), "--out", root / opt / _dir(name)]
            commands.append((argv, False, *([patch] if patch else [])))
    commands.append((["train", *recipe("sgd", *HYBRID_DDP, *F64), "--out",
                      root / "sgd" / _dir(EMA_OF_RANK_0)], False,
                     "recipe_controls:ema_of_rank_0"))
    result = launch_runs(commands, timeout=600, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    for opt in OPTS:
        ok("train", *recipe(opt, *SINGLE, *F64), "--out", root / opt / "single")
        ok("train", *recipe(opt, *SINGLE), "--out", root / opt / "single32")
    return str(root)


@pytest.mark.parametrize("opt", list(OPTS))
def test_ddp_and_hybrid_ddp_take_singles_step_under_the_recipe(opt, runs):
    run = runs / opt
    negatives = [name for name, (_, patch) in RUNS.items() if patch]
    if opt == "sgd":
        negatives.append(EMA_OF_RANK_0)
    check_recipe(run / "single" / "checkpoint.pt",
                 {name: run / _dir(name) / "checkpoint.pt" for name in ("ddp", "hybrid-ddp")},
                 reference32=run / "single32" / "checkpoint.pt",
                 negatives={name: run / _dir(name) / "checkpoint.pt" for name in negatives})
    for name in ("single", "ddp", "hybrid-ddp"):
        assert clipped_steps(run / _dir(name)) == 4, name  # the clip bit at every step
