"""``DataParallelCriterion``: each device computes its share of the loss where its output lives.

Paired with :class:`~tandem.parallel.DataParallelModel`, only scalar partial losses travel to
``output_device``; the result equals the single-device loss for uneven chunks
(:mod:`tandem.parallel.loss_terms`). ``reduction="none"`` and a callable with a non-scalar
result are gathered on ``output_device``. ``CTCLoss`` is refused.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from tandem.errors import UsageError

from . import traffic
from .broadcast import ordered_sum
from .devices import as_device, device_scope, index_of, resolve_devices
from .loss_terms import REDUCTIONS, call_criterion, first_tensor, loss_terms, sample_mean_terms
from .replicate import replicate
from .scatter_gather import batch_size, gather, nbytes, scatter


class DataParallelCriterion(nn.Module):
    """Compute ``criterion`` on per-device outputs and return one scalar on ``output_device``.

    ``forward(outputs, *targets, **kwargs)``: ``outputs`` lists
    :class:`~tandem.parallel.DataParallelModel`'s per-device outputs (a tuple one is passed as
    ``criterion(*output, *targets)``; a single tensor or tuple is one chunk). Targets and
    tensor kwargs are split along ``dim`` to match each output's size and device.
    """

    def __init__(self, criterion: Callable, device_ids: Sequence | None = None,
                 output_device=None, dim: int = 0):
        super().__init__()
        if isinstance(criterion, nn.CTCLoss):
            raise UsageError("DataParallelCriterion does not support CTCLoss (per-sample "
                             "target-length normalisation, batch in dim 1)")
        self.criterion = criterion
        self.device_ids = resolve_devices(device_ids)
        self.output_device = self.device_ids[0] if output_device is None else as_device(output_device)
        self.dim = dim

    def forward(self, outputs, *targets, **kwargs):
        if not isinstance(outputs, list):
            outputs = [outputs]
        firsts = [first_tensor(o) for o in outputs]
        for i, t in enumerate(firsts):
            if t is None:
                raise UsageError(f"DataParallelCriterion: output {i} holds no tensor")
        devices = [t.device for t in firsts]
        sizes = [batch_size(t, self.dim) for t in firsts]
        if any(s is None for s in sizes):
            raise UsageError(f"DataParallelCriterion: an output has no dimension {self.dim} to split")
        shares = scatter((targets, kwargs), devices, self.dim, chunk_sizes=sizes)
        reduction = getattr(self.criterion, "reduction", None)
        criterion = {d: self.criterion for d in devices}
        torch_loss = isinstance(self.criterion, nn.Module) and reduction in REDUCTIONS
        if torch_loss:  # its weight on each device
            unique = list(dict.fromkeys(devices))
            criterion = dict(zip(unique, replicate(self.criterion, unique)))
        terms = torch_loss and reduction != "none"  # (S, D) per chunk
        losses = []
        for out, (tgts, kw), device in zip(outputs, shares, devices):
            with device_scope(device):
                losses.append((loss_terms if terms else call_criterion)(criterion[device], out,
                                                                        tgts, kw))
        if terms:
            return self._combine(losses, devices, reduction == "sum")
        if torch_loss or not all(isinstance(l, torch.Tensor) and l.dim() == 0 for l in losses):
            return gather(losses, self.output_device, self.dim)
        return self._combine([sample_mean_terms(l, n) for l, n in zip(losses, sizes)], devices)

    def _combine(self, terms, devices, plain_sum: bool = False) -> torch.Tensor:
        """``sum S / sum D`` on ``output_device`` (``sum S`` alone for ``reduction="sum"``)."""
        total = self._sum_on_output([t.summed for t in terms], devices)
        if plain_sum:
            return total
        norms = [t.normaliser for t in terms]
        if isinstance(norms[0], torch.Tensor):  # depends on target values: stays on device
            return total / self._sum_on_output(norms, devices)
        return total / float(sum(norms))

    def _sum_on_output(self, scalars: list[torch.Tensor], devices) -> torch.Tensor:
        """Move each chunk's scalar to ``output_device`` (recording it) and add them up."""
        home = index_of(self.output_device, devices)
        for i, s in enumerate(scalars):
            if i != home and traffic.metering():
                traffic.record("loss", nbytes(s), home)
        return ordered_sum(scalars, self.output_device)

    def extra_repr(self) -> str:
        return f"output_device={self.output_device}, dim={self.dim}"
