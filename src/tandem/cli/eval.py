"""``tandem eval --resume PATH``: validate a checkpoint and print its loss and accuracy; the
run's settings come from the checkpoint, and a flag given here overrides them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from tandem.config import DataConfig, OptimConfig, ParallelConfig, RunConfig
from tandem.distributed.env import Environment, in_torchrun, place_of
from tandem.errors import UsageError
from tandem.models import model_info
from tandem.strategies import strategy_class
from tandem.train.evaluate import evaluate
from tandem.train.metrics import eval_scores
from tandem.train.run import describe_compile

from .common import add_config_arguments, config_from_args, tandem_warnings

_DATA_FLAGS = ("data", "image_size", "num_classes", "synthetic_size", "workers", "decode")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval", help="validate a checkpoint",
        description="Validate a checkpoint (tandem's, or the imagenet example's, including "
                    "module.-prefixed ones from torch's DataParallel). A tandem run is evaluated "
                    "at its own image size and precision. A file without tandem's config is "
                    "evaluated as the example does: plain cross-entropy, an ImageFolder at the "
                    "arch's native size and fixed-size data at its own, unless "
                    "--label-smoothing or --image-size say otherwise. A bare state dict names "
                    "no arch: give it with -a.")
    parser.add_argument("--resume", "--checkpoint", dest="resume", required=True,
                        metavar="PATH", help="checkpoint to validate")
    model = parser.add_argument_group("model")
    model.add_argument("-a", "--arch", default=None, metavar="ARCH",
                       help="architecture of a file that names none, such as a bare "
                            "torch.save(model.state_dict()) (default: the file's 'arch'; see "
                            "`tandem models`)")
    group = parser.add_argument_group("data (default: as the checkpoint was trained)")
    add_config_arguments(group, DataConfig, only=_DATA_FLAGS,
                         defaults={name: None for name in _DATA_FLAGS})
    group.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                       help=f"global validation batch size (default: the run's --batch-size; "
                            f"{OptimConfig.batch_size} for a file from elsewhere)")
    group.add_argument("--seed", type=int, default=None, metavar="S",
                       help=f"seed, which matters for synthetic data only (default: the run's "
                            f"--seed; {RunConfig.seed} for a file from elsewhere)")
    add_config_arguments(group, OptimConfig, only=("label_smoothing",),
                         defaults={"label_smoothing": None})
    add_config_arguments(parser, ParallelConfig, title="parallelism",
                         only=("strategy", "devices", "sync_bn", "amp", "amp_dtype", "dtype",
                               "channels_last", "compile", "compile_mode"),
                         defaults={"amp": None})  # None: the run's own precision
    parser.add_argument("--no-amp", dest="amp", action="store_false",
                        help="evaluate in float32, also a run trained with --amp (default: "
                             "the run's precision)")
    parser.add_argument("--ema", action="store_true",
                        help="evaluate the checkpoint's exponential moving average of the "
                             "weights (a run trained with --model-ema) instead of its weights")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write one JSON object (arch, loss, label_smoothing, plain_ce: "
                             "plain cross-entropy beside a label-smoothed loss, acc1, acc5, "
                             "count; acc = acc1) to PATH, as tandem bench's --json; alone or "
                             "'-': to stdout, instead of the line")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"bad --batch-size {args.batch_size}: must be >= 1")
    if args.label_smoothing is not None:
        OptimConfig(label_smoothing=args.label_smoothing)  # its check, naming the flag
    data = {name: getattr(args, name) for name in _DATA_FLAGS if getattr(args, name) is not None}
    DataConfig(**data)  # check the overrides alone, for a message naming the flag
    if args.arch is not None:
        model_info(args.arch)  # a typo: the closest names, before any file is read
    parallel = config_from_args(ParallelConfig, args, amp=False, amp_dtype=None)
    _check_launched(parallel, args)
    to_stdout = args.json == "-"  # stdout is then one JSON object, and the notes go to stderr
    with tandem_warnings(notes_to_stderr=to_stdout):
        result = evaluate(args.resume, parallel=parallel, data=data, batch_size=args.batch_size,
                          seed=args.seed, label_smoothing=args.label_smoothing, arch=args.arch,
                          amp=args.amp, amp_dtype=args.amp_dtype, ema=args.ema,
                          place=place_of(Environment.read()))
    note, precision = result.pop("note"), result.pop("precision")
    if not result.pop("is_main"):
        return 0  # under ddp every rank validates its share; rank 0 reports the total
    for line in filter(None, (note, precision)):  # on stderr with --json (stdout: the JSON)
        print(line, file=sys.stderr if to_stdout else sys.stdout)
    if args.ema:
        result["ema"] = True  # the figures are the EMA's
    if to_stdout:
        print(json.dumps(result))
        return 0
    if args.json:
        _write_json(result, args.json)
    if result["compile_seconds"] is not None:
        print(describe_compile(result["compile_seconds"], args.compile_mode))
    which = " (its EMA of the weights)" if args.ema else ""
    print(f"{args.resume}{which}: {result['arch']} {eval_scores(result)} "
          f"({result['count']} images)")
    return 0


def _write_json(result: dict, path: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write --json '{path}': {exc.strerror or exc}") from None


def _check_launched(parallel: ParallelConfig, args: argparse.Namespace) -> None:
    """A multi-process strategy outside torchrun: refused with the ``tandem launch`` command."""
    if in_torchrun(Environment.read()) or not strategy_class(parallel.strategy).multiprocess:
        return
    typed = " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or ["eval", "..."])
    raise UsageError(f"--strategy {parallel.strategy} runs one process per device",
                     hint=f"run it with `tandem launch --nproc-per-node N -- {typed}` or torchrun")
