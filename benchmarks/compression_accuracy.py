"""What ``--grad-compression`` costs in accuracy: ddp over 2 processes on digits, the same
epochs, seed and schedule for every mode, the final validation accuracy and each epoch's
measured gradient error beside exact ddp's. Runs on one machine (the link's speed does not
change the update)::

    python benchmarks/compression_accuracy.py                     # none bf16 powersgd:2 powersgd:4
    python benchmarks/compression_accuracy.py --epochs 6 --modes none,powersgd:1 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _run(root: str, mode: str, seed: int, args) -> dict:
    """The last metrics row of one 2-process ddp run, and its epochs' gradient errors."""
    out = os.path.join(root, f"{mode.replace(':', '-')}-{seed}")
    command = [sys.executable, "-m", "tandem", "launch", "--nproc-per-node", "2", "--",
               "train", "--strategy", "ddp", "--data", "digits", "--epochs", str(args.epochs),
               "--seed", str(seed), "--grad-compression", mode, "--no-progress", "--out", out]
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        raise SystemExit(f"compression_accuracy.py: {mode} failed: {done.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"mode": mode, "seed": seed, "val_acc": rows[-1]["val_acc"],
            "grad_error": [r.get("grad_error") for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="none,bf16,powersgd:2,powersgd:4")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", default="0")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print("| --grad-compression | seed | val acc after the epochs | vs exact | grad error "
          "(first, last epoch) |\n|---|---|---|---|---|", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for seed in map(int, args.seeds.split(",")):
            exact = None
            for mode in args.modes.split(","):
                row = _run(root, mode, seed, args)
                exact = row["val_acc"] if mode == "none" else exact
                errors = [e for e in row["grad_error"] if e is not None]
                shown = f"{errors[0]:.1e}, {errors[-1]:.1e}" if errors else "-"
                vs = "" if exact is None else f"{row['val_acc'] - exact:+.2f} points"
                print(f"| {mode} | {seed} | {row['val_acc']:.2f}% | {vs} | {shown} |", flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
