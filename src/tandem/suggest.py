"""Did you mean: the names that look like a mistyped one (a model, a setting, a data set, a
factory's function, a flag)."""

from __future__ import annotations

import difflib
import re


def closest_names(name: str, names: list[str], limit: int = 3) -> list[str]:
    """Up to ``limit`` of ``names`` that look like ``name`` (difflib, ignoring case, ``_`` and
    ``-``), best first: those within 0.1 of the best (the best alone when exact), ties to the
    nearer depth (``cifar_resnet21``: ``cifar_resnet20`` first)."""
    def plain(s: str) -> str:
        return re.sub(r"[_\-]", "", s.lower())

    def depth(s: str) -> int | None:
        digits = re.findall(r"\d+", s)
        return int(digits[0]) if digits else None

    typed, typed_depth = plain(name), depth(name)
    scored = []
    for candidate in names:
        ratio = difflib.SequenceMatcher(None, typed, plain(candidate)).ratio()
        if ratio >= 0.6:
            own = depth(candidate)
            gap = abs(own - typed_depth) if own is not None and typed_depth is not None else 0
            scored.append((-round(ratio, 6), gap, candidate))
    scored.sort()
    best = -scored[0][0] if scored else 0.0
    margin = 0.0 if best == 1.0 else 0.1
    return [c for r, _, c in scored if -r >= best - margin][:limit]


def did_you_mean(name: str, names: list[str], limit: int = 3) -> str:
    """``": did you mean a, b or c?"`` for :func:`closest_names`, or ``""``."""
    close = closest_names(name, names, limit)
    if not close:
        return ""
    return f": did you mean {', '.join(close[:-1]) + ' or ' if len(close) > 1 else ''}{close[-1]}?"
