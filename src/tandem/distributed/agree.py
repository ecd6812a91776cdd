"""The decisions every rank of a job must share, each made once for all of them.

NCCL matches collectives by order: a rank that decides alone (to skip a step, stop, save) hangs
the job. So each decision is one method of :class:`Agreement`, one collective on CPU tensors;
in one process each returns the caller's own value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tandem.errors import TandemError, UsageError, param

from . import faults


T = TypeVar("T")


class SettingsDiffer(UsageError):
    """The ranks of a job were started with different settings (a typo on one machine)."""


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed after a step (:meth:`Agreement.vote`): stop (a signal on any
    rank), save now (rank 0's clock), the step of rank 0's last checkpoint on disk."""

    stop: bool = False
    save: bool = False
    saved_step: int | None = None


class Agreement:
    """The decisions of one job: rank ``rank`` of ``world_size`` on ``group`` (None: the
    default group); ``node`` and ``addr`` (towards the master) name this rank in lines."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, node: str = "0",
                 addr: str = "", env=None):
        self.rank, self.world_size, self.group, self.env = rank, world_size, group, env
        # rank -> (node, address), every rank's after settings(); this one's before
        self.peers: dict[int, tuple[str, str]] = {rank: (node, addr)}
        self._pending = None  # the last step's vote, in flight (several processes)

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def peer_name(self, rank: int) -> str:
        """``rank 1 (node 1, 192.0.2.2)``, as far as the start of the job told."""
        if rank not in self.peers:
            return f"rank {rank}"
        node, addr = self.peers[rank]
        return f"rank {rank} (node {node}{', ' + addr if addr else ''})"

    def ranks_at(self, address: str) -> list[int]:
        """The ranks (other than this one) that run at ``address``."""
        return [r for r, (_, addr) in self.peers.items() if addr == address and r != self.rank]

    def settings(self, mine: dict[str, Any], named: Callable[[str], str] | None = None,
                 what: str = "every node must run the same command (only --node-rank differs)"
                 ) -> None:
        """Check every rank's settings (``{"optim.lr": 0.01, ...}``) against rank 0's and learn
        where every rank runs (:attr:`peers`); a difference is a :class:`SettingsDiffer` on every
        rank, naming the setting (``named(key)``), the ranks and what must hold (``what``)."""
        if not self.several:
            return
        everyone = self.each((*self.peers[self.rank], mine))
        self.peers = {r: (n, a) for r, (n, a, _) in enumerate(everyone)}
        reference = everyone[0][2]
        named = named or (lambda key: param(key.rsplit(".", 1)[-1]))
        for rank, (_, _, theirs) in enumerate(everyone):
            differs = sorted(k for k in set(reference) | set(theirs)
                             if reference.get(k) != theirs.get(k))
            if differs:  # the first, both values, how many more
                key = differs[0]
                more = f" (and {len(differs) - 1} more)" if len(differs) > 1 else ""
                raise SettingsDiffer(
                    f"{self.peer_name(rank)} has {named(key)} {_shown(theirs.get(key))} where "
                    f"{self.peer_name(0)} has {_shown(reference.get(key))}{more}: {what}",
                    quiet=self.rank != 0 and self.rank != rank)

    def rank0(self, decide: Callable[[], T]) -> T:
        """``decide()`` run on rank 0 alone (what only its machine can tell) and its result on
        every rank; a :class:`~tandem.errors.TandemError` it raises is raised on every rank."""
        if not self.several:
            return decide()
        outcome: tuple = (None, None, None)
        if self.rank == 0:
            try:
                outcome = (decide(), None, None)
            except TandemError as exc:
                outcome = (None, type(exc), exc.marked or str(exc))
        value, kind, message = self.from_rank0(outcome)
        if kind is not None:
            raise kind(message, quiet=self.rank != 0)
        return value

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what rank 0 decided; the others pass anything)."""
        if not self.several:
            return value
        box = [value]
        with faults.watched(self, "what rank 0 decided"):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def each(self, value: Any) -> list:
        """Every rank's ``value``, in rank order (what each rank found: a file it lacks)."""
        if not self.several:
            return [value]
        everyone: list = [None] * self.world_size
        with faults.watched(self, "what each rank found"):
            dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def all_of(self, flags: Sequence[bool]) -> list[bool]:
        """Entry ``i`` is true on every rank when ``flags[i]`` is true on all of them."""
        return self._reduced(flags, dist.ReduceOp.MIN)

    def any_of(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        return self._reduced([flag], dist.ReduceOp.MAX)[0]

    def _reduced(self, flags: Sequence[bool], op) -> list[bool]:
        if not self.several:
            return [bool(f) for f in flags]
        votes = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
        with faults.watched(self, "a vote"):
            dist.all_reduce(votes, op=op, group=self.group)
        return [bool(v) for v in votes.tolist()]

    def vote(self, stop: bool, save: bool = False, saved_step: int | None = None) -> Verdict:
        """Cast this step's votes and return the previous step's verdict (every rank, once a
        step): one all-reduce read a step later, so a step never waits on it."""
        if not self.several:
            return Verdict(stop, save, saved_step)
        saved = -1.0 if saved_step is None else float(saved_step)
        cast = torch.tensor([float(stop), float(save), saved], dtype=torch.float64)
        with faults.watched(self, "the step's vote"):
            work = dist.all_reduce(cast, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            previous, self._pending = self._pending, (work, cast)
            return _read(previous)

    def settle(self) -> Verdict:
        """The verdict of the vote still in flight (every rank calls it at the same point)."""
        previous, self._pending = self._pending, None
        with faults.watched(self, "the step's vote"):
            return _read(previous)

    def grad_scaler(self, device_type: str, enabled: bool) -> torch.amp.GradScaler:
        """The loss scaler: with several processes torch's ``ShardedGradScaler``, whose
        ``unscale_`` all-reduces ``found_inf`` (an inf on any rank skips the step on all)."""
        if not (self.several and enabled):
            return torch.amp.GradScaler(device_type, enabled=enabled)
        group = self.group if self.group is not None else dist.group.WORLD
        # imported here: torch.distributed.fsdp costs every process 0.8 s to import
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, process_group=group)


def _read(pending) -> Verdict:
    if pending is None:
        return Verdict()
    work, cast = pending
    work.wait()
    stop, save, saved = cast.tolist()
    return Verdict(stop > 0, save > 0, None if saved < 0 else int(saved))


def _shown(value: Any) -> str:
    return "(not set)" if value is None else str(value)


#: the agreement of a process that is the whole job
LOCAL = Agreement()
