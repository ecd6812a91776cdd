"""Split a mean-reduced loss into a numerator and a denominator that can be summed over ranks.

A criterion with ``reduction="mean"`` on the global batch is ``sum_i l_i / D`` where ``D`` is
what it divides by: the sample count for plain cross-entropy, the summed class weights of the
non-ignored targets when ``weight`` / ``ignore_index`` are used, the element count of the
unreduced loss for any other torch loss (MSE, margin losses, ...). Each rank holds part of
the batch, so the global loss is ``sum_r S_r / sum_r D_r`` with ``S_r`` the rank's summed
loss and ``D_r`` its share of ``D``. Summing ``(S_r, D_r)`` over ranks
gives exactly the single-process loss, also for uneven or empty shares.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

__all__ = ["reduction_of", "local_sum"]


def reduction_of(criterion: Callable) -> str:
    """The criterion's ``reduction`` attribute; a plain function is taken to reduce by mean."""
    reduction = getattr(criterion, "reduction", "mean")
    if reduction not in ("mean", "sum", "batchmean"):
        raise ValueError(
            f"criterion {type(criterion).__name__} has reduction={reduction!r}; ddp needs a "
            "scalar loss (reduction 'mean', 'sum' or 'batchmean')"
        )
    return reduction


def _with_reduction(criterion: nn.Module, reduction: str) -> nn.Module:
    """A shallow copy of ``criterion`` (sharing ``weight``) with another ``reduction``."""
    other = copy.copy(criterion)
    other.reduction = reduction
    return other


def _ce_denominator(criterion, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy / NLL: summed ``weight[target]`` over non-ignored targets (or their count)."""
    if targets.is_floating_point():  # class probabilities: a mean over samples
        return torch.tensor(float(outputs.shape[0]), device=outputs.device)
    targets = targets.to(outputs.device)
    valid = targets != criterion.ignore_index
    if criterion.weight is None:
        return valid.sum().to(outputs.dtype)
    picked = criterion.weight.to(outputs.device)[targets.masked_fill(~valid, 0)]
    return (picked * valid).sum().to(outputs.dtype)


def local_sum(criterion: Callable, outputs: torch.Tensor, targets: torch.Tensor):
    """``(S, D)``: this rank's summed loss (with autograd) and what the mean divides it by.

    - cross-entropy / NLL with class-index targets: ``D`` is the sum of ``weight[target]``
      over targets that are not ``ignore_index`` (their count without ``weight``), which is
      how torch normalises ``weight``, ``ignore_index`` and ``label_smoothing``; with
      probability targets, the number of samples;
    - ``batchmean``: the number of samples;
    - other torch losses with ``mean``: the loss runs once with ``reduction="none"`` (on a
      shallow copy) and ``D`` is the number of its elements;
    - ``sum``: ``D`` is 1 (only ``S`` matters);
    - a plain function: taken as a mean over samples.

    With an empty share (0 samples) ``S`` is ``0 * outputs.sum()``: zero, yet connected to the
    graph, so backward still reaches every parameter and the gradient all-reduce of
    DistributedDataParallel runs on every rank. ``D`` is then 0.
    """
    device = outputs.device
    if outputs.shape[0] == 0:
        zero = outputs.sum() * 0.0
        return zero, torch.zeros((), device=device, dtype=zero.dtype)
    reduction = reduction_of(criterion)
    if reduction == "sum":
        return criterion(outputs, targets), torch.ones((), device=device)
    if reduction == "batchmean":
        return criterion(outputs, targets) * outputs.shape[0], torch.tensor(
            float(outputs.shape[0]), device=device)
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
        # The summed loss directly: a share whose targets are all ignored has a NaN mean.
        summed = _with_reduction(criterion, "sum")(outputs, targets)
        return summed, _ce_denominator(criterion, outputs, targets)
    if isinstance(criterion, nn.Module) and hasattr(criterion, "reduction"):
        losses = _with_reduction(criterion, "none")(outputs, targets)
        return losses.sum(), torch.tensor(float(losses.numel()), device=device)
    count = float(outputs.shape[0])  # a plain function: a mean over samples
    return criterion(outputs, targets) * count, torch.tensor(count, device=device)
