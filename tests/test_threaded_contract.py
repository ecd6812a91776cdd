"""The threaded backward's contract: the path is decided once (at construction, or by the run
plan and kept in config.json), not by the thread count at forward time; the join's two walks
over the outputs agree; SyncBatchNorm's replicas meet through the group they were handed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel, DataParallelModel, threaded_backward


class _TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x)}


def test_join_refuses_outputs_walked_in_another_order(monkeypatch):
    model = _TwoOut()
    x = torch.randn(6, 4)
    out = DataParallelModel(model, ["cpu"] * 2, backward_threads=True)(x)
    assert sum(o["a"].sum() + o["b"].sum() for o in out).requires_grad  # the order agrees
    walk = threaded_backward.tensors_in
    monkeypatch.setattr(threaded_backward, "tensors_in", lambda obj: reversed(list(walk(obj))))
    with pytest.raises(RuntimeError, match="another order"):
        DataParallelModel(model, ["cpu"] * 2, backward_threads=True)(x)
