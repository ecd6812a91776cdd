"""The recipe's exactness runs, shared by the tests that compare strategies under it
(tests/integration/cli/test_recipe_exact.py in one process, tests/integration/torchrun/
test_recipe_processes.py in two): the flags, the float64 reference, and the comparison of
weights, buffers, optimizer state and EMA at once.

Every run: digits, ``recipe_net:make`` (AlexNet's layout in miniature: hybrid splits its head),
global batch 7 (3+2+2 over 3 replicas, 4+3 over 2 ranks), 4 steps, ``--sync-bn``,
``--clip-grad 0.05`` (the gradient's norm is 0.3 to 2 in these steps: every step is clipped,
which the metrics row's ``clipped_steps`` shows) and ``--model-ema 0.9`` (its warm-up on).
"""

from __future__ import annotations

import json

import torch
from exact import EPS32, EPS64, TOL64, max_diff

__all__ = ["OPTS", "CLIP", "EMA", "BASE", "recipe", "recipe_state", "clipped_steps",
           "check_recipe"]

#: each optimizer with a learning rate that moves this net in 4 steps
OPTS = {"sgd": ["--opt", "sgd", "--lr", "0.1", "--nesterov"],
        "adamw": ["--opt", "adamw", "--lr", "0.01", "--wd", "0.05"],
        "lars": ["--opt", "lars", "--lr", "2", "--lars-trust", "0.02", "--wd", "0.01"],
        "lamb": ["--opt", "lamb", "--lr", "0.02", "--wd", "0.05", "--opt-betas", "0.8,0.99"]}
CLIP = ["--clip-grad", "0.05"]
EMA = ["--model-ema", "0.9"]
BASE = ["--data", "digits", "-a", "recipe_net:make", "-b", "7", "--epochs", "1",
        "--max-steps", "4", "--no-progress", "--seed", "3", "--sync-bn"]


def recipe(opt: str, *extra: str, clip: bool = True) -> list[str]:
    """The ``tandem train`` arguments of optimizer ``opt``'s run (``extra`` after them)."""
    return [*BASE, *OPTS[opt], *(CLIP if clip else []), *EMA, *extra]


def recipe_state(path) -> dict:
    """A checkpoint's weights and buffers (``w/``), optimizer state (``opt/GROUP/I/KEY``: the
    I-th parameter of each group, as every strategy's plain layout orders them) and EMA
    (``ema/``), as one flat dict of tensors."""
    ckpt = torch.load(path, weights_only=True)
    flat = {f"w/{k}": v for k, v in ckpt["state_dict"].items()}
    optimizer = ckpt["optimizer"]
    for g, group in enumerate(optimizer["param_groups"]):
        for i, index in enumerate(group["params"]):
            for key, value in optimizer["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flat[f"opt/{g}/{i}/{key}"] = value
    flat.update({f"ema/{k}": v for k, v in ckpt["ema"]["state_dict"].items()})
    return flat


def clipped_steps(run) -> int:
    """The steps the last metrics row of ``run`` says were clipped."""
    with open(run / "metrics.jsonl") as f:
        return json.loads(f.read().splitlines()[-1])["clipped_steps"]


def check_recipe(reference64, candidates: dict, *, reference32, negatives: dict) -> dict:
    """Each candidate (a float64 checkpoint) within ``TOL64`` of the reference on weights,
    optimizer state and EMA; the float32 run's distance from float64 (the noise floor, see
    :mod:`exact`) far below it; each negative control at least ``1000 * TOL64`` away. Returns
    the figures (printed too, for ``pytest -s``)."""
    ref = recipe_state(reference64)
    amplification = max_diff(recipe_state(reference32), ref) / EPS32
    floor = amplification * EPS64
    assert floor < TOL64 / 2, f"ill-posed: float64 noise {floor:.3g} near the tolerance"
    figures = {"float64 noise floor": floor}
    for name, path in candidates.items():
        figures[name] = max_diff(recipe_state(path), ref)
    for name, path in negatives.items():
        figures[f"negative: {name}"] = max_diff(recipe_state(path), ref)
    print("recipe figures:", {k: f"{v:.3g}" for k, v in figures.items()})
    for name in candidates:
        assert figures[name] < TOL64, f"{name} is {figures[name]:.3g} from single (float64)"
    for name in negatives:
        assert figures[f"negative: {name}"] > 1000 * TOL64, (
            f"negative control {name} only {figures[f'negative: {name}']:.3g} from single")
    return figures
