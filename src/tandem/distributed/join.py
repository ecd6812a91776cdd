"""Meeting the other ranks: the job's store, a roll call, and who is where.

Each join of a process group (and each resume a rank 0 shares, :mod:`.shared_resume`) works
under a key prefix of its own, made of torchrun's restart count and how often this process has
joined: keys a dead attempt left in the launcher's store (its gloo addresses above all) are
never read by the next one. The roll call counts the ranks that arrived and, while some are
missing, says so every :data:`SAY_EVERY` seconds (``waiting for the other ranks at
192.0.2.1:29555: 1 of 2 here``); past its bound it ends in one line naming the missing ranks.
Each rank leaves its node and address, so that a failure can name the rank it lost
(:func:`peer_name`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tandem.errors import TandemError, param

from .env import (DistEnv, address_of, node_of, read_env, restart_count,
                  several_processes)

__all__ = ["JoinFailed", "job_store", "attempt_prefix", "roll_call", "peer_name", "peers",
           "every", "abandoned_if_another_fails", "announce_failure", "SAY_EVERY"]

#: seconds between two "still waiting" lines
SAY_EVERY = 30.0

_store = None  # (job, store): the job's store (a client of the launcher's, or rank 0's own)
_joins = {"group": 0, "resume": 0}  # how often this process made each kind of prefix
_peers: dict[int, tuple[str, str]] = {}  # rank -> (node, address), after a roll call


class JoinFailed(TandemError, RuntimeError):
    """The ranks of a job did not all meet; the message names who is missing, and where."""

    exit_status = 4


def talks(env: DistEnv) -> bool:
    """True in the one worker per node that prints waiting lines (local rank 0)."""
    return env.local_rank == 0


@contextlib.contextmanager
def every(seconds: float, say, enabled: bool = True):
    """Print ``say()`` (if not empty) every ``seconds`` while the block runs, from a thread."""
    done = threading.Event()

    def tick():
        while not done.wait(seconds):
            line = say()
            if line:
                print(line, file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="tandem-waiting", daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        done.set()


def job_store(env: DistEnv, bound: float):
    """The job's key-value store (torchrun's ``env://`` one: a client of the launcher's
    store, or rank 0's own), made once per process; waits up to ``bound`` seconds for it."""
    global _store
    key = (env.master_addr, env.master_port, env.rank, env.world_size)
    if _store is None or _store[0] != key:  # a new job in this process (tests, ddp_runs)
        started = time.monotonic()
        where = f"{env.master_addr}:{env.master_port}"
        with every(SAY_EVERY, lambda: f"rank {env.rank}: waiting for the job's store at {where} "
                   f"({time.monotonic() - started:.0f} s)", enabled=talks(env)):
            try:
                store, _, _ = next(dist.rendezvous(
                    "env://", rank=env.rank, world_size=env.world_size,
                    timeout=timedelta(seconds=bound)))
                _store = (key, store)
            except (RuntimeError, ValueError) as exc:
                raise JoinFailed(f"{peer_name_of(env)}: cannot reach the job's "
                                 f"store at {where} after {time.monotonic() - started:.1f} s: "
                                 f"{_reason(exc)}") from None
    return _store[1]


def _failure_key() -> str:
    """Where a rank of this attempt of the job leaves the line it failed with."""
    return f"tandem/{restart_count()}/failed"


def announce_failure(line: str) -> None:
    """Leave this rank's one-line failure in the job's store, so that the ranks waiting for it
    (a roll call, a connect) stop at once with it instead of waiting out their bound. Best
    effort, and only in a torchrun job of several processes."""
    try:
        if not several_processes():
            return
        env = read_env()
        job_store(env, 10.0).set(_failure_key(), f"{peer_name_of(env)}: {line}")
    except Exception:  # no store to tell: the others find out by their own bounds
        pass


def _told_failure(store) -> str | None:
    key = _failure_key()
    return store.get(key).decode() if store.check([key]) else None


def peer_name_of(env: DistEnv) -> str:
    return f"rank {env.rank} (node {node_of()})"


def attempt_prefix(kind: str) -> str:
    """A fresh key prefix for this process's next ``kind`` ("group" or "resume") under this
    restart of the job; every rank asks in the same order, so the prefixes agree."""
    _joins[kind] += 1
    return f"tandem/{restart_count()}/{kind}{_joins[kind]}"


def roll_call(env: DistEnv, store, prefix: str, bound: float) -> None:
    """Count this rank in under ``prefix`` and wait until all ``world_size`` have come; say who
    is here every :data:`SAY_EVERY` s; past ``bound`` seconds raise :class:`JoinFailed`."""
    store.set(f"{prefix}/who/{env.rank}", f"{node_of()} {address_of()}")
    here = store.add(f"{prefix}/here", 1)
    started = time.monotonic()
    where = f"{env.master_addr}:{env.master_port}"
    count = {"here": here}

    def line() -> str:
        return (f"{peer_name_of(env)}: waiting for the other ranks at {where}: "
                f"{count['here']} of {env.world_size} here "
                f"({time.monotonic() - started:.0f} s)")

    with every(SAY_EVERY, line, enabled=talks(env)):
        while count["here"] < env.world_size:
            told = _told_failure(store)
            if told is not None:
                raise JoinFailed(f"{peer_name_of(env)}: the job cannot start: {told}",
                                 quiet=not talks(env))
            if time.monotonic() - started > bound:
                missing = [r for r in range(env.world_size)
                           if not store.check([f"{prefix}/who/{r}"])]
                raise JoinFailed(
                    f"{peer_name_of(env)}: the other ranks did not come within "
                    f"{bound:.0f} s: {count['here']} of {env.world_size} here at {where}, "
                    f"missing rank{'s' if len(missing) != 1 else ''} "
                    f"{', '.join(map(str, missing))} (is every node started, with the same "
                    f"{param('nnodes')} and {param('master_addr')}/{param('master_port')}?)")
            time.sleep(0.05)
            count["here"] = store.add(f"{prefix}/here", 0)
    names = store.multi_get([f"{prefix}/who/{r}" for r in range(env.world_size)])
    _peers.clear()
    for rank, value in enumerate(names):
        node, _, addr = value.decode().partition(" ")
        _peers[rank] = (node, addr)


@contextlib.contextmanager
def abandoned_if_another_fails(env: DistEnv, prefix: str):
    """While this rank connects to the others (inside torch, which cannot be interrupted): if
    another rank says it failed (:func:`announce_failure`), or the job's store goes away, end this
    process in one line (exit status 4) instead of waiting out the connect timeout."""
    done = threading.Event()

    def watch():
        where = f"{env.master_addr}:{env.master_port}"
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                  timeout=timedelta(seconds=10), wait_for_workers=False)
        except Exception:
            return  # the main thread meets the same store and says why
        while not done.wait(0.5):
            try:
                told = _told_failure(store)
            except Exception:
                told = f"the job's store at {where} went away (node 0 ended?)"
            if told and not done.is_set():
                print(f"tandem: error: {peer_name_of(env)}: the job cannot "
                      f"start: {told}", file=sys.stderr, flush=True)
                os._exit(JoinFailed.exit_status)

    thread = threading.Thread(target=watch, name="tandem-join-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def peers() -> dict[int, tuple[str, str]]:
    """rank -> (node, address) of the last roll call (empty before one)."""
    return dict(_peers)


def peer_name(rank: int) -> str:
    """``rank 1 (node 1, 192.0.2.2)``, as far as the roll call told."""
    node, addr = _peers.get(rank, ("?", ""))
    return f"rank {rank} (node {node}{', ' + addr if addr else ''})"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
