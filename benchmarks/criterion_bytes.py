"""Bytes that reach device 0 per training step: DataParallel's gather versus the balanced criterion.

A segmentation net emits one score per class *per pixel*, so its output is large: a batch of 8
with 21 classes at 64x64 is 8 * 21 * 64 * 64 * 4 bytes = 2.6 MiB of fp32 logits, far more
than the tiny fully-convolutional net's parameters. ``DataParallel`` gathers those logits on
device 0 to compute the loss there; ``DataParallelModel`` + ``DataParallelCriterion`` (the
``balanced`` strategy) compute each replica's share of the loss where its logits live and send
only scalars to device 0.

This script runs one forward + backward of each on ``["cpu"] * n`` replicas and reads what
tandem's engine recorded (:class:`tandem.parallel.traffic.TrafficMeter`): bytes arriving at
replica 0 (``by_dst[0]``) and bytes by kind. Counts are logical (a transfer between replica
``i`` and ``j != i`` counts even when both are the CPU), so they are what the same layout moves
between real GPUs. It is a count, not a timing: the numbers do not depend on the machine.
The engine records scatter and gather in the forward direction only; in backward the logits'
gradient goes back out to the replicas (as large as the gather, but *away* from device 0), so
the device-0 figures are complete while DataParallel's total understates its traffic.

    python benchmarks/criterion_bytes.py                  # 2 and 4 replicas, batch 8, 21x64x64
    python benchmarks/criterion_bytes.py --replicas 2 4 8 --json runs/bench/criterion_bytes.json
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

from tandem.parallel import DataParallel, DataParallelCriterion, DataParallelModel
from tandem_bench import write_json
from tandem.parallel.traffic import TrafficMeter

__all__ = ["TinyFCN", "measure", "main"]


class TinyFCN(nn.Module):
    """Three convolutions, no pooling: ``(N, 3, H, W)`` -> ``(N, classes, H, W)`` logits."""

    def __init__(self, classes: int = 21, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(
            # No batch norm: per-replica batch statistics would make DataParallel's loss differ
            # from the single-device loss, and this script checks that both layouts are exact.
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
        )
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        return self.head(self.body(x))  # [N, classes, H, W]


def _meter_summary(meter: TrafficMeter) -> dict:
    return {
        "to_device0": meter.by_dst.get(0, 0),
        "total": meter.total,
        "by_kind": dict(sorted(meter.by_kind.items())),
        "by_dst": {("unknown" if k is None else str(k)): v for k, v in meter.by_dst.items()},
    }


def measure(replicas: int, batch: int = 8, classes: int = 21, size: int = 64,
            seed: int = 0) -> dict:
    """Count one forward+backward step of both layouts on ``replicas`` CPU replicas.

    Also checks that both compute the same loss as the plain model (so the comparison is
    between two correct implementations) and raises ``AssertionError`` if not.
    """
    torch.manual_seed(seed)
    model = TinyFCN(classes)
    images = torch.randn(batch, 3, size, size)
    targets = torch.randint(0, classes, (batch, size, size))
    criterion = nn.CrossEntropyLoss()
    devices = ["cpu"] * replicas
    reference = criterion(copy.deepcopy(model)(images), targets)

    gathered = DataParallel(copy.deepcopy(model), device_ids=devices)
    with TrafficMeter() as dp_meter:
        dp_loss = criterion(gathered(images), targets)  # logits gathered on replica 0
        dp_loss.backward()

    balanced = DataParallelModel(copy.deepcopy(model), device_ids=devices)
    parallel_criterion = DataParallelCriterion(criterion, device_ids=devices)
    with TrafficMeter() as bal_meter:
        bal_loss = parallel_criterion(balanced(images), targets)  # per-replica losses
        bal_loss.backward()

    for name, loss in (("DataParallel", dp_loss), ("balanced", bal_loss)):
        if not torch.allclose(loss, reference, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"{name} loss {loss.item()} != single-device {reference.item()}")
    dp, bal = _meter_summary(dp_meter), _meter_summary(bal_meter)
    return {
        "replicas": replicas, "batch": batch, "classes": classes, "size": size,
        "output_bytes": batch * classes * size * size * 4,
        "dataparallel": dp, "balanced": bal,
        "ratio_to_device0": dp["to_device0"] / bal["to_device0"] if bal["to_device0"] else None,
    }


def format_rows(results: list[dict]) -> str:
    fmt = "{:>8}  {:>14}  {:>14}  {:>10}  {:>14}  {:>14}"
    lines = [fmt.format("replicas", "DP to dev0", "balanced dev0", "ratio", "DP total",
                        "balanced total")]
    for r in results:
        ratio = r["ratio_to_device0"]
        lines.append(fmt.format(r["replicas"], f"{r['dataparallel']['to_device0']:,}",
                                f"{r['balanced']['to_device0']:,}",
                                "inf" if ratio is None else f"{ratio:.1f}x",
                                f"{r['dataparallel']['total']:,}", f"{r['balanced']['total']:,}"))
    for r in results:
        lines.append(f"{r['replicas']} replicas by kind: "
                     f"DataParallel {r['dataparallel']['by_kind']}; "
                     f"balanced {r['balanced']['by_kind']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--classes", type=int, default=21)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--json", metavar="PATH", help="write the counts as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.replicas) or min(args.batch, args.classes, args.size) < 1:
        p.error("--replicas, --batch, --classes and --size must be >= 1")
    results = [measure(n, args.batch, args.classes, args.size) for n in args.replicas]
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"bytes per forward+backward step, batch {args.batch}, {args.classes} classes at "
          f"{args.size}x{args.size} (logits {results[0]['output_bytes']:,} bytes)", file=out)
    print(format_rows(results), file=out)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
