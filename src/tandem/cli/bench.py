"""``tandem bench``: time training steps of several strategies side by side.

Example::

    tandem bench --arch cifar_resnet20 --strategies single,dp,balanced --devices cpu:2 \\
        --batch-size 64 --steps 20
    tandem bench --data runs/jpegs --image-size 224 -j 2 --json loader.json  # input pipeline
"""

from __future__ import annotations

import argparse
import sys

from tandem.strategies.compile import COMPILE_MODES
from tandem.errors import UsageError
from tandem.parallel.buffers import POLICIES

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from tandem.bench.config import default_strategies
    from tandem.strategies import strategy_names

    p = subparsers.add_parser(
        "bench", help="time training steps of strategies and torch baselines side by side",
        description="Warm up, then time full training steps (forward, loss, backward, SGD) on "
                    "synthetic data, interleaving the strategies round by round.")
    p.add_argument("-a", "--arch", metavar="ARCH", help="model name (see `tandem models`); "
                   "required unless --data times the input pipeline")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="an ImageFolder directory: time tandem's input pipeline on it, next to "
                        "a torchvision-style Pillow reference (no model)")
    p.add_argument("-j", "--workers", type=int, default=0, metavar="N",
                   help="with --data: loader worker processes")
    # The names and the default come from the registry (see default_strategies).
    p.add_argument("--strategies", default=None, metavar="LIST",
                   help=f"comma list of {', '.join(strategy_names())}; by default every "
                        f"single-process strategy that takes any model (default: "
                        f"{','.join(default_strategies())})")
    p.add_argument("--devices", default="auto", metavar="SPEC",
                   help="cpu, cpu:N, cuda, cuda:0,1 or auto")
    p.add_argument("-b", "--batch-size", type=int, default=64, metavar="N",
                   help="global batch per step")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="timed steps per contestant (default 20); with --data, timed passes "
                        "over the files (default 5)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed steps first (default 3); with --data, passes (default 1)")
    p.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="square input size (default: 32 for cifar_*, else 224)")
    p.add_argument("--num-classes", type=int, default=None, metavar="K",
                   help="classifier outputs (default: 10 for cifar_*, else 1000)")
    p.add_argument("--amp", action="store_true", help="autocast (see --amp-dtype)")
    p.add_argument("--amp-dtype", choices=["bf16", "fp16"], default="fp16",
                   help="fp16 adds a GradScaler")
    p.add_argument("--channels-last", action="store_true", help="NHWC model and inputs")
    p.add_argument("--sync-bn", action="store_true", help="strategies use SyncBatchNorm")
    p.add_argument("--buffers", choices=POLICIES, default=POLICIES[0],
                   help="dp: which replicas' batch-norm running stats to keep")
    p.add_argument("--baselines", default="bare,torch_dp,torch_ddp", metavar="LIST",
                   help="plain-torch contestants to add, or 'none'")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads per replica (thread here, or torchrun worker); "
                        "default: torch's choice, split among workers")
    p.add_argument("--compile", action="store_true",
                   help="also race a compiled twin (<name>+compile) of every contestant")
    p.add_argument("--compile-mode", default=None, choices=COMPILE_MODES,
                   help="torch.compile mode (with --compile; default: torch's)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for model and data")
    p.add_argument("--dist-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="seconds allowed for the torchrun phase (the multi-process "
                        "strategies and torch_ddp)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write every field as JSON to PATH ('-' for stdout)")
    p.add_argument("--explain", action="store_true",
                   help="print tandem.hybrid's cost report for the model first")
    p.set_defaults(func=run)
    return p


def _run_data(args: argparse.Namespace) -> int:
    from tandem.bench import write_json
    from tandem.bench.loader_bench import format_loader_table, run_loader_bench

    report = run_loader_bench(
        args.data, image_size=args.image_size or 224, workers=args.workers,
        batch_size=args.batch_size, rounds=5 if args.steps is None else args.steps,
        warmup=1 if args.warmup is None else args.warmup, seed=args.seed)
    print(format_loader_table(report), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_json(report, args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    from tandem.bench import BenchConfig, explain, format_table, run_bench, write_json

    if args.data is not None:
        if args.arch is not None:
            raise UsageError("--data times the input pipeline alone: leave out --arch")
        return _run_data(args)
    if args.arch is None:
        raise UsageError("bench needs --arch (or --data DIR to time the input pipeline)")
    config = BenchConfig(
        arch=args.arch, strategies=args.strategies, devices=args.devices,
        batch_size=args.batch_size, steps=20 if args.steps is None else args.steps,
        warmup=3 if args.warmup is None else args.warmup,
        image_size=args.image_size, num_classes=args.num_classes, amp=args.amp,
        amp_dtype=args.amp_dtype, channels_last=args.channels_last, sync_bn=args.sync_bn,
        buffers=args.buffers, baselines=args.baselines, seed=args.seed, threads=args.threads,
        dist_timeout=args.dist_timeout, compile=args.compile, compile_mode=args.compile_mode)
    # With --json - the JSON owns stdout, so the table goes to stderr.
    out = sys.stderr if args.json == "-" else sys.stdout
    if args.explain:
        from tandem.models import create_model

        model = create_model(config.arch, num_classes=config.num_classes)
        print(explain(model, config.device_list, config.batch_size, config.image_size), file=out)
    report = run_bench(config)
    print(format_table(report), file=out)
    if args.json:
        write_json(report, args.json)
    return 1 if any(r["status"] == "failed" for r in report["results"]) else 0
