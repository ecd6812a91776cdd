"""Split a mean-reduced loss into a numerator and a denominator that can be summed over ranks.

Each rank holds part of the global batch, so the global loss is ``sum_r S_r / sum_r D_r`` with
``S_r`` the rank's summed loss and ``D_r`` its share of what the mean divides by. Summing
``(S_r, D_r)`` over ranks gives exactly the single-process loss, also for uneven or empty
shares. What ``D`` is for each criterion lives in :mod:`tandem.parallel.loss_terms` (shared
with ``DataParallelCriterion``); this module adds what only ranks need: a ddp-specific refusal
of ``reduction="none"``, tensors for the all-reduce, and empty shares that stay in the graph.
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

    ``S`` and ``D`` are :func:`tandem.parallel.loss_terms.loss_terms` of this rank's share
    (see there for ``D``: summed ``weight[target]`` over non-ignored targets for cross-entropy
    / NLL, the batch size for ``batchmean``, the unreduced element count for other torch
    means, 1 for ``sum``, the sample count for a plain function), with ``D`` as a 0-dim
    tensor on ``outputs``' device.

    With an empty share (0 samples) ``S`` is ``0 * outputs.sum()``: zero, yet connected to the
    graph, so backward still reaches every parameter and the gradient all-reduce of
    DistributedDataParallel runs on every rank. ``D`` is then 0.
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
