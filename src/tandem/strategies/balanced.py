"""``balanced``: model *and* criterion parallel, so outputs never pile up on device 0.

Each device computes its share of the loss where its output lives; only scalars travel to
device 0, combined into the exact whole-batch loss (:mod:`tandem.parallel.loss_terms`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tandem.parallel import DataParallelCriterion, DataParallelModel, scatter

from .base import StepOutput, Strategy, register, top5_hits
from .dp import ReplicatedStrategy, prepare_replicated

__all__ = ["BalancedStrategy"]


@register
class BalancedStrategy(ReplicatedStrategy):
    name = "balanced"

    def __init__(self, devices, **kwargs):
        super().__init__(devices, **kwargs)
        # One parallel criterion per plain criterion the loop hands us (normally just one).
        self._criteria: dict[int, tuple[Callable, DataParallelCriterion]] = {}

    def setup(self, model: nn.Module) -> nn.Module:
        return DataParallelModel(prepare_replicated(self, model), **self.wrapper_options())

    def _parallel_criterion(self, criterion: Callable) -> DataParallelCriterion:
        key = id(criterion)
        if key not in self._criteria:
            wrapped = DataParallelCriterion(criterion, device_ids=self.devices,
                                            output_device=self.device)
            self._criteria[key] = (criterion, wrapped)  # keep criterion alive: id stays unique
        return self._criteria[key][1]

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor) -> StepOutput:
        outputs = wrapped(images)  # list: one [chunk, classes] tensor per used device
        loss = self._parallel_criterion(criterion)(outputs, targets)
        chunks = scatter(targets, [o.device for o in outputs],
                         chunk_sizes=[o.shape[0] for o in outputs])  # the outputs' shares
        if len(chunks) != len(outputs):
            raise RuntimeError(
                f"balanced: {len(outputs)} output chunks but targets split into {len(chunks)}"
            )
        correct = sum(
            (out.argmax(1) == tgt.to(out.device)).sum().to(self.device)
            for out, tgt in zip(outputs, chunks)
        )
        correct5 = sum(top5_hits(out, tgt).to(self.device) for out, tgt in zip(outputs, chunks))
        return StepOutput(loss, correct, targets.shape[0], correct5)
