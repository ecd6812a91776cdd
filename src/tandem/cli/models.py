"""``tandem models``: list every model with its parameters and MACs at its native input size.

Models are built on the meta device, so nothing is allocated or computed.
"""

from __future__ import annotations

import argparse
import json

import torch

from tandem.errors import UsageError
from tandem.models import count_macs, count_parameters, create_model, list_models, model_info
from tandem.suggest import closest_names


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "models", help="list the model zoo",
        description="List models: parameters and multiply-accumulates (Conv + Linear) of one "
                    "image at the model's native input size.")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these models (default: all)")
    p.add_argument("--input-size", type=int, default=None, metavar="N",
                   help="count MACs at NxN instead of each model's native size")
    p.add_argument("--num-classes", type=int, default=None, metavar="K",
                   help="classifier outputs (default: the model's own, 1000 or 10)")
    p.add_argument("--in-channels", type=int, default=3, metavar="C",
                   help="input channels (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object per model")
    p.add_argument("-a", "--arch", nargs="?", action=_NamesNotArch, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


class _NamesNotArch(argparse.Action):
    """``tandem models -a NAME``: one line saying that ``models`` takes names, and the command."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list_models()
        name = values if values in names else next(iter(closest_names(values or "", names)),
                                                   "resnet50")
        parser.error(f"models takes model names, not {option_string}: tandem models {name}")


def model_rows(names: list[str], input_size: int | None = None, num_classes: int | None = None,
               in_channels: int = 3) -> list[dict]:
    """One dict per model: name, family, params, macs, input_size, num_classes."""
    rows = []
    for name in names:
        info = model_info(name)  # ValueError listing valid names when unknown
        size = info.native_input_size if input_size is None else input_size
        if size < info.min_input_size:
            raise UsageError(f"model {name!r} needs inputs of at least "
                             f"{info.min_input_size}x{info.min_input_size}, got {size}x{size}")
        with torch.device("meta"):
            model = create_model(name, num_classes=num_classes, in_channels=in_channels)
        rows.append({
            "name": name, "family": info.family, "params": count_parameters(model),
            "macs": count_macs(model, (1, in_channels, size, size)), "input_size": size,
            "num_classes": info.default_num_classes if num_classes is None else num_classes})
    return rows


def run(args: argparse.Namespace) -> int:
    rows = model_rows(args.names or list_models(), args.input_size, args.num_classes,
                      args.in_channels)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    header = f"{'model':<18}{'parameters':>14}{'GMACs':>10}{'input':>10}{'classes':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        size = f"{r['input_size']}x{r['input_size']}"
        print(f"{r['name']:<18}{r['params']:>14,}{r['macs'] / 1e9:>10.3f}{size:>10}"
              f"{r['num_classes']:>9}")
    print("MACs: Conv + Linear multiply-accumulates for one image (see tandem.models.macs).")
    return 0
