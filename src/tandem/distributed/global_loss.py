"""Split a mean-reduced loss into a numerator and a denominator that can be summed over ranks.

A criterion with ``reduction="mean"`` on the global batch is ``sum_i l_i / D`` where ``D`` is
what it divides by: the sample count for plain cross-entropy, the summed class weights of the
non-ignored targets when ``weight`` / ``ignore_index`` are used, the element count for an
elementwise loss such as MSE. Each rank holds part of the batch, so the global loss is
``sum_r S_r / sum_r D_r`` with ``S_r = local_mean_r * D_r``. Summing ``(S_r, D_r)`` over ranks
gives exactly the single-process loss, also for uneven or empty shares.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["reduction_of", "local_denominator", "local_sum"]


def reduction_of(criterion: Callable) -> str:
    """The criterion's ``reduction`` attribute; a plain function is taken to reduce by mean."""
    reduction = getattr(criterion, "reduction", "mean")
    if reduction not in ("mean", "sum", "batchmean"):
        raise ValueError(
            f"criterion {type(criterion).__name__} has reduction={reduction!r}; ddp needs a "
            "scalar loss (reduction 'mean', 'sum' or 'batchmean')"
        )
    return reduction


def local_denominator(criterion: Callable, outputs: torch.Tensor,
                      targets: torch.Tensor) -> torch.Tensor:
    """What ``criterion`` (mean-reduced) divides this rank's summed loss by, as a 0-dim tensor.

    Cross-entropy / NLL with class-index targets: the sum of ``weight[target]`` over targets
    that are not ``ignore_index`` (the count of such targets without ``weight``). Probability
    targets, and ``batchmean``: the number of samples. Other losses: the number of output
    elements (an elementwise mean). ``sum`` reduction: 1.
    """
    reduction = reduction_of(criterion)
    if reduction == "sum":
        return torch.ones((), device=outputs.device)
    if reduction == "batchmean":
        return torch.tensor(float(outputs.shape[0]), device=outputs.device)
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and not targets.is_floating_point():
        targets = targets.to(outputs.device)
        valid = targets != criterion.ignore_index
        weight = criterion.weight
        if weight is None:
            return valid.sum().to(outputs.dtype)
        picked = weight.to(outputs.device)[targets.masked_fill(~valid, 0)]
        return (picked * valid).sum().to(outputs.dtype)
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return torch.tensor(float(outputs.shape[0]), device=outputs.device)
    return torch.tensor(float(outputs.numel()), device=outputs.device)


def local_sum(criterion: Callable, outputs: torch.Tensor, targets: torch.Tensor):
    """``(S, D)``: this rank's summed loss (with autograd) and its denominator (no grad).

    With an empty share (0 samples) ``S`` is ``0 * outputs.sum()``: zero, yet connected to the
    graph, so backward still reaches every parameter and the gradient all-reduce of
    DistributedDataParallel runs on every rank.
    """
    if outputs.shape[0] == 0:
        zero = outputs.sum() * 0.0
        return zero, torch.zeros((), device=outputs.device, dtype=zero.dtype)
    value = criterion(outputs, targets)
    denominator = local_denominator(criterion, outputs, targets)
    return value * denominator, denominator.detach()
