"""Where a forward stands in the run, for the layers that draw keyed randomness.

The training loop opens one :func:`step_stream` per forward, keyed by ``(seed, optimizer step,
micro-batch)`` and placed at this process's first row of the global batch. The code that cuts
the batch then says where the part it runs sits: ``DataParallel`` moves each replica to its
chunk's first row (:func:`shifted`), hybrid's split head moves a block of features to its
first column (:func:`blocks` in one process, :func:`at` across processes), and
``parallel_apply`` carries the place into each replica thread (:func:`use`). A keyed layer asks
:meth:`Place.draw` for its key: the step's key, the layer's name, and how many times the layer
ran before in this forward, counted per thread (each replica runs the whole forward once), so
a layer that runs twice draws two masks.

Outside a stream (validation, a model used outside tandem's loop) :func:`current` is ``None``
and keyed layers draw from torch's generator, as torch's own do.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, replace

from .keys import mix_seed, name_key


@dataclass(frozen=True)
class Place:
    """The step's key and where this code's rows and columns start: ``first_row`` is the
    index in the global batch of its first sample, ``first_col`` the index of its first
    feature (a block of a split layer; 0 otherwise). ``calls``: this thread's count of each
    layer's calls in this forward."""

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
    """The stream of micro-batch ``micro`` of optimizer step ``step`` (the loop's), whose
    rows start at ``first_row`` of the global batch (this process's share)."""
    return _installed(Place(mix_seed(seed, step, micro), first_row))


def use(place: Place | None):
    """Enter ``place`` (the caller's, captured with :func:`current`) in a replica thread, with
    call counts of its own: every replica runs the whole forward."""
    return _installed(None if place is None else replace(place, calls=dict(place.calls)))


def shifted(rows: int):
    """This thread's place moved ``rows`` rows on (a replica's chunk within the caller's
    rows); nothing outside a stream."""
    place = current()
    if place is None or not rows:
        return contextlib.nullcontext()
    return _installed(replace(place, first_row=place.first_row + rows, calls=place.calls))


def at(first_row: int, first_col: int):
    """This thread's place with its rows starting at ``first_row`` of the global batch and
    its features at ``first_col`` (a rank's block of a split layer, over every rank's rows)."""
    place = current()
    if place is None:
        return contextlib.nullcontext()
    return _installed(replace(place, first_row=first_row, first_col=first_col,
                              calls=place.calls))


@contextlib.contextmanager
def blocks():
    """For the blocks of one split activation, run one after the other in this thread:
    yields ``block(first_col)``, the context of the block whose features start at
    ``first_col``. Each block counts calls from where the forward stood before the first, so
    a layer run on every block draws as one call of it on the whole activation would."""
    place = current()
    if place is None:
        yield lambda first_col: contextlib.nullcontext()
        return
    start = dict(place.calls)
    last = [start]

    def block(first_col: int):
        last[0] = dict(start)
        return _installed(replace(place, first_col=place.first_col + first_col,
                                  calls=last[0]))

    yield block
    place.calls.clear()
    place.calls.update(last[0])
