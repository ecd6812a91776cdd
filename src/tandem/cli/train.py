"""``tandem train``: the imagenet example's flags plus strategies, devices and run control.

Every flag comes from a field of :mod:`tandem.config`.

Examples::

    tandem train -a cifar_resnet20 --data digits --strategy dp --devices cpu:2 --epochs 8
    tandem train -a resnet50 --data /data/imagenet -b 256 --strategy dp --devices cuda --amp
    tandem train -a cifar_resnet20 --data digits --devices cpu --amp --channels-last  # bf16 CPU
    tandem launch --nproc-per-node 2 -- train -a cifar_resnet20 --data digits --strategy ddp
    tandem train --resume runs/train                # continue that run, with its settings
    tandem train --resume runs/train --epochs 40    # ... and extend its schedule to 40 epochs
    tandem train -a resnet18 --pretrained resnet18-f37072fd.pth /data/flowers  # fine-tune
    tandem train -a resnet18 --resume checkpoint.pth.tar /data/imagenet  # the example's file
"""

from __future__ import annotations

import argparse
import dataclasses

from tandem.config import SECTIONS, TrainConfig
from tandem.distributed.env import Environment
from tandem.train.run import train

from .common import add_config_arguments, config_from_args, given_fields, tandem_warnings
from .imagenet_flags import add_example_arguments, dummy_line, example_overrides

_TITLES = {"optim": "optimization", "parallel": "parallelism"}  # --help's, by section


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train a model",
        description="Train a model on one or several devices. --batch-size is the global "
                    "batch, split over devices and processes; every strategy computes the same "
                    "update for the same seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1])
    for name, cls in SECTIONS.items():
        add_config_arguments(parser, cls, title=_TITLES.get(name, name))
    add_example_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def config_from_namespace(args: argparse.Namespace) -> TrainConfig:
    """Read (never modify) ``args`` into a checked :class:`TrainConfig`, the imagenet example's
    flags included."""
    values, _ = example_overrides(args)
    return TrainConfig(**{name: config_from_args(cls, args, **{
        f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
        for name, cls in SECTIONS.items()})


def run(args: argparse.Namespace) -> int:
    cfg = config_from_namespace(args)
    given = given_fields(args) | example_overrides(args)[1]
    opening = dummy_line(args, cfg)
    with tandem_warnings():
        return train(cfg, given=given, opening=(opening,) if opening else (),
                     environ=Environment.read())
