"""``tandem bench``'s flags and what it runs (:mod:`tandem.cli.bench` is the thin command).

The race's flags come from the fields of :class:`~tandem_bench.options.BenchConfig`; ``-j``
and ``--decode`` from :class:`tandem.config.DataConfig`. With ``--json -`` the JSON owns
stdout and the tables go to stderr.

Example::

    tandem bench --arch cifar_resnet20 --strategies single,dp,balanced --devices cpu:2 \\
        --batch-size 64 --steps 20
    tandem bench -a resnet50 --image-size 112 -b 16 --strategies single --devices cpu \\
        --baselines none --variants fp32,cl,amp,amp+cl --compile  # bf16 and NHWC on the CPU
    tandem bench -a alexnet --devices cpu:2 --strategies single,ddp -b 8 --image-size 64 \\
        --explain --link-rate 100mbit  # ddp and hybrid-ddp side by side, and a slow link's cost
    tandem bench --data runs/jpegs --image-size 224 -j 2 --json loader.json  # input pipeline
    tandem bench --data runs/jpegs -a resnet18 --image-size 64 -b 32 -j 1  # fed vs unfed
    tandem bench --data runs/jpegs -a resnet50 -b 256 -j 14 --devices cuda --amp --decode gpu
"""

from __future__ import annotations

import argparse
import sys

from tandem.cli.common import add_config_arguments, config_from_args, given_fields
from tandem.config import DataConfig
from tandem.errors import UsageError
from tandem.models import create_model
from tandem.strategies.auto import planned_bytes, planned_process_bytes, wire_backend

from .fed import format_fed_table, run_fed_bench
from .link import plan_link
from .loader_bench import format_loader_table, run_loader_bench
from .options import BASELINES, BenchConfig
from .report import explain, format_table, planned_vs_measured, run_setup, write_json
from .suite import run_bench


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="time training steps of strategies and torch baselines side by side",
        description="Warm up, then time full training steps (forward, loss, backward, SGD) on "
                    "synthetic data, interleaving the strategies round by round.")
    # The baselines' default shown as the comma list the flag takes.
    add_config_arguments(p, BenchConfig, defaults={"baselines": ",".join(BASELINES)})
    data = p.add_argument_group("input pipeline (--data)")
    data.add_argument("--data", metavar="DIR", default=None,
                      help="an ImageFolder directory: time tandem's input pipeline on it, next "
                           "to a torchvision-style Pillow reference; with --arch, race the "
                           "train loop fed by it (fed) against the loader and the step alone")
    add_config_arguments(data, DataConfig, only=("workers", "decode"))
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write every field as JSON to PATH ('-' for stdout)")
    p.add_argument("--explain", action="store_true",
                   help="print tandem.hybrid's cost report for the model first, and the bytes "
                        "each process sends a step under ddp and hybrid-ddp (with "
                        "--link-rate: the time they take)")
    p.set_defaults(func=run)
    return p


def _out(args: argparse.Namespace):
    return sys.stderr if args.json == "-" else sys.stdout


def _passes(args: argparse.Namespace) -> dict:
    """``--steps``/``--warmup`` as the data benches' passes, where given (else their own
    defaults)."""
    given = given_fields(args)
    return {key: getattr(args, name) for key, name in (("rounds", "steps"),
                                                       ("warmup", "warmup")) if name in given}


def _run_data(args: argparse.Namespace) -> dict:
    """``--data DIR``: the input pipeline alone, next to a Pillow reference."""
    if "decode" in given_fields(args):
        raise UsageError("--decode is the fed race's (--data DIR with -a ARCH): the loader "
                         "bench alone decodes on the CPU")
    passes = _passes(args) | ({"image_size": args.image_size} if args.image_size else {})
    report = run_loader_bench(args.data, workers=args.workers, batch_size=args.batch_size,
                              seed=args.seed, **passes)
    print(format_loader_table(report), file=_out(args))
    return report


def _run_fed(args: argparse.Namespace) -> dict:
    """``--data DIR -a ARCH``: the train loop fed by the loader against each alone."""
    config = config_from_args(BenchConfig, args)
    if config.variants or config.compile or config.loop or config.handicap:
        raise UsageError("--data with --arch races loader, step and fed on one device: leave "
                         "out --variants, --compile, --loop and --handicap",
                         hint="use --amp and --channels-last")
    report = run_fed_bench(config, args.data, workers=args.workers, decode=args.decode,
                           **_passes(args))
    print(format_fed_table(report), file=_out(args))
    return report


def _explain(config: BenchConfig, out):
    """``--explain`` before the race: hybrid's cost report, the link plan (returned) and the
    machine's set-up."""
    model = create_model(config.arch, num_classes=config.num_classes)
    spec = config.handicap_spec()  # per-sample times of a handicap: 1, or F for device I
    per_sample = None if spec is None else [
        spec[1] if i == spec[0] else 1.0 for i in range(len(config.device_list))]
    print(explain(model, config.device_list, config.batch_size, config.image_size,
                  config.ideal_split(), per_sample), file=out)
    link = plan_link(model, config.batch_size, config.processes(),
                     backend=wire_backend(config.device_list[0]))
    print(link.report(config.link_bytes_per_s()), file=out)
    print(run_setup(config.device_list, config.threads), file=out)
    return link


def _planned(config: BenchConfig) -> dict:
    """The bytes the plans predict: the one-process strategies' between devices, the
    multi-process ones' that each process sends (the torchrun phase's, one per device)."""
    model = create_model(config.arch, num_classes=config.num_classes)
    planned = planned_bytes(model, config.device_list, config.batch_size, config.image_size)
    if planned:
        planned.update(planned_process_bytes(model, config.batch_size, len(config.device_list),
                                             backend=wire_backend(config.device_list[0])))
    return planned


def run(args: argparse.Namespace) -> int:
    if args.data is not None:
        report = _run_data(args) if args.arch is None else _run_fed(args)
        if args.json:
            write_json(report, args.json)
        return 0
    if args.arch is None:
        raise UsageError("bench needs --arch (or --data DIR to time the input pipeline)")
    config, out = config_from_args(BenchConfig, args), _out(args)
    link = _explain(config, out) if args.explain else None
    report = run_bench(config)
    print(format_table(report), file=out)
    if link is not None:  # the plans' bytes next to the measured times, and the measured link
        print(planned_vs_measured(report, _planned(config)), file=out)
        measured = link.measured_line(report["link"]["rates_bytes_per_s"]["measured"],
                                      len(config.device_list))
        if measured:
            print(measured, file=out)
    if args.json:
        write_json(report, args.json)
    return 1 if any(r["status"] == "failed" for r in report["results"]) else 0
