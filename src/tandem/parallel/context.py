"""Per-thread replica context and the rendezvous that replica threads share.

``parallel_apply`` installs a :class:`ReplicaContext` in each replica thread; layers such as
:class:`~tandem.parallel.SyncBatchNorm` read it with :func:`current` and meet through the shared
:class:`ReplicaGroup`, which never blocks forever (``abort`` on failure, or ``timeout``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch


class ReplicaAborted(RuntimeError):
    """Raised in a replica that waited at a rendezvous while another replica failed."""


@dataclass
class _Meeting:
    values: list
    arrived: int = 0
    taken: int = 0
    results: Sequence[Any] | None = None


class ReplicaGroup:
    """The rendezvous of one ``parallel_apply`` call's replicas. :meth:`combine` runs ``fn``
    once over all their values: ONE autograd node, so backward needs no barrier (replicas on one
    device share an autograd thread), unless ``separate_backward`` (a backward thread each):
    then layers may meet in backward too."""

    def __init__(self, devices: Sequence[torch.device], timeout: float = 300.0,
                 separate_backward: bool = False):
        self.devices, self.num_replicas = list(devices), len(devices)
        self.separate_backward, self.timeout = separate_backward, timeout
        self._cond = threading.Condition()
        self._meetings: dict[Hashable, _Meeting] = {}
        self._error: BaseException | None = None

    def abort(self, error: BaseException) -> None:
        """Wake every replica waiting at a rendezvous; each raises :class:`ReplicaAborted`."""
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def _raise_if_aborted(self, index: int) -> None:
        if self._error is not None:
            raise ReplicaAborted(f"replica {index} on {self.devices[index]} stopped waiting: "
                                 f"another replica failed with {type(self._error).__name__}: "
                                 f"{self._error}")

    def combine(self, key: Hashable, index: int, value: Any, fn: Callable[[list], Sequence]) -> Any:
        """Deposit ``value`` as replica ``index`` under ``key``; the last to arrive runs
        ``fn(values in replica order)`` once; return its entry ``[index]``."""
        with self._cond:
            self._raise_if_aborted(index)
            meeting = self._meetings.setdefault(key, _Meeting([None] * self.num_replicas))
            meeting.values[index] = value
            meeting.arrived += 1
            if meeting.arrived == self.num_replicas:
                try:
                    meeting.results = fn(meeting.values)
                except BaseException as exc:
                    self._error = self._error or exc
                    raise
                finally:
                    self._cond.notify_all()
            else:
                done = self._cond.wait_for(
                    lambda: meeting.results is not None or self._error is not None, self.timeout)
                self._raise_if_aborted(index)
                if not done:
                    missing = [i for i, v in enumerate(meeting.values) if v is None]
                    raise TimeoutError(f"replica {index} on {self.devices[index]} waited "
                                       f"{self.timeout:.0f}s at rendezvous {key!r} for "
                                       f"replicas {missing}")
            result = meeting.results[index]
            meeting.taken += 1
            if meeting.taken == self.num_replicas:
                del self._meetings[key]
            return result


@dataclass
class ReplicaContext:
    """What a replica thread knows about itself while ``parallel_apply`` runs it."""

    index: int
    device: torch.device
    group: ReplicaGroup
    _calls: dict = field(default_factory=dict, repr=False)

    @property
    def num_replicas(self) -> int:
        return self.group.num_replicas

    def next_key(self, tag: Hashable) -> tuple:
        """A key equal across replicas for the n-th call of the layer named ``tag``: replicas
        run the same code in the same order, so counting calls pairs them up."""
        n = self._calls.get(tag, 0)
        self._calls[tag] = n + 1
        return (tag, n)


_local = threading.local()


def current() -> ReplicaContext | None:
    """The context of the replica running in this thread, or ``None`` outside ``parallel_apply``."""
    return getattr(_local, "context", None)


@contextlib.contextmanager
def use(context: ReplicaContext | None):
    """Install ``context`` for this thread for the ``with`` block."""
    previous = current()
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
