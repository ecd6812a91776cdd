"""``tandem bench``: time training steps of several strategies side by side, a thin command
over the harness beside the library (:mod:`tandem_bench.cli`), which training never imports.
"""

from __future__ import annotations

import argparse

from tandem.errors import UsageError

__all__ = ["add_parser"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    try:
        from tandem_bench import cli
    except ModuleNotFoundError as exc:  # the harness not installed: the command says so
        if exc.name != "tandem_bench":
            raise
        # every argument taken as typed ('\0' prefixes no flag), to reach the one-line error
        p = subparsers.add_parser("bench", help="time training steps (needs tandem_bench)",
                                  add_help=False, prefix_chars="\0")
        p.add_argument("typed", nargs=argparse.REMAINDER)
        p.set_defaults(func=_missing)
        return p
    return cli.add_parser(subparsers)


def _missing(args: argparse.Namespace) -> int:
    raise UsageError("tandem bench needs the benchmark harness (package tandem_bench), which "
                     "is not installed", hint="install tandem from its repository with the "
                     "harness beside it: pip install -e .")
