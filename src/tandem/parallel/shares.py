"""A batch cut by weights: the one home of dividing a batch (``--split``, the scattered chunks,
the loader's per-rank shards, hybrid's feature shards).

Largest remainder, ties to the lower index, so every process cuts a batch alike. Equal weights
give the balanced cut, larger first: 10 over 4 is 3, 3, 2, 2; 2 over 4 is 1, 1, 0, 0.
"""

from __future__ import annotations

import math
from typing import Sequence

def shares(batch: int, weights: Sequence[float]) -> list[int]:
    """Samples per device for ``batch``: proportional to ``weights``, largest remainder
    (``[1] * n``: balanced over ``n``)."""
    total = float(sum(weights))
    exact = [batch * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    left = batch - sum(out)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:left]:
        out[i] += 1
    return out


def capped(batch: int, weights: Sequence[float], max_share: int | None) -> list[int]:
    """:func:`shares`, with what is over ``max_share`` moved to the devices under it (in
    proportion to their weights); the caps must hold ``batch`` (see :func:`check_max_share`)."""
    sizes = shares(batch, weights)
    if max_share is None:
        return sizes
    fixed = [s >= max_share for s in sizes]
    while True:
        free = [w if not f else 0.0 for w, f in zip(weights, fixed)]
        rest = batch - max_share * sum(fixed)
        if not any(free):
            free = [0.0 if f else 1.0 for f in fixed]
        part = shares(rest, free) if any(free) else [0] * len(weights)
        sizes = [max_share if f else p for f, p in zip(fixed, part)]
        over = [not f and s > max_share for f, s in zip(fixed, sizes)]
        if not any(over):
            return sizes
        fixed = [f or o for f, o in zip(fixed, over)]


def format_shares(values: Sequence[float]) -> str:
    """``3,1``: how messages and logs write shares and weights."""
    return ",".join(f"{v:g}" for v in values)
