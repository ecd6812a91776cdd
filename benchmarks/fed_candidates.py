"""Issue 34, item 3: the fed bench (``tandem bench --data DIR -a ARCH``) once per candidate
cause of a gap between ``fed`` and ``min(loader, step)`` that a CPU can show: the main
process's intra-op threads (1, 2), the prefetch depth (2, 4, 8 batches per worker) and the
worker count (1, 2). Prints one table per setting (BENCHMARKS.md quotes them).

    python benchmarks/make_jpegs.py runs/jpegs --classes 4 --per-class 64
    python benchmarks/fed_candidates.py runs/jpegs -a cifar_resnet20 --image-size 8 -b 32
"""

from __future__ import annotations

import argparse
import sys

from tandem_bench import BenchConfig
from tandem_bench.fed import format_fed_table, run_fed_bench
from tandem.data import loader

SETTINGS = [  # (label, torch threads, prefetch, workers); the first is the baseline
    ("baseline", 1, 4, 1), ("threads 2", 2, 4, 1), ("prefetch 2", 1, 2, 1),
    ("prefetch 8", 1, 8, 1), ("-j 2", 1, 4, 2),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("-a", "--arch", default="cifar_resnet20")
    p.add_argument("--image-size", type=int, default=8)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma list of labels to run")
    args = p.parse_args(argv)
    wanted = None if args.only is None else set(args.only.split(","))
    for label, threads, prefetch, workers in SETTINGS:
        if wanted is not None and label not in wanted:
            continue
        loader.PREFETCH = prefetch  # make_loader reads it when it builds the loader
        config = BenchConfig(arch=args.arch, devices="cpu", batch_size=args.batch_size,
                             image_size=args.image_size, threads=threads)
        report = run_fed_bench(config, args.data, workers=workers, rounds=args.rounds)
        print(f"## {label}\n{format_fed_table(report)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
