"""The checkpoint a job continues, decided by rank 0 and sent to the machines that lack it.

Only rank 0 writes the run directory. Each machine's first rank looks for the file on its own
disk; where it is missing or differs (by SHA-256), rank 0 broadcasts its bytes in chunks to
those first ranks only, which write a temporary file the machine's other ranks read too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from tandem.errors import TandemError

from .agree import Agreement
from .env import DistEnv

#: bytes per broadcast
CHUNK = 64 << 20


class ResumeRefused(TandemError, ValueError):
    """The checkpoint sent by rank 0 arrived damaged."""


class Continued(NamedTuple):
    """Rank 0's path of the checkpoint (None: a fresh run), a file here with its bytes (a copy
    sent, which :func:`done_with` removes), whether torchrun restarted the run, and whether a
    copy was sent to any machine (the same on every rank)."""

    path: str | None
    local: str | None
    restarted: bool
    sent: bool = False


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def continue_from_rank0(decide: Callable[[], tuple[str | None, bool]],
                        agreement: Agreement) -> Continued:
    """``decide()`` on rank 0 (``(path or None, restarted)``), heard by every rank; on the
    others, a local file with rank 0's bytes (their machine's own copy when it is the same).
    Rank 0's refusal is raised on every rank."""
    def decision():
        path, restarted = decide()
        return path, restarted, (_sha256(path) if path else None)

    path, restarted, sha = agreement.rank0(decision)
    if path is None or not agreement.several:
        return Continued(path, path, restarted)
    env = agreement.env
    leader = env.local_rank == 0  # the machine's first rank looks, and receives for it
    own = leader and os.path.isfile(path)
    same = own and (env.rank == 0 or _sha256(path) == sha)
    needs = agreement.each(leader and not same)
    local = _tempname(sha, env)
    if any(needs):
        _send(path, local, needs, env.rank)
        agreement.any_of(False)  # each machine's first rank has written it: the others read
    if needs[env.rank]:
        if _sha256(local) != sha:
            os.unlink(local)
            raise ResumeRefused("the checkpoint sent by rank 0 arrived damaged (its SHA-256 "
                                "differs)")
        what = "differs from rank 0's" if own else "is not on this machine"
        print(f"{agreement.peer_name(env.rank)}: {path} {what}; using rank 0's (sent over "
              f"the network, {os.path.getsize(local) / 2**20:.1f} MiB)", file=sys.stderr,
              flush=True)
    # the machine's other ranks read what its first rank holds: its own copy or the one sent
    first = env.rank - env.local_rank
    return Continued(path, local if needs[first] else path, restarted, any(needs))


def done_with(continued: Continued, agreement: Agreement) -> None:
    """After every rank read it, the machine's first rank removes a copy sent (every rank calls)."""
    if not continued.sent:  # the same on every rank, as the collective below must be
        return
    agreement.any_of(False)  # every rank has read it
    if agreement.env.local_rank == 0 and continued.local != continued.path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(continued.local)


def _tempname(sha: str | None, env: DistEnv) -> str:
    """The file a machine's first rank writes rank 0's bytes to, named by the job's port and
    that rank (nodes sharing a temporary directory never write the same file)."""
    return os.path.join(tempfile.gettempdir(), f"tandem-resume-{(sha or '')[:16]}-"
                        f"{env.master_port}-{env.rank - env.local_rank}.pt")


def _send(path: str, local: str, needs: list[bool], rank: int) -> None:
    """Broadcast rank 0's file in chunks on a group of the ranks that need it (every rank takes
    part in making it); each receiver writes ``local``."""
    members = [0] + [r for r, need in enumerate(needs) if need and r != 0]
    group = dist.new_group(members, backend="gloo")
    try:
        if rank not in members:
            return
        size = torch.tensor([os.path.getsize(path) if rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        total = int(size.item())
        with (open(path, "rb") if rank == 0 else open(local + ".part", "wb")) as f:
            for start in range(0, total, CHUNK):
                n = min(CHUNK, total - start)
                chunk = (torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8) if rank == 0
                         else torch.empty(n, dtype=torch.uint8))
                dist.broadcast(chunk, src=0, group=group)
                if rank != 0:
                    f.write(chunk.numpy().tobytes())
        if rank != 0:
            os.replace(local + ".part", local)
    finally:
        dist.destroy_process_group(group)
