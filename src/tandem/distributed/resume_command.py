"""The command a message gives for continuing a run: ``tandem train --resume``, or under
``tandem launch`` as the job was launched, with each node's own flags.
"""

from __future__ import annotations

from .env import DistEnv

#: up to this many nodes a message lists each node's command; past it, one with ``R``
_LISTED_NODES = 4


def resume_command(target: str, multiprocess: bool = False, processes: int = 1,
                   nodes: int = 1) -> str:
    """The command that continues ``target`` (a run directory or checkpoint) with ``processes``
    processes on ``nodes`` machines under a ``multiprocess`` strategy or not."""
    if not multiprocess:
        return f"tandem train --resume {target}"
    where = "" if nodes <= 1 else f" --nnodes {nodes} (on every node)"
    return (f"tandem launch --nproc-per-node {processes // max(1, nodes)}{where} -- "
            f"train --resume {target}")


def launch_command(launch: dict, node: int | str | None = None) -> str:
    """``tandem launch`` with the flags this job was launched with (``launch``: the
    ``TANDEM_LAUNCH`` description), for node ``node`` where nodes differ."""
    parts = ["tandem launch", f"--nproc-per-node {launch['nproc_per_node']}"]
    nnodes = str(launch.get("nnodes") or "1")
    if launch.get("slurm"):
        parts.insert(0, "srun")  # SLURM gives each node its rank and the master again
    elif launch.get("rdzv_endpoint"):
        parts += [f"--nnodes {nnodes}", f"--rdzv-endpoint {launch['rdzv_endpoint']}"]
        parts += [f"--{k.replace('_', '-')} {launch[k]}" for k in ("rdzv_backend", "rdzv_id",
                                                                    "rdzv_conf")
                  if launch.get(k)]
    elif nnodes != "1":
        parts += [f"--nnodes {nnodes}", f"--node-rank {node}",
                  f"--master-addr {launch['master_addr']}", f"--master-port {launch['master_port']}"]
    for key in ("max_restarts", "dist_timeout", "join_timeout", "iface"):
        if launch.get(key):
            parts.append(f"--{key.replace('_', '-')} {launch[key]}")
    return " ".join(parts)


def resume_command_here(target: str, env: DistEnv | None, this_node: bool = False) -> str:
    """:func:`resume_command` for the job of ``env`` (``None``: one process): as ``tandem
    launch`` started it (every node's command, or this node's), else from torchrun's sizes."""
    if env is None:
        return resume_command(target)
    launch = env.launch
    if launch is None:
        return resume_command(target, True, env.world_size,
                              env.world_size // max(1, env.local_world_size))
    tail = f" -- train --resume {target}"
    nnodes = str(launch.get("nnodes") or "1")
    if nnodes == "1" or launch.get("slurm") or launch.get("rdzv_endpoint"):
        every = " (on every node)" if nnodes != "1" else ""
        return launch_command(launch) + tail + every
    count = int(nnodes.split(":")[-1])
    if this_node:
        return f"on node {env.node}: {launch_command(launch, env.node)}{tail}"
    if count > _LISTED_NODES:
        return f"on node R (0 to {count - 1}): {launch_command(launch, 'R')}{tail}"
    return "; ".join(f"on node {r}: {launch_command(launch, r)}{tail}" for r in range(count))
