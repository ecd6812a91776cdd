"""A rank's share of the global loss, as ``(S, D)`` tensors ready to all-reduce.

The argument for why this is exact lives in :mod:`tandem.parallel.loss_terms`; this module adds
what only ranks need: a ddp-specific refusal of ``reduction="none"`` and empty shares that stay
in the graph.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.parallel.loss_terms import loss_terms
from tandem.errors import UsageError

__all__ = ["reduction_of", "local_sum"]


def reduction_of(criterion: Callable) -> str:
    """The criterion's ``reduction`` attribute; a plain function is taken to reduce by mean."""
    reduction = getattr(criterion, "reduction", "mean")
    if reduction not in ("mean", "sum", "batchmean"):
        raise UsageError(
            f"criterion {type(criterion).__name__} has reduction={reduction!r}; ddp needs a "
            "scalar loss (reduction 'mean', 'sum' or 'batchmean')"
        )
    return reduction


def local_sum(criterion: Callable, outputs: torch.Tensor, targets: torch.Tensor):
    """``(S, D)``: this rank's summed loss (with autograd) and what the mean divides it by.

    Both come from :func:`tandem.parallel.loss_terms.loss_terms`, ``D`` as a 0-dim tensor on
    ``outputs``' device. An empty share gives ``S = 0 * outputs.sum()`` (still in the graph, so
    DDP's gradient all-reduce runs on every rank) and ``D = 0``.
    """
    device = outputs.device
    if outputs.shape[0] == 0:
        zero = outputs.sum() * 0.0
        return zero, torch.zeros((), device=device, dtype=zero.dtype)
    reduction_of(criterion)  # refuses reduction="none" with a ddp-specific message
    summed, normaliser = loss_terms(criterion, outputs, (targets,))
    if not isinstance(normaliser, torch.Tensor):
        normaliser = torch.tensor(normaliser, device=device)
    return summed, normaliser
