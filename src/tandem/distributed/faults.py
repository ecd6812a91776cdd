"""A lost peer of a multi-process job: told apart from a bug (:func:`is_peer_failure`), named
(:func:`lost_peer`), and ended (:func:`ended`): the step it cut short undone, the last completed
step saved where a survivor can, one line, exit status 4. (Not torch's ``monitored_barrier``:
rank 0 collects there, and rank 0 may be the one lost.)
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem import checkpoint
from tandem.errors import TandemError

from .join import announce_failure, key_prefix, short_store, told_failure
from .resume_command import resume_command_here

#: a strategy's ``failure_model``: after a peer is lost, the survivors' collective raises a
#: Python error (gloo), or the backend's watchdog aborts the process (NCCL: SIGABRT, unless
#: TORCH_NCCL_ASYNC_ERROR_HANDLING is 0) and the launcher says the line
RAISES, ABORTS = "raises", "aborts"
#: the ``epoch_progress`` key of a checkpoint saved at a lost peer: the batch its sums were
#: lost at (the resumed epoch's row counts from there, ``train_from_batch``)
LOST_BEFORE = "sums_lost_before_batch"

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout", re.S)
# a transport's own words for a peer that is gone or silent, which nothing else says
_GONE = ("connection reset by peer", "connection closed by peer", "application timeout caused "
         "pair closure", "timed out waiting", "ncclremoteerror", "nccl communicator was aborted",
         "connectfullmesh failed")
# words other errors say too (a file on a network disk): a peer's only with a transport named
_GENERIC = ("broken pipe", "connection refused", "no route to host", "network is unreachable",
            "read error", "write error", "socket timeout")
_SOURCES = ("gloo/", "processgroupgloo", "processgroupnccl", "nccl")
#: seconds a survivor waits for the others to mark themselves in the store
_ROLL_S = 3.0


class PeerLost(TandemError, RuntimeError):
    """Another rank is gone or silent; this rank stopped (exit status 4). ``lost``: its ranks."""

    exit_status = 4

    def __init__(self, *args, lost: tuple[int, ...] = (), **kw):
        super().__init__(*args, **kw)
        self.lost = tuple(lost)


def why(exc: BaseException) -> str:
    """The transport's reason in a few words: ``connection reset by peer``, ``timed out``."""
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
    """True when ``exc`` is a collective's failure because a peer is gone or silent."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, TandemError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    low = str(exc).lower()
    return any(w in low for w in _GONE) or (any(s in low for s in _SOURCES)
                                              and any(w in low for w in _GENERIC))


def lost_peer(exc: BaseException, agreement, where: str) -> PeerLost | None:
    """:class:`PeerLost` for ``exc`` if a peer's failure caused it, else None. ``where``: what
    this rank was doing (``after step 9``)."""
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
    """The ranks the failure names by address, else those silent in the store, else all others."""
    found = {m.group(1) for m in _ADDRESS.finditer(str(exc))}
    named = sorted({r for addr in found for r in agreement.ranks_at(addr)})
    if named:
        return named
    return _silent(agreement) or [r for r in range(agreement.world_size) if r != agreement.rank]


def _silent(agreement) -> list[int]:
    """The ranks that did not mark themselves alive in the job's store within a few seconds;
    node 0's ranks when the store (on node 0) is out of reach."""
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


@contextlib.contextmanager
def watched(agreement, what: str):
    """A peer lost in this block is a :class:`PeerLost` ("while agreeing on ``what``")."""
    try:
        yield
    except RuntimeError as exc:
        lost = lost_peer(exc, agreement, f"while agreeing on {what}")  # None for a TandemError
        if lost is None:
            raise
        raise lost from None


def tell_others(exc: TandemError, line: str, env) -> None:
    """Leave this rank's failure ``line`` for the ranks that wait on it (``env`` None: no job);
    a lost peer leaves nothing (the others learn it from their own transport)."""
    if not isinstance(exc, PeerLost):
        announce_failure(line, env)


@dataclass
class StepStart:
    """The buffers and RNG states as step ``step`` began, to undo a step a lost peer cut short
    (weights change only at the optimizer step)."""

    step: int
    buffers: list
    rng: dict

    @classmethod
    def of(cls, trainer) -> "StepStart | None":
        """The start of ``trainer``'s next step where survivors save (collectives raise)."""
        s = trainer.strategy
        if not (s.multiprocess and s.failure_model == RAISES):
            return None
        return cls(trainer.position.step, [b.detach().clone() for b in trainer.model.buffers()],
                   checkpoint.capture_rng(s.device))


def ended(trainer, exc: RuntimeError) -> PeerLost | None:
    """The :class:`PeerLost` that ends ``trainer``'s run (None: ``exc`` is no lost peer), after
    undoing the step under way and saving the last completed one where rank 0 can."""
    s, pos, start = trainer.strategy, trainer.position, trainer.step_start
    if start is not None and start.step != pos.step:
        start = None  # that step completed: none is under way
    lost = exc
    if not isinstance(exc, PeerLost):  # else the agreement's own collective said it (watched)
        where = f"in step {pos.step + 1}" if start is not None else f"after step {pos.step}"
        lost = lost_peer(exc, s.agreement, where) if s.agreement.several else None
        if lost is None:
            return None
        lost.quiet = s.local_rank != 0
    saved = _save(trainer, start)
    return PeerLost(f"{lost}; {_goes_on(trainer, saved, lost.lost)}", quiet=lost.quiet,
                    lost=lost.lost)


def _save(trainer, start: StepStart | None) -> str | None:
    """Undo the step under way (``start``) and save the last completed step on the main
    process (its path; None where the state needs every rank)."""
    s = trainer.strategy
    if start is not None:
        with torch.no_grad():
            for saved, buffer in zip(start.buffers, trainer.model.buffers()):
                buffer.copy_(saved)
    if not s.is_main or s.state_needs_every_rank:
        return None
    trainer.save(is_best=False, progress={LOST_BEFORE: trainer.position.batch,
                                          "lr_steps": trainer.lr_steps},
                 rng=start.rng if start is not None else None, alone=True)
    trainer.writer.flush()  # on disk before the line says so
    return trainer.run_dir.latest


def _goes_on(trainer, saved: str | None, lost: tuple[int, ...]) -> str:
    """What the run keeps, as this rank knows it, and how it goes on."""
    s, pos, env = trainer.strategy, trainer.position, trainer.strategy.agreement.env
    left = env.restarts_left
    # (only the main process saves: elsewhere the command is this node's)
    goes_on = ("the launcher restarts the job from it" if left else "continue with: "
               f"{resume_command_here(trainer.cfg.run.out, env, this_node=not s.is_main)}")
    if saved is not None:
        more = f" ({left} restart(s) left)" if left else ""
        return f"saved {saved} at epoch {pos.epoch + 1}, step {pos.step}; {goes_on}{more}"
    if not s.state_needs_every_rank and 0 not in lost and not s.is_main:
        return f"rank 0 saves the last completed step ({pos.step}) on node 0; {goes_on}"
    why = ("its model is split across the processes and cannot be saved without the lost "
           "one" if s.state_needs_every_rank else
           "rank 0, which alone writes the run, is lost with it")
    kept = _kept(trainer)
    if kept is None:
        return (f"{why}, and the run has no checkpoint yet: start it again (the same "
                f"command, with --overwrite)" + ("; the launcher restarts it from step 1"
                                                 if left else ""))
    return f"{why}: the last checkpoint stands ({kept}); {goes_on}"


def _kept(trainer) -> str | None:
    """The checkpoint rank 0's disk holds, as this rank knows it: the last save the ranks
    made, and, while rank 0 had not said it was written, the one before (None: none)."""
    made, confirmed = trainer.kept_step(), trainer.job_saved_step
    if made is None:
        return None
    where = f"{trainer.run_dir.latest} from step {made} on node 0"
    if trainer.strategy.is_main or confirmed == made:
        return where
    before = f"step {confirmed}" if confirmed is not None else "none"
    return f"{where}, if rank 0 finished writing it (else {before})"
