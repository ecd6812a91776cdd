"""``balanced``: model *and* criterion parallel, so outputs never pile up on device 0.

Each device computes its share of the loss where its output lives; only scalars travel to
device 0, combined into the exact whole-batch loss (:mod:`tandem.parallel.loss_terms`), and one
small vector of hits each (``metrics`` traffic).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tandem.parallel import DataParallelCriterion, DataParallelModel, scatter, traffic

from .base import StepOutput, register
from .dp import ReplicatedStrategy, prepare_replicated


@register
class BalancedStrategy(ReplicatedStrategy):
    name = "balanced"

    def __init__(self, devices, **kwargs):
        super().__init__(devices, **kwargs)
        # One parallel criterion per plain criterion the loop hands us (normally just one).
        self._criteria: dict[int, tuple[Callable, DataParallelCriterion]] = {}

    def setup(self, model: nn.Module) -> nn.Module:
        return DataParallelModel(prepare_replicated(self, model), **self.wrapper_options())

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor, batch_size: int | None = None) -> StepOutput:
        outputs = [self._logits(o) for o in wrapped(images)]  # one chunk per used device
        if id(criterion) not in self._criteria:  # kept beside it, the criterion's id stays unique
            self._criteria[id(criterion)] = (criterion, DataParallelCriterion(
                criterion, device_ids=self.devices, output_device=self.device))
        loss = self._criteria[id(criterion)][1](outputs, targets)
        chunks = scatter(targets, [o.device for o in outputs],
                         chunk_sizes=[o.shape[0] for o in outputs])  # the outputs' shares
        if len(chunks) != len(outputs):
            raise RuntimeError(
                f"balanced: {len(outputs)} output chunks but targets split into {len(chunks)}")
        scores = [self._score(criterion, out, tgt, tgt.shape[0])
                  for out, tgt in zip(outputs, chunks)]
        return StepOutput(loss, *self._sum_scores(scores, [o.device for o in outputs]))

    def _sum_scores(self, scores: list[tuple], devices: list[torch.device]) -> tuple:
        """Each device's ``(correct, count, correct5, confusion, ce_sum)`` summed on device 0:
        one flat vector from each device, whatever the batch or image size."""
        dense, plain = scores[0][3] is not None, scores[0][4] is not None
        total = None
        for i, ((correct, _, correct5, confusion, ce_sum), device) in enumerate(
                zip(scores, devices)):
            if dense:
                flat = torch.cat([correct.reshape(1), confusion.reshape(-1)])
            else:  # the counts in float64 beside plain cross-entropy: exact up to 2**53
                flat = torch.stack([correct.double(), correct5.double(),
                                    *([ce_sum.double()] if plain else [])])
            if i and traffic.metering():  # logical replicas: chunk 0 is already on device 0
                traffic.record("metrics", flat.numel() * flat.element_size(), 0)
            flat = flat.to(self.device)
            total = flat if total is None else total + flat
        count = sum(s[1] for s in scores)
        if dense:
            classes = scores[0][3].shape[0]
            return total[0], count, None, total[1:].reshape(classes, classes), None
        return total[0], count, total[1], None, total[2] if plain else None
