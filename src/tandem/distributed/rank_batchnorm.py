"""Plain BatchNorm under ddp: frozen for an empty share (which must still run forward and
backward for DDP's collectives), running stats averaged over ranks (``--buffers average``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .process_group import all_reduce_sum

@contextlib.contextmanager
def frozen_batchnorm(layers: list[_BatchNorm]):
    """Run ``layers`` in eval mode for one empty-share forward; ``num_batches_tracked`` advances."""
    training = [m.training for m in layers]
    for m in layers:
        m.eval()
    try:
        yield
    finally:
        for m, was in zip(layers, training):
            m.train(was)
            if was and m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)


def average_running_stats(layers: list[_BatchNorm], count: int, total_count: torch.Tensor,
                          device: torch.device) -> None:
    """Replace ``layers``' running stats by their sample-weighted mean over ranks (``count``
    samples here, ``total_count`` everywhere; kept when no rank had one). New tensors are
    assigned, not written in place: autograd saved the old ones for backward."""
    layers = [m for m in layers if m.track_running_stats and m.running_mean is not None]
    if not layers:
        return
    flat = torch.cat([torch.cat([m.running_mean, m.running_var]) for m in layers])
    total = total_count.to(flat.dtype)
    summed = all_reduce_sum(flat * count, device)
    flat = torch.where(total > 0, summed / total.clamp(min=1), flat)
    parts = flat.split([m.running_mean.numel() for m in layers for _ in ("mean", "var")])
    for m, mean, var in zip(layers, parts[::2], parts[1::2]):
        m.running_mean, m.running_var = mean.clone(), var.clone()
