"""Large batches on digits: each optimizer at 1x, 4x and 16x the global batch, with and without
the linear scaling rule, accuracy after the same epochs (docs/benchmarks/large-batch.md,
section 18).

A larger global batch is what more devices and machines give a run: the same epochs then make
fewer optimizer steps. Goyal et al. (2017) keep the recipe by scaling the learning rate with
the batch (``--lr-scale linear``) after a warm-up; LARS and LAMB (You et al. 2017, 2019) scale
each layer's step by a trust ratio instead. Here the larger batch is made by accumulation
(``--accum-steps 4`` or ``16`` over ``-b 32``), which computes the same update as 4 or 16
devices would (tandem's promise), on one CPU. Every run: ``cifar_resnet20`` on scikit-learn's
8x8 digits (1,438 training images, 359 validation), ``--strategy single``, the same seed,
epochs and 1-epoch linear warm-up, then cosine; ``--lr`` is each optimizer's at 1x (below),
``--lr-base-batch 32``. The figure is the validation accuracy after the last epoch. Nothing is
timed.

    python benchmarks/large_batch.py --out runs/large_batch --json runs/large_batch.json
    python benchmarks/large_batch.py --dry-run   # the tandem commands, one a line
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["BASE_BATCH", "OPTIMIZERS", "MULTIPLES", "grid", "command", "measure", "table",
           "main"]

BASE_BATCH = 32
#: each optimizer's flags at the base batch: a learning rate that trains digits well there
OPTIMIZERS = {"sgd": ["--lr", "0.05", "--wd", "5e-4"],
              "adamw": ["--lr", "0.002", "--wd", "0.05"],
              "lars": ["--lr", "2", "--wd", "5e-4"],
              "lamb": ["--lr", "0.02", "--wd", "0.05"]}
MULTIPLES = (1, 4, 16)
SCALES = ("none", "linear")


def grid(optimizers=tuple(OPTIMIZERS), multiples=MULTIPLES) -> list[dict]:
    """The runs: each optimizer at each multiple, unscaled and scaled (at 1x the two are the
    same run, made once)."""
    return [{"opt": opt, "multiple": k, "scale": scale}
            for opt in optimizers for k in multiples
            for scale in (SCALES if k > 1 else SCALES[:1])]


def command(run: dict, out: Path, epochs: int, seed: int) -> list[str]:
    """The ``tandem train`` command of ``run``, writing ``out``."""
    return ["tandem", "train", "--data", "digits", "-a", "cifar_resnet20", "--strategy",
            "single", "--devices", "cpu", "-b", str(BASE_BATCH), "--accum-steps",
            str(run["multiple"]), "--epochs", str(epochs), "--warmup-epochs", "1",
            "--seed", str(seed), "--opt", run["opt"], *OPTIMIZERS[run["opt"]],
            "--lr-scale", run["scale"], "--lr-base-batch", str(BASE_BATCH), "--no-progress",
            "--out", str(out), "--overwrite"]


def measure(run: dict, out: Path, epochs: int, seed: int) -> dict:
    """Train ``run`` (a subprocess) and read its last metrics row: the accuracy, the steps,
    the learning rate the scaling gave; a run whose loss diverged says so."""
    argv = command(run, out, epochs, seed)
    tandem = [sys.executable, "-m", "tandem", *argv[1:]]
    done = subprocess.run(tandem, capture_output=True, text=True, env=dict(os.environ))
    row = dict(run, images_per_step=BASE_BATCH * run["multiple"], command=shlex.join(argv))
    if done.returncode == 3:  # TrainingDiverged
        return dict(row, diverged=True, val_acc=None, steps=None, lr=None)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed:\n{done.stderr[-2000:]}")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    config = json.loads((out / "config.json").read_text())
    return dict(row, diverged=False, val_acc=last["val_acc"], steps=last["step"],
                lr=config["resolved"]["lr"])


def _acc(row: dict | None) -> str:
    if row is None:
        return ""
    return "diverged" if row["diverged"] else f"{row['val_acc']:.2f}%"


def table(rows: list[dict]) -> str:
    """The results as the docs' Markdown table: one line per optimizer and multiple."""
    by = {(r["opt"], r["multiple"], r["scale"]): r for r in rows}
    lines = ["| optimizer | global batch | steps | lr, unscaled | val acc | lr, linear rule "
             "| val acc |", "|---|---|---|---|---|---|---|"]
    for opt, k in dict.fromkeys((r["opt"], r["multiple"]) for r in rows):
        plain = by.get((opt, k, "none"))
        scaled = by.get((opt, k, "linear")) if k > 1 else None
        steps = next((r["steps"] for r in (plain, scaled) if r and r["steps"]), "")
        lines.append(f"| {opt} | {BASE_BATCH * k} ({k}x) | {steps} | "
                     f"{plain['lr'] if plain and plain['lr'] else ''} | {_acc(plain)} | "
                     f"{scaled['lr'] if scaled and scaled['lr'] else ''} | {_acc(scaled)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/large_batch", help="where the runs go")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--opts", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--multiples", nargs="+", type=int, default=list(MULTIPLES))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    runs = grid(args.opts, args.multiples)
    out = Path(args.out)
    if args.dry_run:
        for run in runs:
            print(shlex.join(command(run, out / _name(run), args.epochs, args.seed)))
        return 0
    rows = []
    for run in runs:
        rows.append(measure(run, out / _name(run), args.epochs, args.seed))
        print(f"{_name(run)}: {_acc(rows[-1])}", flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _name(run: dict) -> str:
    return f"{run['opt']}_{run['multiple']}x_{run['scale']}"


if __name__ == "__main__":
    sys.exit(main())
