"""``--grad-compression`` under ddp and hybrid-ddp (2 gloo processes, one `tandem launch`), in
float64 on digits with --sync-bn, global batch 7 (shares 4+3), 6 steps:

- ``none`` takes single's step (at 1e-9, with the float32 noise floor as control), and the
  lossy modes are far from it (the negative control: the comparison sees a compressed update);
- bf16 and fp16 are off by their precision and not more: the run's own measured gradient
  error lies between a tenth of the format's unit roundoff and the roundoff, and the weights'
  distance from exact ddp's, against the distance the steps moved them, no more than 4x it;
- PowerSGD (rank 1, from step 3) carries its error: a control without error feedback ends
  elsewhere;
- a PowerSGD run stopped at step 3 and resumed ends bitwise on the straight run's weights,
  under ddp and under hybrid-ddp; the control that does not hand PowerSGD's state over to a
  new bucket layout (a resumed run starts with DDP's first layout, then takes its second)
  does not.

The resume runs use the default model (cifar_resnet20), whose gradients DDP lays out in one
bucket first and in two after step 1 (a resumed run starts with one again).
"""

import json

import pytest
import torch
from pathlib import Path

from conftest import built_once, ok
from ddp_runs import launch_runs, outputs
from exact import EPS32, EPS64, TOL64, max_diff, state

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = ["--data", "digits", "-b", "7", "--epochs", "1", "--no-progress", "--seed", "3",
          "--lr", "0.1", "--dtype", "float64", "--sync-bn"]
SMALL = [*COMMON, "-a", "recipe_net:make", "--max-steps", "6"]
DDP = ["--strategy", "ddp", "--devices", "cpu"]
HYBRID_DDP = ["--strategy", "hybrid-ddp", "--devices", "cpu"]
#: the unit roundoff of each format the gradients may be sent in
ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def _row(run) -> dict:
    with open(run / "metrics.jsonl") as f:
        return json.loads(f.read().splitlines()[-1])


def _weights(run) -> dict:
    """The checkpoint's parameters (its BatchNorm statistics left out: no step moves them)."""
    return {k: v for k, v in state(run / "checkpoint.pt").items()
            if "running_" not in k and "num_batches" not in k}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs' directory and rank 0's output of each command (once for all workers)."""
    root, said = built_once(tmp_path_factory, "grad_compression", _build)
    return Path(root), said


def _build(root):

    def train(name, *flags, patch=None, resume=False):
        head = ["train", "--resume", root / name] if resume else ["train", *flags]
        tail = [*flags] if resume else ["--out", root / name]
        return (head + tail, False, *([patch] if patch else []))

    commands = [train(f"ddp-{mode}", *SMALL, *DDP, "--grad-compression", mode)
                for mode in ("none", "bf16", "fp16", "powersgd")]
    commands += [
        train("ddp-powersgd-noef", *SMALL, *DDP, "--grad-compression", "powersgd",
              patch="compression_controls:no_error_feedback"),
        train("hybrid-bf16", *SMALL, *HYBRID_DDP, "--grad-compression", "bf16"),
        train("hybrid-powersgd", *COMMON, *HYBRID_DDP, "--grad-compression", "powersgd:2",
              "--max-steps", "4"),  # recipe_net's trunk has no matrix worth factoring
        train("straight", *COMMON, *DDP, "--grad-compression", "powersgd", "--max-steps", "6"),
        train("resumed", *COMMON, *DDP, "--grad-compression", "powersgd", "--max-steps", "3"),
        (["copytree", root / "resumed", root / "forgot"], False),
        train("resumed", "--max-steps", "6", resume=True),
        train("forgot", "--max-steps", "6", resume=True,
              patch="compression_controls:no_handover"),
        train("hybrid-straight", *COMMON, *HYBRID_DDP, "--grad-compression", "powersgd",
              "--max-steps", "6"),
        train("hybrid-resumed", *COMMON, *HYBRID_DDP, "--grad-compression", "powersgd",
              "--max-steps", "3"),
        train("hybrid-resumed", "--max-steps", "6", resume=True),
    ]
    result = launch_runs(commands, timeout=600, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    ok("train", *SMALL, "--strategy", "single", "--out", root / "single")
    ok("train", *SMALL, "--strategy", "single", "--dtype", "float32", "--out", root / "single32")
    # the initial weights: a step too small to move them (an lr of 0 is refused)
    ok("train", *SMALL, "--strategy", "single", "--lr", "1e-300", "--out", root / "start")
    return str(root), outputs(result.stdout)


def test_none_takes_singles_step_and_the_lossy_modes_do_not(runs):
    root, _ = runs
    single = state(root / "single" / "checkpoint.pt")
    floor = max_diff(state(root / "single32" / "checkpoint.pt"), single) / EPS32 * EPS64
    assert floor < TOL64 / 2, f"ill-posed: float64 noise {floor:.3g}"
    assert max_diff(state(root / "ddp-none" / "checkpoint.pt"), single) < TOL64
    assert "grad_error" not in _row(root / "ddp-none")  # nothing compressed: nothing measured
    for mode in ("bf16", "fp16", "powersgd"):
        far = max_diff(state(root / f"ddp-{mode}" / "checkpoint.pt"), single)
        assert far > 1000 * TOL64, f"{mode} only {far:.3g} from single"


@pytest.mark.parametrize("run", ["ddp-bf16", "ddp-fp16", "hybrid-bf16"])
def test_bf16_and_fp16_are_off_by_their_precision_and_not_more(runs, run):
    root, _ = runs
    u = ROUNDOFF[run.split("-")[1]]
    error = _row(root / run)["grad_error"]
    assert u / 10 < error < u, f"{run}: measured gradient error {error:.3g} against {u:.3g}"
    if run.startswith("ddp"):
        exact, start, lossy = (_weights(root / name) for name in ("ddp-none", "start", run))
        moved, off = max_diff(exact, start), max_diff(lossy, exact)
        assert off < 4 * u * moved, f"{run}: {off:.3g} from exact after moving {moved:.3g}"


def test_powersgd_carries_its_error_and_says_what_it_sends(runs):
    root, said = runs
    feedback, dropped = (state(root / name / "checkpoint.pt")
                         for name in ("ddp-powersgd", "ddp-powersgd-noef"))
    assert max_diff(feedback, dropped) > 1000 * TOL64
    assert _row(root / "ddp-powersgd")["grad_error"] > 0.01  # rank 1 of a step: far from exact
    assert _row(root / "hybrid-powersgd")["grad_error"] > 0.01
    opening = next(line for line in said[3].splitlines() if line.startswith("gradients:"))
    assert opening.startswith("gradients: powersgd:1 with error feedback from step 3, an "
                              "approximate update (not single's); each rank sends "), opening


def test_a_powersgd_resume_is_bitwise_the_straight_run(runs):
    root, said = runs
    straight, resumed, forgot = (state(root / name / "checkpoint.pt")
                                 for name in ("straight", "resumed", "forgot"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert max_diff(forgot, straight) > 1000 * TOL64  # the carried error matters
    assert "starts afresh" not in said[10]
    # hybrid-ddp: the trunk's PowerSGD state, gathered with the split head's blocks
    straight, resumed = (state(root / name / "checkpoint.pt")
                         for name in ("hybrid-straight", "hybrid-resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert "starts afresh" not in said[14] and "resuming" in said[14]
