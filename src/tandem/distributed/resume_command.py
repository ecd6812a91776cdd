"""The command a message gives for continuing a run: ``tandem train --resume``, or under
``tandem launch`` with as many processes (and nodes) for a multi-process strategy.

It lives here, not in a strategy: it is about how processes are started, and the train layer
(which prints it) may import this layer, not the CLI's.
"""

from __future__ import annotations

__all__ = ["resume_command", "resume_command_here"]


def resume_command(target: str, multiprocess: bool = False, processes: int = 1,
                   nodes: int = 1) -> str:
    """The command that continues ``target`` (a run directory or checkpoint) under a strategy
    that is ``multiprocess`` or not, run by ``processes`` processes on ``nodes`` machines;
    flags may follow."""
    if not multiprocess:
        return f"tandem train --resume {target}"
    where = "" if nodes <= 1 else f" --nnodes {nodes} (on every node)"
    return (f"tandem launch --nproc-per-node {processes // max(1, nodes)}{where} -- "
            f"train --resume {target}")


def resume_command_here(target: str, multiprocess: bool) -> str:
    """:func:`resume_command` for the job this process is part of (torchrun's environment)."""
    if not multiprocess:
        return resume_command(target)
    from .env import read_env

    env = read_env(who="a multi-process strategy")
    return resume_command(target, True, env.world_size,
                          env.world_size // max(1, env.local_world_size))
