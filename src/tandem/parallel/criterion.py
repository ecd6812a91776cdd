"""``DataParallelCriterion``: each device computes its share of the loss where its output lives.

Paired with :class:`~tandem.parallel.DataParallelModel` (outputs left on their devices), only
scalar partial losses travel to ``output_device``, so no device collects the whole output:
that is what keeps memory balanced. The result equals ``criterion(whole_output, whole_target)``
on one device, to float rounding, for uneven chunks too. How each kind of criterion is split:

* torch losses with ``reduction="mean"``, ``"sum"`` or ``"batchmean"``: each chunk runs on a
  shallow copy of the criterion with ``reduction="sum"`` and the sums are divided by the
  *global* normaliser, summed from the chunks:

  - ``CrossEntropyLoss`` / ``NLLLoss`` with class-index targets: the sum of ``weight[target]``
    over targets that are not ``ignore_index`` (their count without ``weight``). This is how
    torch normalises ``weight``, ``ignore_index`` and ``label_smoothing``; a chunk where every
    target is ignored adds 0 to both sides. With class-probability targets: the number of
    samples.
  - ``KLDivLoss(reduction="batchmean")``: the batch size.
  - any other ``"mean"`` loss: the number of elements of its unreduced loss (each chunk runs
    with ``reduction="none"`` to count them, which also covers the margin losses whose mean is
    over samples rather than input elements).
  - ``"sum"``: no normaliser.
* ``reduction="none"``: the per-element losses are concatenated along ``dim`` on
  ``output_device`` (these do travel).
* any other callable (no ``reduction`` attribute): chunk results are weighted by chunk size,
  ``sum(n_i * loss_i) / N``. This is exact for criteria that are a mean over the batch, and
  *not* for ones normalised otherwise (pass the torch loss module instead of a lambda).

``CTCLoss`` is not supported (its mean divides each sample by its own target length, and its
batch is dimension 1 of the log-probabilities); it raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import traffic
from .devices import resolve_devices, to_device
from .replicate import replicate
from .scatter_gather import batch_size, gather, scatter

__all__ = ["DataParallelCriterion"]

_REDUCTIONS = ("mean", "sum", "none", "batchmean")


def _first_tensor(obj) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(obj, dict):
        return _first_tensor(list(obj.values()))
    return None


def _with_reduction(criterion: nn.Module, reduction: str) -> nn.Module:
    """A shallow copy of ``criterion`` with another ``reduction`` (the original is untouched)."""
    copy = criterion.__class__.__new__(criterion.__class__)
    copy.__dict__ = criterion.__dict__.copy()
    copy.__dict__["reduction"] = reduction
    return copy


def _device_scope(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class DataParallelCriterion(nn.Module):
    """Compute ``criterion`` on per-device outputs and return one scalar on ``output_device``.

    ``forward(outputs, *targets, **kwargs)``: ``outputs`` is the list of per-device outputs of
    :class:`~tandem.parallel.DataParallelModel` (each a tensor, or a tuple passed as
    ``criterion(*output, *targets)``); a single tensor or tuple counts as one chunk. Targets
    (and tensor kwargs) are split along ``dim`` to match each output's size and device.
    """

    def __init__(self, criterion: Callable, device_ids: Sequence | None = None,
                 output_device=None, dim: int = 0):
        super().__init__()
        if isinstance(criterion, nn.CTCLoss):
            raise ValueError("DataParallelCriterion does not support CTCLoss (per-sample "
                             "target-length normalisation, batch in dim 1)")
        self.criterion = criterion
        self.device_ids = resolve_devices(device_ids)
        self.output_device = self.device_ids[0] if output_device is None else to_device(output_device)
        self.dim = dim

    def forward(self, outputs, *targets, **kwargs):
        if not isinstance(outputs, list):
            outputs = [outputs]
        firsts = [_first_tensor(o) for o in outputs]
        for i, t in enumerate(firsts):
            if t is None:
                raise ValueError(f"DataParallelCriterion: output {i} holds no tensor")
        devices = [t.device for t in firsts]
        sizes = [batch_size(t, self.dim) for t in firsts]
        if any(s is None for s in sizes):
            raise ValueError(f"DataParallelCriterion: an output has no dimension {self.dim} to split")
        # targets follow the outputs: same chunk sizes, same devices
        shares = scatter((targets, kwargs), devices, self.dim, chunk_sizes=sizes)
        reduction = getattr(self.criterion, "reduction", None)
        if isinstance(self.criterion, nn.Module) and reduction in _REDUCTIONS:
            return self._reduce_module(outputs, shares, devices, reduction)
        return self._reduce_callable(outputs, shares, devices, sizes)

    # -- torch losses ------------------------------------------------------------------------
    def _copies(self, devices: list[torch.device], reduction: str) -> dict:
        unique = list(dict.fromkeys(devices))
        replicas = replicate(self.criterion, unique)
        return {d: _with_reduction(r, reduction) for d, r in zip(unique, replicas)}

    def _reduce_module(self, outputs, shares, devices, reduction: str):
        class_loss = isinstance(self.criterion, (nn.CrossEntropyLoss, nn.NLLLoss))
        per_chunk = "none" if reduction == "none" or (reduction == "mean" and not class_loss) else "sum"
        copies = self._copies(devices, per_chunk)
        losses, norms = [], []
        for out, (tgts, kw), device in zip(outputs, shares, devices):
            crit = copies[device]
            with _device_scope(device):
                loss = crit(*out, *tgts, **kw) if isinstance(out, (tuple, list)) else crit(out, *tgts, **kw)
                if reduction == "none":
                    losses.append(loss)
                    continue
                if per_chunk == "none":  # generic mean: count the unreduced elements
                    norms.append(loss.numel())
                    loss = loss.sum()
                elif reduction == "batchmean":
                    norms.append(_first_tensor(out).shape[0])
                elif reduction == "mean":
                    norms.append(self._class_weight_total(crit, _first_tensor(out), tgts[0]))
                losses.append(loss)
        if reduction == "none":
            return gather(losses, self.output_device, self.dim)
        total = self._sum_on_output(losses, devices)
        if reduction == "sum":
            return total
        if isinstance(norms[0], torch.Tensor):
            norm = self._sum_on_output(norms, devices)
        else:
            norm = float(sum(norms))
        return total / norm

    @staticmethod
    def _class_weight_total(crit, output: torch.Tensor, target: torch.Tensor):
        """torch's 'mean' denominator of CrossEntropy/NLL for this chunk."""
        if target.is_floating_point():  # class probabilities: one per sample (and position)
            return output.numel() // output.shape[1] if output.dim() > 1 else 1
        valid = target[target != crit.ignore_index]
        if crit.weight is None:
            return torch.tensor(float(valid.numel()), device=target.device)
        return crit.weight[valid].sum()

    # -- arbitrary callables -----------------------------------------------------------------
    def _reduce_callable(self, outputs, shares, devices, sizes):
        losses = []
        for out, (tgts, kw), device in zip(outputs, shares, devices):
            with _device_scope(device):
                fn = self.criterion
                losses.append(fn(*out, *tgts, **kw) if isinstance(out, (tuple, list))
                              else fn(out, *tgts, **kw))
        if not all(isinstance(l, torch.Tensor) and l.dim() == 0 for l in losses):
            return gather(losses, self.output_device, self.dim)
        total = float(sum(sizes))
        weighted = [l * (n / total) for l, n in zip(losses, sizes)]
        return self._sum_on_output(weighted, devices)

    def _sum_on_output(self, scalars: list[torch.Tensor], devices) -> torch.Tensor:
        """Move each chunk's scalar to ``output_device`` (recording it) and add them up."""
        target = self.output_device
        home = next((i for i, d in enumerate(devices) if d == target), None)
        total = None
        for i, s in enumerate(scalars):
            if i != home and traffic.metering():
                traffic.record("loss", s.numel() * s.element_size(), home)
            s = s.to(target)
            total = s if total is None else total + s
        return total

    def extra_repr(self) -> str:
        return f"output_device={self.output_device}, dim={self.dim}"
