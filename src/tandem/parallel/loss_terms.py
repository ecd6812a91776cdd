"""Split a loss into a summed part and a normaliser that add up exactly over chunks.

The one home of the exact-loss argument. A mean loss is ``sum_i l_i / D``, ``D`` being what
torch divides by. Split over chunks (devices or ranks), chunk ``c`` gives ``S_c`` (its summed
loss) and ``D_c`` (its share of ``D``); both add up, so ``sum_c S_c / sum_c D_c`` is the
single-device loss for uneven chunks too, where the mean of the chunks' means is not. ``D``:

* ``CrossEntropyLoss`` / ``NLLLoss``, ``"mean"``, class-index targets: the sum of
  ``weight[target]`` over targets that are not ``ignore_index`` (their count without
  ``weight``), as torch normalises; a chunk of ignored targets gives ``S = D = 0``, not NaN.
  Class-probability targets: samples times positions (``output.numel() // output.shape[1]``).
* ``"batchmean"`` (``KLDivLoss``): ``output.shape[0]``. ``"sum"``: 1.
* any other torch loss with ``"mean"``: the element count of its ``reduction="none"`` loss.
* any other callable: taken as a mean over the ``batch_dim`` samples (``S = loss * n``,
  ``D = n``); exact only for criteria that are such a mean.

Over ranks DDP *averages* gradients, so each rank back-propagates ``S_r * world_size / D``
with ``D = sum_r D_r`` all-reduced every step. A rank with an empty share uses
``S = 0 * output.sum()`` and ``D = 0``: zero, yet in the graph, so DDP's all-reduce still runs.
The criterion is never modified: other reductions run on shallow copies sharing its ``weight``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from tandem.errors import UsageError

from .scatter_gather import first_tensor

# the torch ``reduction`` values reproduced over chunks ("none": the caller concatenates)
REDUCTIONS = ("mean", "sum", "none", "batchmean")


class LossTerms(NamedTuple):
    """A chunk's summed loss (with autograd) and its share of ``D``: a float when shapes decide
    it (no device sync), else a 0-dim tensor on the output's device."""

    summed: torch.Tensor
    normaliser: torch.Tensor | float


def with_reduction(criterion: nn.Module, reduction: str) -> nn.Module:
    """A shallow copy of ``criterion`` (sharing ``weight``) with another ``reduction``."""
    other = copy.copy(criterion)
    other.reduction = reduction
    return other


def class_normaliser(criterion: nn.Module, output: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor | float:
    """torch's ``"mean"`` denominator of a CrossEntropy / NLL ``criterion`` for this chunk,
    without a host sync: a 0-dim tensor in ``output``'s floating dtype, at least float32 (counts
    stay exact under half precision); a float for class-probability targets."""
    if target.is_floating_point():  # class probabilities: one per sample (and position)
        return float(output.numel() // output.shape[1] if output.dim() > 1 else 1)
    dtype = torch.promote_types(output.dtype, torch.float32)
    target = target.to(output.device)
    valid = target != criterion.ignore_index
    if criterion.weight is None:
        return valid.sum().to(dtype)
    # masked_fill keeps ignored indices (possibly out of range, e.g. -100) from indexing weight
    picked = criterion.weight.to(output.device)[target.masked_fill(~valid, 0)]
    return (picked * valid).sum().to(dtype)


def sample_mean_terms(loss: torch.Tensor, samples: int) -> LossTerms:
    """Terms of a loss taken as a mean over ``samples`` samples: ``(loss * samples, samples)``."""
    return LossTerms(loss * samples, float(samples))


def call_criterion(criterion: Callable, output, targets: tuple, kwargs: dict):
    """``criterion(*output, *targets)`` for a tuple output, else ``criterion(output, *targets)``."""
    if isinstance(output, (tuple, list)):
        return criterion(*output, *targets, **kwargs)
    return criterion(output, *targets, **kwargs)


def loss_terms(criterion: Callable, output: Any, targets: tuple = (),
               kwargs: dict | None = None, *, batch_dim: int = 0) -> LossTerms:
    """``(S, D)`` of ``criterion`` on one chunk (see the module doc), running it once.
    ``output``: a tensor, or a tuple passed unpacked; ``batch_dim``: a plain callable's sample
    dim. Refuses ``reduction="none"`` and a plain callable whose result is not a 0-dim tensor."""
    kwargs = kwargs or {}
    first = first_tensor(output)
    if first is None:
        raise UsageError(f"loss_terms: the output of {type(criterion).__name__} holds no tensor")
    reduction = getattr(criterion, "reduction", None)
    if not (isinstance(criterion, nn.Module) and reduction in REDUCTIONS):
        loss = call_criterion(criterion, output, targets, kwargs)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            name = getattr(criterion, "__name__", type(criterion).__name__)
            raise UsageError(f"loss_terms: criterion {name} returned no scalar tensor (a plain "
                             "callable is taken as a mean over samples)")
        return sample_mean_terms(loss, first.shape[batch_dim])
    if reduction == "none":
        raise UsageError(f"loss_terms: {type(criterion).__name__} has reduction='none'; "
                         "there is no mean to split")
    if reduction == "sum":
        return LossTerms(call_criterion(criterion, output, targets, kwargs), 1.0)
    if reduction == "batchmean":
        summed = call_criterion(with_reduction(criterion, "sum"), output, targets, kwargs)
        return LossTerms(summed, float(first.shape[0]))
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
        # the summed loss directly: a chunk whose targets are all ignored has a NaN mean
        summed = call_criterion(with_reduction(criterion, "sum"), output, targets, kwargs)
        return LossTerms(summed, class_normaliser(criterion, first, targets[0]))
    losses = call_criterion(with_reduction(criterion, "none"), output, targets, kwargs)
    return LossTerms(losses.sum(), float(losses.numel()))
