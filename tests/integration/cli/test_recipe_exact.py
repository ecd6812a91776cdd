"""The recipe under the one-process strategies against single on the whole batch (float64, at
1e-9, weights, buffers, optimizer state and EMA): sgd, adamw, lars and lamb, each with
--clip-grad and --model-ema, under dp, balanced and hybrid on 3 CPU replicas (uneven shares,
hybrid's head split over them); a run resumed midway against the straight run, bit for bit;
a run resumed under another strategy against single's straight run (float64).

Controls (tests/support/recipe_runs.py): the float32 noise floor, and negative controls that
must differ by more than 1000x the tolerance: the run without the clip (it bit at every step,
which the metrics row counts), and for lars and lamb hybrid's trust ratios taken per shard
instead of per layer (recipe_controls.norms_per_block; sgd's and adamw's only norm, the clip's
total, is the same summed over shards in any grouping: the multi-process file's rank-local
control is theirs).
"""

import shutil

import pytest
import recipe_controls
import torch
from conftest import ok
from exact import TOL64, max_diff, same_bits
from recipe_runs import OPTS, check_recipe, clipped_steps, recipe, recipe_state

pytestmark = pytest.mark.slow

SINGLE = ["--strategy", "single", "--devices", "cpu"]
ONE_PROCESS = {"dp": ["--strategy", "dp", "--devices", "cpu:3"],
               "balanced": ["--strategy", "balanced", "--devices", "cpu:3"],
               "hybrid": ["--strategy", "hybrid", "--devices", "cpu:3"]}
F64 = ["--dtype", "float64"]


def train(out, *args):
    ok("train", *args, "--out", out)
    return out / "checkpoint.pt"


@pytest.mark.parametrize("opt", list(OPTS))
def test_every_one_process_strategy_takes_singles_step_under_the_recipe(opt, tmp_path):
    reference = train(tmp_path / "single", *recipe(opt, *SINGLE, *F64))
    assert clipped_steps(tmp_path / "single") == 4  # the clip bit at every step
    candidates = {name: train(tmp_path / name, *recipe(opt, *args, *F64))
                  for name, args in ONE_PROCESS.items()}
    negatives = {"no clip": train(tmp_path / "no_clip", *recipe(opt, *SINGLE, *F64,
                                                                  clip=False))}
    if opt in ("lars", "lamb"):
        with recipe_controls.norms_per_block():
            negatives["hybrid, norms per shard"] = train(
                tmp_path / "per_shard", *recipe(opt, *ONE_PROCESS["hybrid"], *F64))
    check_recipe(reference, candidates, negatives=negatives,
                 reference32=train(tmp_path / "single32", *recipe(opt, *SINGLE)))
    for name in candidates:
        assert clipped_steps(tmp_path / name) == 4, name


def _checkpoint(path) -> dict:
    ckpt = torch.load(path, weights_only=True)
    ckpt["epoch_progress"].pop("seconds")
    ckpt["config"]["resolved"].pop("launch_id")
    ckpt.pop("best_acc1")  # the stopped run validated once more, at its stop
    return ckpt


def test_a_run_resumed_midway_is_the_straight_run_bit_for_bit_ema_included(tmp_path):
    """hybrid on 2 replicas, float32, lamb: its head's EMA merged from two shards. (On 3
    shards a float32 hybrid run's last bits depend on what the process's pooled replica
    threads ran before, with plain SGD too: a replica's gradient adds three shards' parts, in
    an order autograd's engine takes from nodes made in those threads. Two parts add alike in
    either order; the determinism tests use 2 as well.)"""
    args = recipe("lamb", "--strategy", "hybrid", "--devices", "cpu:2", "--max-steps", "6")
    train(tmp_path / "straight", *args)
    train(tmp_path / "resumed", *args[:-1], "3")
    ok("train", "--resume", tmp_path / "resumed", "--max-steps", "6")
    straight = _checkpoint(tmp_path / "straight" / "checkpoint.pt")
    resumed = _checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    assert resumed["ema"]["updates"] == straight["ema"]["updates"] == 6
    assert same_bits(straight, resumed) == []


def test_a_run_resumed_under_another_strategy_goes_on_with_singles_update(tmp_path):
    """hybrid on 3 replicas for 3 steps, then dp on 2 for 3 more, against single's 6 (float64);
    the control resumes the same checkpoint without its EMA (the average then restarts from
    the weights), which the comparison must see."""
    six = ["--max-steps", "6"]
    reference = train(tmp_path / "single", *recipe("lars", *SINGLE, *F64, *six))
    train(tmp_path / "moved", *recipe("lars", *ONE_PROCESS["hybrid"], *F64, "--max-steps", "3"))
    shutil.copytree(tmp_path / "moved", tmp_path / "no_ema")
    ok("train", "--resume", tmp_path / "moved", "--strategy", "dp", "--devices", "cpu:2", *six)
    ckpt = torch.load(tmp_path / "no_ema" / "checkpoint.pt", weights_only=True)
    del ckpt["ema"]
    torch.save(ckpt, tmp_path / "no_ema" / "checkpoint.pt")
    ok("train", "--resume", tmp_path / "no_ema", "--strategy", "dp", "--devices", "cpu:2", *six)
    ref = recipe_state(reference)
    moved = recipe_state(tmp_path / "moved" / "checkpoint.pt")
    assert torch.load(tmp_path / "moved" / "checkpoint.pt",
                      weights_only=True)["data_position"]["step"] == 6
    assert max_diff(moved, ref) < TOL64
    restarted = recipe_state(tmp_path / "no_ema" / "checkpoint.pt")
    assert max_diff(restarted, ref) > 1000 * TOL64
