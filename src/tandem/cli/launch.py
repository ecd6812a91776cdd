"""``tandem launch``: run a tandem command (everything after ``--``) on N processes per
machine with torchrun (:mod:`tandem.distributed.torchrun`).
"""

from __future__ import annotations

import argparse
import os

from tandem.config import TrainConfig
from tandem.distributed.env import Environment
from tandem.distributed.slurm import slurm_job
from tandem.distributed.torchrun import LaunchSpec, launch
from tandem.strategies.auto import AUTO, check_launchable
from tandem.train.rundir import RunDir

from . import train as train_command
from .common import command_parser, given_fields
from .train import config_from_namespace


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch", help="run a tandem command on several processes/machines (torchrun)",
        description="Run `tandem COMMAND` once per worker with torch.distributed.run (torchrun), "
                    "e.g. `tandem launch --nproc-per-node 2 -- train --strategy ddp ...`. If a "
                    "worker fails, every worker is stopped and the exit status is non-zero.")
    p.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                   help="worker processes on this machine (one per device)")
    p.add_argument("--nnodes", default=None, metavar="M",
                   help="number of machines (or MIN:MAX with --rdzv-endpoint); default 1, or "
                        "SLURM_NNODES under srun")
    p.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this machine's index, 0 .. M-1 (node 0 hosts the rendezvous); "
                        "default 0, or SLURM_NODEID under srun")
    p.add_argument("--master-addr", default=None, metavar="ADDR",
                   help="address of node 0 (default 127.0.0.1 on one machine; under srun the "
                        "first host of SLURM_JOB_NODELIST)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="port on node 0 (default, or 0: a free port, one machine only; under "
                        "srun one derived from SLURM_JOB_ID)")
    p.add_argument("--iface", default=None, metavar="NAME",
                   help="network interface the workers talk through (default: the one that reaches "
                        "the master; GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME as set are kept)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="dynamic rendezvous endpoint instead of --master-addr/--master-port")
    p.add_argument("--rdzv-backend", default=None, metavar="NAME",
                   help="rendezvous backend with --rdzv-endpoint (default c10d)")
    p.add_argument("--rdzv-id", default=None, metavar="ID",
                   help="job id shared by every machine with --rdzv-endpoint")
    p.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="torchrun's rendezvous settings with --rdzv-endpoint, e.g. "
                        "last_call_timeout=10: how long a job whose nodes changed waits for "
                        "more before it goes on (torch's default 30 s)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the worker group up to K times after a failure")
    p.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a worker waits in a collective for a dead or stuck peer "
                        "(default: TANDEM_DIST_TIMEOUT or 120)")
    p.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a node waits for the other nodes to come (default 300)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the tandem command and its flags")
    p.set_defaults(func=run)
    return p


def spec_of(args: argparse.Namespace) -> LaunchSpec:
    """The checked :class:`LaunchSpec` of ``tandem launch``'s flags (and SLURM's variables)."""
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    return LaunchSpec(
        nproc_per_node=args.nproc_per_node, command=command, **_from_slurm(args),
        rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id, rdzv_conf=args.rdzv_conf,
        max_restarts=args.max_restarts, dist_timeout=args.dist_timeout,
        iface=args.iface, join_timeout=args.join_timeout)


def run(args: argparse.Namespace) -> int:
    spec = spec_of(args)
    if spec.command[0] == "train":
        _check_multiprocess(spec.command, spec.multi_node and spec.node_rank > 0)
    return launch(spec)


def _from_slurm(args: argparse.Namespace) -> dict:
    """The node count, rank and master: as given, else from SLURM's under ``srun`` (one line)."""
    given = dict(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                 master_port=args.master_port, slurm=False)
    job = None if args.rdzv_endpoint else slurm_job(Environment.read())
    if job is not None and job.nnodes > 1:
        taken = dict(nnodes=str(job.nnodes), node_rank=job.node_rank,
                     master_addr=job.master_addr, master_port=job.master_port)
        filled = {k: v for k, v in taken.items() if given[k] is None}
        if filled:
            print(f"tandem launch: {job.describe()}", flush=True)
        given.update(filled, slurm=bool(filled))
    given["nnodes"] = given["nnodes"] or "1"
    given["node_rank"] = given["node_rank"] or 0
    return given


def _check_multiprocess(command: list[str], other_node: bool = False) -> None:
    """Refuse a ``train`` whose strategy, as the workers will read it, is not one process per
    device; a resumed run without the flag keeps its own (on a node other than 0: rank 0's)."""
    args = command_parser({"train": train_command}).parse_args(command)  # a bad flag: theirs
    args.argv = list(command)
    cfg = config_from_namespace(args)
    resume, name = cfg.run.resume, cfg.parallel.strategy
    if resume and "strategy" not in given_fields(args):
        if other_node:  # no shared disk assumed: node 0's copy of the run is the one that counts
            name = AUTO  # the workers' plan makes auto the multi-process one
        else:
            run = RunDir(resume) if os.path.isdir(resume) else RunDir.of(resume)
            try:
                name = TrainConfig.from_dict(run.read_config()).parallel.strategy
            except (ValueError, TypeError, AttributeError):  # no run's config: the default
                pass
    check_launchable(name)
