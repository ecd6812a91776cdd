"""Where a forward stands in the run, for the layers that draw keyed randomness.

The loop opens a :func:`step_stream` per forward at this process's first row; code that cuts
the batch moves it (:func:`shifted`: a replica's rows, :func:`blocks` and :func:`at`: a split
layer's columns, :func:`use`: into a replica thread). A layer's key counts its calls in this
forward, so a layer that runs twice draws two masks. Outside a stream :func:`current` is None.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, replace

from .keys import mix_seed, name_key


@dataclass(frozen=True)
class Place:
    """The step's key, this code's first row of the global batch and first feature column,
    and this thread's count of each layer's calls in this forward."""

    key: int
    first_row: int = 0
    first_col: int = 0
    calls: dict = field(default_factory=dict, compare=False)

    def draw(self, name: str) -> int:
        """The key of this call of the layer named ``name`` (the next call gets another)."""
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        return mix_seed(self.key, name_key(name), n)


_local = threading.local()


def current() -> Place | None:
    """This thread's place, or ``None`` outside a stream."""
    return getattr(_local, "place", None)


@contextlib.contextmanager
def _installed(place: Place | None):
    previous = current()
    _local.place = place
    try:
        yield place
    finally:
        _local.place = previous


def step_stream(seed: int, step: int, micro: int, first_row: int = 0):
    """The stream of micro-batch ``micro`` of optimizer step ``step``, rows from ``first_row``."""
    return _installed(Place(mix_seed(seed, step, micro), first_row))


def use(place: Place | None):
    """Enter the caller's ``place`` in a replica thread, with call counts of its own."""
    return _installed(None if place is None else replace(place, calls=dict(place.calls)))


def shifted(rows: int):
    """This thread's place moved ``rows`` rows on (a replica's chunk)."""
    place = current()
    if place is None or not rows:
        return contextlib.nullcontext()
    return _installed(replace(place, first_row=place.first_row + rows, calls=place.calls))


def at(first_row: int, first_col: int):
    """This thread's place at ``first_row`` and ``first_col`` (a rank's block of a split layer)."""
    place = current()
    if place is None:
        return contextlib.nullcontext()
    return _installed(replace(place, first_row=first_row, first_col=first_col, calls=place.calls))


@contextlib.contextmanager
def blocks():
    """Yields ``block(first_col)``, the context of each block of a split activation run in
    this thread; every block counts calls from where the forward stood before the first."""
    place = current()
    if place is None:
        yield lambda first_col: contextlib.nullcontext()
        return
    start = dict(place.calls)
    last = [start]

    def block(first_col: int):
        last[0] = dict(start)
        return _installed(replace(place, first_col=place.first_col + first_col, calls=last[0]))

    yield block
    place.calls.clear()
    place.calls.update(last[0])
