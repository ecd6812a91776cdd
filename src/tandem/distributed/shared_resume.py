"""The checkpoint a job continues, decided by rank 0 and sent to the ranks that lack it.

Only rank 0 writes the run directory, so another machine (with a disk of its own) has no copy
of it. Under several processes, rank 0 alone decides what the job continues (``--resume``, or
the run a restart picks up) and says so through the job's store; a rank whose own copy of that
file is missing, or differs from rank 0's (by SHA-256), gets rank 0's bytes through the store
in chunks and says so in one line. The store is the launcher's, so this works before any
process group exists (the run's plan reads the checkpoint before it joins one).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Callable, NamedTuple

from tandem.errors import TandemError, first_line

from . import join
from .env import read_env

__all__ = ["Continued", "continue_from_rank0", "ResumeRefused"]

#: bytes per store value (the store takes at most 8 MiB in one message)
CHUNK = 4 << 20


class ResumeRefused(TandemError, ValueError):
    """The checkpoint to continue could not be shared: rank 0 refused the resume (it says why;
    the other ranks end quietly), or its bytes arrived damaged."""


class Continued(NamedTuple):
    """Rank 0's path of the checkpoint to continue (None: a fresh run), a file on this machine
    with its bytes, and whether torchrun restarted the run."""

    path: str | None
    local: str | None
    restarted: bool


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def continue_from_rank0(decide: Callable[[], tuple[str | None, bool]], bound: float
                        ) -> Continued:
    """``decide()`` on rank 0 (``(path or None, restarted)``), shared with every rank of the
    job; on the others, a local file with rank 0's bytes (their own copy when it is the same).
    ``bound``: seconds to wait for rank 0 or for the ranks' answers."""
    env = read_env()
    store = join.job_store(env, bound)
    prefix = join.attempt_prefix("resume")
    if env.rank == 0:
        return _send(env, store, prefix, decide, bound)
    return _receive(env, store, prefix)


def _send(env, store, prefix: str, decide, bound: float) -> Continued:
    try:
        path, restarted = decide()
    except TandemError as exc:
        store.set(f"{prefix}/decision", json.dumps({"error": first_line(exc, None)}))
        raise
    sha = _sha256(path) if path else None
    store.set(f"{prefix}/decision", json.dumps({"path": path, "restarted": restarted,
                                                "sha": sha}))
    if path is None or env.world_size == 1:
        return Continued(path, path, restarted)
    started = time.monotonic()
    while (store.add(f"{prefix}/answered", 0) < env.world_size - 1
           and time.monotonic() - started < bound):
        time.sleep(0.05)
    need = store.add(f"{prefix}/need", 0)
    if need:
        size = os.path.getsize(path)
        chunks = max(1, -(-size // CHUNK))
        with open(path, "rb") as f:
            for i in range(chunks):
                store.set(f"{prefix}/chunk/{i}", f.read(CHUNK))
        store.set(f"{prefix}/chunks", str(chunks))
        while (store.add(f"{prefix}/done", 0) < need
               and time.monotonic() - started < bound):
            time.sleep(0.05)
        for i in range(chunks):
            store.delete_key(f"{prefix}/chunk/{i}")
    return Continued(path, path, restarted)


def _receive(env, store, prefix: str) -> Continued:
    decision = json.loads(store.get(f"{prefix}/decision"))
    if "error" in decision:
        refused = ResumeRefused(f"rank 0 refused the resume: {decision['error']}")
        refused.quiet = True
        raise refused
    path, sha = decision["path"], decision["sha"]
    if path is None:
        return Continued(None, None, decision["restarted"])
    own = os.path.isfile(path)
    same = own and _sha256(path) == sha
    store.add(f"{prefix}/need", 0 if same else 1)
    store.add(f"{prefix}/answered", 1)
    if same:
        return Continued(path, path, decision["restarted"])
    local = _fetch(store, prefix, sha)
    if env.local_rank == 0:
        what = ("differs from rank 0's" if own else "is not on this machine")
        print(f"{join.peer_name_of(env)}: {path} {what}; using rank 0's "
              f"(sent over the network, {os.path.getsize(local) / 2**20:.1f} MiB)",
              file=sys.stderr, flush=True)
    return Continued(path, local, decision["restarted"])


def _fetch(store, prefix: str, sha: str) -> str:
    chunks = int(store.get(f"{prefix}/chunks"))
    fd, local = tempfile.mkstemp(prefix="tandem-resume-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            for i in range(chunks):
                f.write(store.get(f"{prefix}/chunk/{i}"))
    finally:
        store.add(f"{prefix}/done", 1)
    if _sha256(local) != sha:
        os.unlink(local)
        raise ResumeRefused("the checkpoint sent by rank 0 arrived damaged (its SHA-256 differs)")
    return local
