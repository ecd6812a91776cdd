"""``tandem bench``: time training steps of several strategies side by side.

Example (CPU, two replica threads)::

    tandem bench --arch cifar_resnet20 --strategies single,dp,balanced --devices cpu:2 \\
        --batch-size 64 --steps 20
"""

from __future__ import annotations

import argparse
import sys

from tandem.config import COMPILE_MODES

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="time training steps of strategies and torch baselines side by side",
        description="Warm up, then time full training steps (forward, loss, backward, SGD) on "
                    "synthetic data, interleaving the strategies round by round.")
    p.add_argument("-a", "--arch", required=True, help="model name (see `tandem models`)")
    p.add_argument("--strategies", default="single,dp,balanced",
                   help="comma list of single,dp,balanced,hybrid,ddp (default: %(default)s)")
    p.add_argument("--devices", default="auto", help="cpu, cpu:N, cuda, cuda:0,1 or auto")
    p.add_argument("-b", "--batch-size", type=int, default=64, help="global batch per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contestant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--image-size", type=int, default=None,
                   help="square input size (default: 32 for cifar_*, else 224)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="default: 10 for cifar_*, else 1000")
    p.add_argument("--amp", action="store_true", help="autocast (see --amp-dtype)")
    p.add_argument("--amp-dtype", choices=["bf16", "fp16"], default="fp16",
                   help="fp16 adds a GradScaler (default: %(default)s)")
    p.add_argument("--channels-last", action="store_true", help="NHWC model and inputs")
    p.add_argument("--sync-bn", action="store_true", help="strategies use SyncBatchNorm")
    p.add_argument("--buffers", choices=["replica0", "average"], default="replica0")
    p.add_argument("--baselines", default="bare,torch_dp,torch_ddp",
                   help="plain-torch contestants to add, or 'none' (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per replica (thread here, or torchrun worker); "
                        "default: torch's choice, split among workers")
    p.add_argument("--compile", action="store_true",
                   help="also race a compiled twin (<name>+compile) of every contestant")
    p.add_argument("--compile-mode", default=None, choices=COMPILE_MODES,
                   help="torch.compile mode (with --compile; default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-timeout", type=float, default=900.0,
                   help="seconds allowed for the torchrun phase of ddp/torch_ddp")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write every field as JSON to PATH ('-' for stdout)")
    p.add_argument("--explain", action="store_true",
                   help="print tandem.hybrid's cost report for the model first")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tandem.bench import BenchConfig, explain, format_table, run_bench, write_json

    config = BenchConfig(
        arch=args.arch, strategies=args.strategies, devices=args.devices,
        batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
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
