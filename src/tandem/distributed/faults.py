"""A collective that failed because a peer went away, told apart from a bug, in one line.

gloo and NCCL report a dead or unreachable peer as a ``RuntimeError`` (torch's ``DistError``
family) whose text carries the transport's words: ``Connection reset by peer``, ``Connection
closed by peer``, ``Timed out waiting 20000ms for recv operation``, ``[192.0.2.2]:41234``.
:func:`lost_peer` reads them into :class:`PeerLost`, naming the lost ranks from the roll call
(:mod:`.join`); anything else is not a peer's failure and keeps its traceback.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from tandem.errors import TandemError

from .join import peer_name, peers
from .watchdog import silent

__all__ = ["PeerLost", "lost_peer", "why"]

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout", re.S)
# the transport's words for a peer that is gone or cannot be reached
_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe",
         "connection refused", "no route to host", "network is unreachable", "read error",
         "write error", "eof", "ncclremoteerror", "nccl communicator was aborted",
         "connectfullmesh failed", "socket timeout", "timed out waiting",
         "application timeout caused pair closure")


class PeerLost(TandemError, RuntimeError):
    """Another rank of the job is gone or silent; this rank stopped (exit status 4)."""

    exit_status = 4


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


def _suspects(exc: BaseException, me: int) -> list[int]:
    """The ranks the failure names, by the address in its text, else those the watchdog saw
    fall silent (all others when neither tells)."""
    table = peers()
    others = [r for r in table if r != me]
    found = {m.group(1) for m in _ADDRESS.finditer(str(exc))}
    named = [r for r in others if table[r][1] in found]
    return named or [r for r in silent() if r != me] or others


def is_peer_failure(exc: BaseException) -> bool:
    if not isinstance(exc, RuntimeError) or isinstance(exc, TandemError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    low = str(exc).lower()
    return any(words in low for words in _GONE)


def lost_peer(exc: BaseException, rank: int, where: str) -> PeerLost | None:
    """:class:`PeerLost` for ``exc`` if a peer's failure caused it, else None. ``where``
    says what this rank was doing (``after step 9``)."""
    if not is_peer_failure(exc):
        return None
    names = ", ".join(peer_name(r) for r in _suspects(exc, rank)) or "another rank"
    me = peer_name(rank)
    return PeerLost(f"{me}: lost {names} {where}: {why(exc)}")
