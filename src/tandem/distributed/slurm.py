"""A SLURM allocation's shape, for ``tandem launch`` run by ``srun`` on every node: the first
host of the node list serves the rendezvous, on a port derived from the job id (the same on
every node, different for two jobs sharing one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from tandem.errors import UsageError

#: ports derived from a job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN)
PORT_BASE, PORT_SPAN = 15000, 20000


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def describe(self) -> str:
        return (f"SLURM job {self.job_id}: node {self.node_rank} of {self.nnodes}, master "
                f"{self.master_addr}:{self.master_port} (SLURM_NNODES, SLURM_NODEID, the first "
                "host of SLURM_JOB_NODELIST; the port from the job id)")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    match = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match or not match.group(1).strip():
        raise UsageError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.group(1).strip(), match.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0].strip() if ranges else "")


def slurm_job(environ: Mapping[str, str]) -> SlurmJob | None:
    """The allocation this process runs in under ``srun``, or None outside SLURM."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id or "SLURM_NODEID" not in environ:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    try:
        nnodes = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "")
        node_rank = int(environ["SLURM_NODEID"])
        port = PORT_BASE + int(job_id) % PORT_SPAN
    except ValueError:
        raise UsageError("SLURM's variables do not describe a job (SLURM_NNODES, SLURM_NODEID "
                         "and SLURM_JOB_ID must be numbers)") from None
    return SlurmJob(job_id, nnodes, node_rank, first_host(nodelist), port)
