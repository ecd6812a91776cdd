"""A rank's share of the global loss, as ``(S, D)`` tensors ready to all-reduce (why it is
exact: :mod:`tandem.parallel.loss_terms`), with empty shares that stay in the graph.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.parallel.loss_terms import loss_terms
from tandem.errors import UsageError

from .process_group import all_reduce_sum

def reduction_of(criterion: Callable) -> str:
    """The criterion's ``reduction`` attribute; a plain function is taken to reduce by mean."""
    reduction = getattr(criterion, "reduction", "mean")
    if reduction not in ("mean", "sum", "batchmean"):
        raise UsageError(f"criterion {type(criterion).__name__} has reduction={reduction!r}; "
                         "ddp needs a scalar loss (reduction 'mean', 'sum' or 'batchmean')")
    return reduction


def local_sum(criterion: Callable, outputs: torch.Tensor, targets: torch.Tensor):
    """``(S, D)``: this rank's summed loss (with autograd) and what the mean divides it by
    (a 0-dim tensor). An empty share gives ``S = 0 * outputs.sum()`` (still in the graph, so
    DDP's gradient all-reduce runs on every rank) and ``D = 0``."""
    if outputs.shape[0] == 0:
        zero = outputs.sum() * 0.0
        return zero, zero.new_zeros(())
    reduction_of(criterion)  # refuses reduction="none" with a ddp-specific message
    summed, normaliser = loss_terms(criterion, outputs, (targets,))
    if not isinstance(normaliser, torch.Tensor):
        normaliser = torch.tensor(normaliser, device=outputs.device)
    return summed, normaliser


def global_mean(criterion: Callable, summed: torch.Tensor, denominator: torch.Tensor,
                count: int, world_size: int, device: torch.device):
    """``(loss, total_count)`` over every rank's samples from this rank's :func:`local_sum` of
    ``count``, by one all-reduce that stays on the device. Its value is the global mean (or
    sum); its gradient that of ``S * world / D``, which DDP's average makes the global mean's."""
    stats = torch.stack([summed.detach().double(), denominator.double(),
                         summed.new_full((), float(count), dtype=torch.float64)])
    total_sum, total_den, total_count = all_reduce_sum(stats, device).unbind()
    if reduction_of(criterion) == "sum":  # the global loss is the plain sum of S_r
        total_den = torch.ones_like(total_den)
    mean = (total_sum / total_den).to(summed.dtype)  # 0/0: nan, as no samples anywhere
    if not summed.requires_grad:
        return mean, total_count
    scale = torch.where(total_den != 0, world_size / total_den, torch.ones_like(total_den))
    scaled = summed * scale.to(summed.dtype)
    return scaled + (mean - scaled).detach(), total_count
