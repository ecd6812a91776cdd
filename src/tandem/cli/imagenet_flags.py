"""The imagenet example's own command line on ``tandem train``: ``DIR``, ``--gpu N``,
``--no-accel`` and ``--dummy``; its distributed flags are refused with the equivalent
``tandem launch`` command, ``--start-epoch`` because ``--resume`` gives the epoch.
"""

from __future__ import annotations

import argparse
import os
import shlex
from urllib.parse import urlparse

from tandem.config import NO_WEIGHTS_FILE, OptimConfig, ParallelConfig
from tandem.data.synthetic import split_sizes
from tandem.errors import UsageError
from tandem.factory import is_reference
from tandem.models import model_info
from tandem.strategies import strategy_names
from tandem.train.settings import EXAMPLE_CLASSES, IMAGEFOLDER_ARCH

from .common import add_config_arguments

_DIST = ("dist_url", "dist_backend", "world_size", "rank", "multiprocessing_distributed")


def add_example_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``DIR``, ``--gpu`` and the example's flags that tandem answers with an error."""
    parser.add_argument("data_dir", nargs="?", default=None, metavar="DIR",
                        help="dataset directory, as in the imagenet example (same as --data DIR)")
    group = parser.add_argument_group("imagenet example compatibility")
    _add_gpu(group)
    group.add_argument("--no-accel", action="store_true",
                       help="the example's --no-accel: same as --devices cpu")
    group.add_argument("--dummy", action="store_true",
                       help="the example's --dummy: --data synthetic, for an ImageNet arch at "
                            "its native size with 1000 classes (without -a: resnet18, the "
                            "example's default)")
    group.add_argument("--start-epoch", type=int, default=None, metavar="N",
                       help="not supported: --resume FILE continues at the epoch stored in FILE")
    _add_distributed(group)


def _add_gpu(group) -> None:
    group.add_argument("--gpu", type=int, default=None, metavar="N",
                       help="the example's --gpu N: same as --devices cuda:N")


def _add_distributed(group) -> None:
    for flag, meta in (("--dist-url", "URL"), ("--dist-backend", "NAME"),
                       ("--world-size", "N"), ("--rank", "R")):
        group.add_argument(flag, default=None, metavar=meta,
                           help="refused: prints the equivalent `tandem launch` command")
    group.add_argument("--multiprocessing-distributed", action="store_true",
                       help="refused: prints the equivalent `tandem launch` command")


def example_overrides(args: argparse.Namespace) -> tuple[dict, set[str]]:
    """Config values implied by the example's flags, and the field names they count as given."""
    if any(getattr(args, name, None) not in (None, False) for name in _DIST):
        note = batch_note(args)
        raise UsageError("tandem runs several processes through `tandem launch`, not with "
                         "--dist-url/--world-size/--rank/--multiprocessing-distributed",
                         hint="run: " + launch_command(args) + (f" ({note})" if note else ""))
    if args.start_epoch is not None:
        raise UsageError("--start-epoch is not supported: --resume FILE continues at the epoch "
                         "stored in FILE, and a fresh run starts at epoch 1")
    given = set(getattr(args, "given_fields", ()))
    values: dict = {}
    if args.data_dir is not None:
        if "data" in given and args.data != args.data_dir:
            raise UsageError(f"two datasets given: DIR {args.data_dir} and --data {args.data}")
        values["data"] = args.data_dir
    if getattr(args, "dummy", False):
        other = values.get("data", args.data if "data" in given else "synthetic")
        if other != "synthetic":
            raise UsageError(f"two datasets given: --dummy (same as --data synthetic) and "
                             f"{other}: give one")
        values["data"] = "synthetic"
        if "arch" not in given:  # the example's default arch, as its --dummy trains it
            values["arch"] = IMAGEFOLDER_ARCH
        values.update(_dummy_shape(values.get("arch", args.arch), given))
    if getattr(args, "no_accel", False):
        if args.gpu is not None or ("devices" in given and args.devices != "cpu"):
            other = f"--gpu {args.gpu}" if args.gpu is not None else f"--devices {args.devices}"
            raise UsageError(f"--no-accel (same as --devices cpu) and {other} disagree: give one")
        values["devices"] = "cpu"
    if args.gpu is not None:
        if args.gpu < 0:
            raise UsageError(f"bad --gpu {args.gpu}: must be >= 0")
        if "devices" in given and args.devices != f"cuda:{args.gpu}":
            raise UsageError(f"--gpu {args.gpu} and --devices {args.devices} disagree: give one")
        values["devices"] = f"cuda:{args.gpu}"
    pretrained = getattr(args, "pretrained", None)
    if pretrained and os.path.isdir(pretrained) and args.data_dir is None:
        # `--pretrained DIR`, the example's habit: the flag took the data directory
        raise UsageError(f"{NO_WEIGHTS_FILE}; '{pretrained}' is a directory (put the data "
                         f"directory before --pretrained or use --data)")
    return values, set(values)


def _dummy_shape(arch: str, given: set[str]) -> dict:
    """``--dummy``'s native size and 1000 classes for an ImageNet ``arch``, each unless typed."""
    if is_reference(arch) or model_info(arch).default_num_classes != EXAMPLE_CLASSES:
        return {}
    shape = {"image_size": model_info(arch).native_input_size, "num_classes": EXAMPLE_CLASSES}
    return {name: value for name, value in shape.items() if name not in given}


def dummy_line(args: argparse.Namespace, cfg) -> str | None:
    """The line saying what ``--dummy`` trains in ``cfg`` (``None``: not asked, or not ImageNet)."""
    arch, data = cfg.model.arch, cfg.data
    if not getattr(args, "dummy", False) or not _dummy_shape(arch, set()):
        return None
    train, val = split_sizes(data.synthetic_size)
    side = data.image_size
    which = ("" if "arch" in getattr(args, "given_fields", ()) else
             f"{arch} (the imagenet example's default -a), on ")
    return (f"--dummy: {which}random 3x{side}x{side} images of {data.num_classes} classes, as "
            f"the imagenet example's ({arch}'s native size; --image-size and --num-classes "
            f"to change); {train} to train and {val} to validate (--synthetic-size to change)")


def _train_args(argv: list[str]) -> list[str]:
    """``argv`` after ``train`` without the flags the launch command drops or replaces, as
    argparse finds them (``--dist-ur X``, ``--gpu=0`` too)."""
    replaced = argparse.ArgumentParser(add_help=False)
    _add_gpu(replaced)
    _add_distributed(replaced)
    add_config_arguments(replaced, ParallelConfig, only=("devices", "strategy"))
    add_config_arguments(replaced, OptimConfig, only=("batch_size",))
    # train's parser (a superset) read argv: an abbreviation it took for one of these is
    # unique here too, and no train flag is a prefix of these
    return replaced.parse_known_args(argv[1:] if argv[:1] == ["train"] else argv)[1]


def launch_command(args: argparse.Namespace) -> str:
    """The ``tandem launch`` command that runs what the example's distributed flags asked for."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cmd = ["tandem", "launch", "--nproc-per-node", str(gpus or 1)]
    nodes = _nodes(args)
    if nodes > 1:
        cmd += ["--nnodes", str(nodes), "--node-rank", str(args.rank or 0)]
        url = urlparse(args.dist_url or "")
        if url.hostname:
            cmd += ["--master-addr", url.hostname]
        if url.port:
            cmd += ["--master-port", str(url.port)]
    rest = _train_args(list(getattr(args, "argv", None) or []))
    if "batch_size" in getattr(args, "given_fields", ()):
        # the example's -b is each machine's batch (split over its GPUs), tandem's the global
        rest += ["-b", str(args.batch_size * nodes)]
    multi = strategy_names(multiprocess=True)[0]  # one process per device, like the example
    cmd += ["--", "train", *rest, "--strategy", multi, "--devices", "cuda" if gpus else "cpu"]
    return shlex.join(cmd)


def _nodes(args: argparse.Namespace) -> int:
    return int(args.world_size) if str(args.world_size or "").isdigit() else 1


def batch_note(args: argparse.Namespace) -> str | None:
    """What :func:`launch_command` did to the example's ``-b`` on several machines, or ``None``."""
    nodes = _nodes(args)
    if nodes < 2 or "batch_size" not in getattr(args, "given_fields", ()):
        return None
    return (f"-b {args.batch_size * nodes}: the example's -b {args.batch_size} is each of the "
            f"{nodes} machines' batch, and tandem's -b the global one")
