"""`tandem` command line: ``train | eval | bench | launch | models``. A
:class:`tandem.errors.TandemError` becomes one line on stderr (and a ``hint:``) and its exit
status (2; 3 when training diverged; 4 for a lost peer, :mod:`tandem.distributed.faults`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tandem.distributed import faults
from tandem.distributed.agree import Agreement
from tandem.distributed.env import Environment, read_env, several_processes
from tandem.errors import TandemError
from tandem.version import __version__

from . import bench, launch, models, train
from . import eval as eval_command
from .common import command_parser, error_line, error_lines


_MODULES = {"train": train, "eval": eval_command, "bench": bench, "launch": launch,
            "models": models}
SUBCOMMANDS = list(_MODULES)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(_MODULES, version=f"tandem {__version__}")


def _job_env():
    """torchrun's variables in a job of several processes (``None``: none, or not torchrun's)."""
    environ = Environment.read()
    try:
        return read_env(environ) if several_processes(environ) else None
    except TandemError:
        return None


#: seconds a rank that leaves an error to rank 0 waits before it exits, when the ranks have
#: not met (torchrun stops the other workers the moment one exits)
QUIET_EXIT_GRACE = 5.0


def _met() -> bool:
    """This process joined its job's process group (rank 0 hears of a failure from then on)."""
    group = sys.modules.get("tandem.distributed.process_group")
    return group is not None and group.joined_a_group()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # `tandem` alone: what it does and its commands, as git's usage
        print(parser.format_help(), end="")
        return 2
    args = parser.parse_args(argv)
    args.argv = argv  # as typed, for messages that echo a command (imagenet_flags)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that left meets it here, not at the interpreter's exit
        return code
    except (TandemError, RuntimeError) as exc:  # anything else keeps its traceback
        env = _job_env()  # the job this process is a rank of (None: none), read once here
        if not isinstance(exc, TandemError):  # a torchrun job's peer lost outside the loop
            if env is None or not faults.is_peer_failure(exc):
                raise
            exc = faults.lost_peer(exc, Agreement(env.rank, env.world_size, env=env), "")
        if not exc.quiet:  # ranks other than 0 leave it to rank 0
            print(*error_lines(exc), sep="\n", file=sys.stderr)
        elif env is not None and not _met():
            # before the workers meet each rank refuses alike, and only rank 0 says it: its line
            # must come out before torchrun's agent stops every worker at this one's exit
            time.sleep(QUIET_EXIT_GRACE)
        faults.tell_others(exc, error_line(exc), env)
        return exc.exit_status
    except BrokenPipeError:  # the reader left (`tandem models | head`): stop quietly, as cat
        # does; stdout goes to /dev/null so that the interpreter's last flush fails no more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as exc:
        detail = str(exc)
        if not getattr(exc, "quiet", False):  # ranks other than 0 leave it to rank 0
            print("tandem: interrupted" + (f"; {detail}" if detail else ""), file=sys.stderr)
        return 128 + int(getattr(exc, "signum", signal.SIGINT))


def entry() -> None:
    """``tandem``: :func:`main`, then exit with its status (``exit_process`` once in a group)."""
    code = main()
    group = sys.modules.get("tandem.distributed.process_group")
    if group is not None:
        group.exit_process(code)
    sys.exit(code)
