"""Replica threads made to run in a chosen order, for the determinism tests: replica ``i``
starts its work (a forward, or its threaded backward) ``position(i) x STAGGER`` seconds late,
and deposits its value at every rendezvous (``ReplicaGroup.combine``: SyncBatchNorm's moments
and gradients) only after the replicas before it in the order have deposited theirs.

Two runs in the two orders meet in opposite orders at every rendezvous, on every step; busy
CPU loops only make that likely. ``arrival_order_reductions`` is the negative control: a
rendezvous that reduces in arrival order, which the two orders must tell apart.
"""

from __future__ import annotations

import contextlib
import importlib
import time

from tandem.parallel import context

# the module (the package exports its function under the same name)
parallel_apply = importlib.import_module("tandem.parallel.parallel_apply")

STAGGER = 0.005  # seconds between one replica's start and the next one's, in the order
TIMEOUT = 60.0  # seconds a replica waits for its turn at a rendezvous before it fails


def position(index: int, n: int, reverse: bool) -> int:
    return n - 1 - index if reverse else index


@contextlib.contextmanager
def replicas_in_order(monkeypatch, reverse: bool):
    """Within the block, replicas start and meet in index order (``reverse``: the opposite)."""
    real_call, real_combine = parallel_apply._call, context.ReplicaGroup.combine

    def call(*work):
        me = context.current()
        if me is not None and me.num_replicas > 1:
            time.sleep(STAGGER * position(me.index, me.num_replicas, reverse))
        return real_call(*work)

    def combine(group, key, index, value, fn):
        turn = position(index, group.num_replicas, reverse)
        deadline = time.monotonic() + TIMEOUT
        with group._cond:
            while True:
                meeting = group._meetings.get(key)
                if (meeting.arrived if meeting else 0) >= turn or group._error is not None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {index}: no turn at rendezvous {key!r}")
                group._cond.wait(0.001)  # arrivals notify no one: look again
        return real_combine(group, key, index, value, fn)

    with monkeypatch.context() as m:
        m.setattr(parallel_apply, "_call", call)
        m.setattr(context.ReplicaGroup, "combine", combine)
        yield


@contextlib.contextmanager
def arrival_order_reductions(monkeypatch):
    """Within the block, every rendezvous hands its function the values in the order the
    replicas arrived (and each replica its own result back): a reduction there, e.g.
    SyncBatchNorm's sum of moments, then adds in arrival order. Enter it before
    :func:`replicas_in_order`, whose turns then decide the arrivals."""
    real = context.ReplicaGroup.combine
    arrivals: dict = {}

    def combine(group, key, index, value, fn):
        with group._cond:
            arrivals.setdefault((id(group), key), []).append(index)
            order = arrivals[(id(group), key)]

        def in_arrival_order(values):
            arrivals.pop((id(group), key), None)
            results = fn([values[i] for i in order])
            mine = {i: r for i, r in zip(order, results)}
            return [mine[i] for i in range(len(values))]

        return real(group, key, index, value, in_arrival_order)

    with monkeypatch.context() as m:
        m.setattr(context.ReplicaGroup, "combine", combine)
        yield
