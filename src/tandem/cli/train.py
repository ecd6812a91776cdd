"""``tandem train``: the imagenet example's flags plus strategies, devices and run control.

Every flag is derived from a field of the config dataclasses in :mod:`tandem.config`; this
module only groups them and hands one :class:`~tandem.config.TrainConfig` to
:func:`tandem.train.run.train`.

Examples::

    tandem train -a cifar_resnet20 --data digits --strategy dp --devices cpu:2 --epochs 8
    tandem train -a resnet50 --data /data/imagenet -b 256 --strategy dp --devices cuda --amp
    tandem launch --nproc-per-node 2 -- train -a cifar_resnet20 --data digits --strategy ddp
    tandem train --resume runs/train                # continue that run, with its settings
    tandem train --resume runs/train --epochs 40    # ... and extend its schedule to 40 epochs
"""

from __future__ import annotations

import argparse

from tandem.config import (DataConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig,
                           TrainConfig)

from .common import add_config_arguments, config_from_args, given_fields, tandem_warnings

__all__ = ["add_parser", "config_from_namespace"]

SECTIONS = (("model", ModelConfig), ("data", DataConfig), ("optimization", OptimConfig),
            ("parallelism", ParallelConfig), ("run", RunConfig))


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train a model",
        description="Train a model on one or several devices. --batch-size is the global "
                    "batch, split over devices and processes; every strategy computes the same "
                    "update for the same seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1],
    )
    for title, cls in SECTIONS:
        add_config_arguments(parser, cls, title=title)
    parser.set_defaults(func=run)
    return parser


def config_from_namespace(args: argparse.Namespace) -> TrainConfig:
    """Read (never modify) ``args`` into a checked :class:`TrainConfig`."""
    return TrainConfig(model=config_from_args(ModelConfig, args),
                       data=config_from_args(DataConfig, args),
                       optim=config_from_args(OptimConfig, args),
                       parallel=config_from_args(ParallelConfig, args),
                       run=config_from_args(RunConfig, args))


def run(args: argparse.Namespace) -> int:
    from tandem.train.run import train  # heavy imports only when training

    with tandem_warnings():
        return train(config_from_namespace(args), given=given_fields(args))
