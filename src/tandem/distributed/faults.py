"""A collective that failed because a peer went away, told apart from a bug, in one line.

gloo reports a dead or unreachable peer as a plain ``RuntimeError`` in its transport's words
(``Connection closed by peer [192.0.2.2]:41234``, ``Timed out waiting 20000ms for recv
operation``, ``Application timeout caused pair closure``); NCCL and the store raise torch's
``DistError`` family. :func:`is_peer_failure` takes only those (words that other errors say
too, ``read error``, only with a transport's source named): a data file's ``unexpected EOF``
is no lost peer. :func:`lost_peer` reads them into :class:`PeerLost`,
naming the lost ranks by the address in the text (the job's table of where each rank runs,
:class:`~.agree.Agreement`), else by which ranks no longer answer in the job's store (each
survivor marks itself once: one request a rank, read once), or saying the line a rank that
failed left there before it ended; anything else keeps its traceback.

Why not torch's ``monitored_barrier``, which names the ranks that did not come: every rank
must call it at the same point, rank 0 collecting, on a group that works; after a failure the
group is broken and rank 0 may be the one lost. Nor a heartbeat thread (tandem had one): it
cost every rank a store request for every other rank every 5 s (O(W**2) a beat on node 0's
store); the marks here cost O(W) requests, once, when a peer is lost. Under NCCL the flight
recorder keeps each rank's last collectives, dumped at a timeout (:mod:`.torchrun`).
"""

from __future__ import annotations

import re
import time

import torch.distributed as dist

from tandem.errors import TandemError

from .join import key_prefix, short_store, told_failure

__all__ = ["PeerLost", "is_peer_failure", "lost_peer", "why", "RAISES", "ABORTS"]

#: the failure models of a backend: after a peer is lost, the survivors' collective raises a
#: Python error (gloo), or the backend's watchdog aborts the process (NCCL: SIGABRT, unless
#: TORCH_NCCL_ASYNC_ERROR_HANDLING is 0)
RAISES, ABORTS = "raises", "aborts"

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout", re.S)
# a transport's own words for a peer that is gone or silent, which nothing else says
_GONE = ("connection reset by peer", "connection closed by peer", "application timeout caused "
         "pair closure", "timed out waiting", "ncclremoteerror", "nccl communicator was aborted",
         "connectfullmesh failed")
# words that other errors say too (a file on a network disk, a URL): a peer's only when the
# text names a transport's source as well
_GENERIC = ("broken pipe", "connection refused", "no route to host", "network is unreachable",
            "read error", "write error", "socket timeout")
_SOURCES = ("gloo/", "processgroupgloo", "processgroupnccl", "nccl")
#: seconds a survivor waits for the others to mark themselves in the store
_ROLL_S = 3.0


class PeerLost(TandemError, RuntimeError):
    """Another rank of the job is gone or silent; this rank stopped (exit status 4).
    ``lost``: the ranks taken for lost."""

    exit_status = 4

    def __init__(self, *args, lost: tuple[int, ...] = (), **kw):
        super().__init__(*args, **kw)
        self.lost = tuple(lost)


def why(exc: BaseException) -> str:
    """The transport's reason in a few words: ``connection reset by peer``, ``no answer for
    20 s``, ``connection refused by 127.0.0.1:20888``."""
    text = str(exc)
    low = text.lower()
    waited = re.search(r"waiting (\d+)ms", text)
    if waited:
        return f"no answer for {int(waited.group(1)) / 1000:.0f} s (--dist-timeout)"
    if "application timeout" in low:
        return "no answer within --dist-timeout"
    for words in ("connection reset by peer", "connection closed by peer", "broken pipe",
                  "connection refused", "no route to host", "network is unreachable"):
        if words in low:
            where = _ADDRESS.search(text)
            return words + (f" ({where.group(1)}:{where.group(2)})" if where else "")
    if _TIMEOUT.search(text):
        return "timed out"
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective's failure because a peer is gone or silent: torch's
    ``DistError`` family, or a ``RuntimeError`` raised by a transport (its source named in
    the text) in a transport's words."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, TandemError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    low = str(exc).lower()
    return any(w in low for w in _GONE) or (any(s in low for s in _SOURCES)
                                              and any(w in low for w in _GENERIC))


def lost_peer(exc: BaseException, agreement, where: str) -> PeerLost | None:
    """:class:`PeerLost` for ``exc`` if a peer's failure caused it, else None. ``where``
    says what this rank was doing (``after step 9``); ``agreement`` (the job's
    :class:`~.agree.Agreement`) names the ranks."""
    if not is_peer_failure(exc):
        return None
    me = agreement.peer_name(agreement.rank)
    lost = _suspects(exc, agreement)  # (waits a few seconds where no address tells)
    told = told_failure(agreement.env)
    if told is not None:  # it said why before it left: that line, not the transport's
        return PeerLost(f"{me}: the job cannot go on: {told}", lost=tuple(lost),
                        quiet=agreement.rank != 0)
    names = ", ".join(agreement.peer_name(r) for r in lost) or "another rank"
    where = f" {where}" if where else ""
    return PeerLost(f"{me}: lost {names}{where}: {why(exc)}", lost=tuple(lost))


def _suspects(exc: BaseException, agreement) -> list[int]:
    """The ranks the failure names by their address, else those that no longer answer in the
    job's store (all others when neither tells)."""
    found = {m.group(1) for m in _ADDRESS.finditer(str(exc))}
    named = sorted({r for addr in found for r in agreement.ranks_at(addr)})
    if named:
        return named
    others = [r for r in range(agreement.world_size) if r != agreement.rank]
    return _silent(agreement) or others


def _silent(agreement) -> list[int]:
    """The ranks that did not mark themselves alive in the job's store within a few seconds
    (each survivor marks itself once); every other rank when the store itself is out of reach
    (it lives on node 0: rank 0 is then lost with it)."""
    try:
        store = short_store(agreement.env, _ROLL_S)
        prefix = f"{key_prefix(agreement.env)}/alive"
        store.set(f"{prefix}/{agreement.rank}", "1")
        others = [r for r in range(agreement.world_size) if r != agreement.rank]
        deadline = time.monotonic() + _ROLL_S
        while True:
            silent = [r for r in others if not store.check([f"{prefix}/{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)
    except Exception:  # the store does not answer: node 0 (and its ranks) are out of reach
        node0 = agreement.peers.get(0, ("0", ""))[0]
        return [r for r, (node, _) in sorted(agreement.peers.items())
                if node == node0 and r != agreement.rank] or [0]
