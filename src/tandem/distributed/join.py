"""Meeting the other ranks: the job's store, the arrival of every rank, and a failure told.

:func:`arrive` waits out the skew of the workers' start with the join bound (``--join-timeout``),
so that the group can carry the collectives' short timeout (``--dist-timeout``): torch's init
barrier runs under the group's timeout. Keys live under the restart's prefix where the store
outlives a restart, so that a dead attempt's keys are never read.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tandem.errors import TandemError, param

from .env import DistEnv

#: seconds between two "still waiting" lines
SAY_EVERY = 30.0
#: seconds between two looks at the store while ranks are missing
_LOOK_EVERY = 1.0

_store = None  # (job, store): the job's store (a client of the launcher's, or rank 0's own)
_joins = 0  # how often this process has arrived (every rank of a job arrives as often)


class JoinFailed(TandemError, RuntimeError):
    """The ranks of a job did not all meet; the message names who is missing, and where."""

    exit_status = 4


@contextlib.contextmanager
def every(seconds: float, say, enabled: bool = True):
    """Print ``say()`` (if not empty) every ``seconds`` while the block runs, from a thread."""
    done = threading.Event()

    def tick():
        while not done.wait(seconds):
            line = say()
            if line:
                print(line, file=sys.stderr, flush=True)

    if enabled:
        threading.Thread(target=tick, name="tandem-waiting", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def job_store(env: DistEnv, bound: float):
    """The job's store (torchrun's ``env://`` one), made once per process, within ``bound`` s."""
    global _store
    key = (env.master_addr, env.master_port, env.rank, env.world_size)
    if _store is None or _store[0] != key:  # a new job in this process (tests, ddp_runs)
        started = time.monotonic()
        where = f"{env.master_addr}:{env.master_port}"
        with every(SAY_EVERY, lambda: f"rank {env.rank}: waiting for the job's store at {where} "
                   f"({time.monotonic() - started:.0f} s)", enabled=env.speaks_for_node):
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


def joins() -> int:
    """How often this process has arrived (:func:`arrive`)."""
    return _joins


def key_prefix(env: DistEnv) -> str:
    """Where this restart's keys live in the job's store: under the restart's count where the
    store is torchrun's agent's, which outlives a restart. The workers' own (the elastic form;
    rank 0 serves it) is new at each round, where the nodes' counts may differ: an agent that
    restarts its workers for a joining node counts no restart, one whose workers failed does."""
    return f"tandem/{env.restart}" if env.shared_store else "tandem/round"


def short_store(env: DistEnv, seconds: float = 3.0):
    """A client of the job's store that waits ``seconds`` at most (the store itself may be gone)."""
    # a plain connection first: a store client that cannot connect logs torch's C++ error
    # with its stack on stderr, a page of noise under the one line (OSError when so)
    socket.create_connection((env.master_addr, env.master_port), timeout=seconds).close()
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                         timeout=timedelta(seconds=seconds), wait_for_workers=False)


def announce_failure(line: str, env: DistEnv | None) -> None:
    """Leave this rank's one-line failure in the job's store, so that the ranks waiting for it
    stop too (:func:`told_failure`); the first line stays. Best effort; ``env`` None: nothing."""
    with contextlib.suppress(Exception):  # no store to tell: the others find out by their bounds
        if env is not None:
            short_store(env).compare_set(f"{key_prefix(env)}/failed", "",
                                         f"{peer_name_of(env)}: {line}")


def told_failure(env: DistEnv, store=None) -> str | None:
    """The line a failed rank left (:func:`announce_failure`); ``None``: none, or no store."""
    try:
        return _failure_in(env, store or short_store(env))
    except Exception:
        return None


def _failure_in(env: DistEnv, store) -> str | None:
    key = f"{key_prefix(env)}/failed"
    return store.get(key).decode() if store.check([key]) else None


def _store_gone(env: DistEnv) -> bool:
    """True when nothing listens at the job's store any more (its node's launcher ended)."""
    try:
        socket.create_connection((env.master_addr, env.master_port), timeout=3.0).close()
        return False
    except OSError:
        return True


def peer_name_of(env: DistEnv) -> str:
    return f"rank {env.rank} (node {env.node})"


def arrive(env: DistEnv, store, bound: float) -> dict[int, tuple[str, str]]:
    """Count this rank in and wait until every rank has come (saying how many each
    :data:`SAY_EVERY` s); past ``bound`` seconds or on a rank's told failure, :class:`JoinFailed`
    naming who is missing. Returns ``{rank: (node, address)}``."""
    global _joins
    _joins += 1
    at = f"{key_prefix(env)}/join{_joins}"
    store.set(f"{at}/who/{env.rank}", f"{env.node} {env.addr}")
    all_here = f"{at}/all-here"
    if store.add(f"{at}/here", 1) == env.world_size:
        store.set(all_here, "1")
    started = said = time.monotonic()
    where = f"{env.master_addr}:{env.master_port}"
    failures = short_store(env, 10.0)  # where a rank that failed before coming leaves its line
    while True:
        try:
            store.wait([all_here], timedelta(seconds=_LOOK_EVERY))
            break
        except RuntimeError:  # DistStoreError: not yet
            pass
        told = told_failure(env, failures)
        if told is not None:
            raise JoinFailed(f"{peer_name_of(env)}: the job cannot start: {told}",
                             quiet=not env.speaks_for_node)
        now = time.monotonic()
        here = store.add(f"{at}/here", 0)
        if now - started > bound:
            missing = [r for r in range(env.world_size) if not store.check([f"{at}/who/{r}"])]
            raise JoinFailed(
                f"{peer_name_of(env)}: the other ranks did not come within {bound:.0f} s: "
                f"{here} of {env.world_size} here at {where}, missing "
                f"rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} (is "
                f"every node started, with the same {param('nnodes')} and "
                f"{param('master_addr')}/{param('master_port')}?)")
        if env.speaks_for_node and now - said >= SAY_EVERY:
            said = now
            print(f"{peer_name_of(env)}: waiting for the other ranks at {where}: {here} of "
                  f"{env.world_size} here ({now - started:.0f} s)", file=sys.stderr, flush=True)
    who = store.multi_get([f"{at}/who/{r}" for r in range(env.world_size)])
    return {r: tuple(value.decode().partition(" ")[::2]) for r, value in enumerate(who)}


@contextlib.contextmanager
def abandoned_if_another_fails(env: DistEnv):
    """While this rank makes the group's connections (inside torch, which cannot be
    interrupted): if another rank says it failed (:func:`announce_failure`), or the job's store
    is gone (the failed rank's node ended before this rank read its line), end this process in
    one line (exit status 4) instead of waiting out the connect's timeout."""
    done = threading.Event()
    where = f"{env.master_addr}:{env.master_port}"

    def end(why: str):
        if not done.is_set():
            print(f"tandem: error: {peer_name_of(env)}: the job cannot start: {why}",
                  file=sys.stderr, flush=True)
            os._exit(JoinFailed.exit_status)

    def watch():
        gone = f"the job's store at {where} is gone (its node ended) while the ranks connected"
        try:
            store = short_store(env, 10.0)
        except Exception:  # it answered this rank's arrival a moment ago
            if _store_gone(env):
                end(gone)
            return
        while not done.wait(0.5):
            if _store_gone(env):  # a plain connection first, as in short_store
                end(gone)
            try:
                told = _failure_in(env, store)
            except Exception:  # a busy store (one that is gone ends at the next look)
                continue
            if told:
                end(told)

    threading.Thread(target=watch, name="tandem-join-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
