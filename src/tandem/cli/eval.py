"""``tandem eval --resume PATH``: validate a checkpoint and print its loss and accuracy.

Architecture, data settings, loss and seed come from the checkpoint; a flag given here
overrides them. A file from elsewhere is evaluated as the imagenet example does (plain
cross-entropy at the arch's native size), and one line says so.
"""

from __future__ import annotations

import argparse
import json
import sys

from tandem.config import DataConfig, OptimConfig, ParallelConfig
from tandem.errors import UsageError

from .common import add_config_arguments, config_from_args, tandem_warnings

__all__ = ["add_parser"]

_DATA_FLAGS = ("data", "image_size", "num_classes", "synthetic_size", "workers")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval", help="validate a checkpoint",
        description="Validate a checkpoint (tandem's, or the imagenet example's, including "
                    "module.-prefixed ones from torch's DataParallel). A file without "
                    "tandem's config is evaluated as the example does: plain cross-entropy at "
                    "the arch's native size, unless --label-smoothing or --image-size say "
                    "otherwise.")
    parser.add_argument("--resume", "--checkpoint", dest="resume", required=True,
                        metavar="PATH", help="checkpoint to validate")
    group = parser.add_argument_group("data (default: as the checkpoint was trained)")
    add_config_arguments(group, DataConfig, only=_DATA_FLAGS,
                         defaults={name: None for name in _DATA_FLAGS})
    group.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                       help="global validation batch size")
    group.add_argument("--seed", type=int, default=None, metavar="S",
                       help="seed (matters for synthetic data only)")
    add_config_arguments(group, OptimConfig, only=("label_smoothing",),
                         defaults={"label_smoothing": None})
    add_config_arguments(parser, ParallelConfig, title="parallelism",
                         only=("strategy", "devices", "sync_bn", "amp", "dtype", "channels_last",
                               "compile", "compile_mode"))
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (arch, loss, acc1, acc5, count; acc = acc1)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from tandem.train.run import evaluate

    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"bad --batch-size {args.batch_size}: must be >= 1")
    if args.label_smoothing is not None:
        OptimConfig(label_smoothing=args.label_smoothing)  # its check, naming the flag
    data = {name: getattr(args, name) for name in _DATA_FLAGS if getattr(args, name) is not None}
    DataConfig(**data)  # check the overrides alone, for a message naming the flag
    with tandem_warnings():
        result = evaluate(args.resume, parallel=config_from_args(ParallelConfig, args),
                          data=data, batch_size=args.batch_size, seed=args.seed,
                          label_smoothing=args.label_smoothing)
    note = result.pop("note")
    if not result.pop("is_main"):
        return 0  # under ddp every rank validates its share; rank 0 reports the total
    if note:  # on stderr with --json, so that stdout stays one JSON object
        print(note, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
        return 0
    if result["compile_seconds"] is not None:
        from tandem.train.compile import describe

        print(describe(result["compile_seconds"], args.compile_mode))
    print(f"{args.resume}: {result['arch']} val loss {result['loss']:.4f} "
          f"acc {result['acc1']:.2f}% acc5 {result['acc5']:.2f}% ({result['count']} images)")
    return 0
